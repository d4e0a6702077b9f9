"""Every emulation entry point refuses, by name, inputs that share memory with the cache, caches
whose tensors share memory, meta tensors and tensors on another device than the cache.

A call writes the cache (the ring's append, a flush's copies, the counters) while other
programs still read the inputs: an input over the cache's bytes reads what was written (`x`
as a view of `cache.hi` on a Mamba-2 flush step, unchecked, changes y and the ring by up to
5.65 against a copy of the same x). A meta tensor has no data: a kernel would read nothing.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton cannot compile for a CPU: interpret (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gdn_emulation_cases import make_token  # noqa: E402

from emulation import numerics  # noqa: E402
from emulation.gdn_replay_decode import (  # noqa: E402
    GDNReplayCache,
    gdn_replay_decode,
    kda_replay_decode,
)
from emulation.gdn_replay_spec import gdn_replay_verify, kda_replay_verify  # noqa: E402
from emulation.gdn_state_update import gdn_state_update, kda_state_update  # noqa: E402
from emulation.replay_decode import ReplayCache, mamba2_replay_decode  # noqa: E402
from emulation.replay_spec import mamba2_replay_commit, mamba2_replay_verify  # noqa: E402
from emulation.state_update import StateCache, mamba2_state_update  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter tests (compiled Triton needs a GPU)")

H, P, N = 2, 4, 32  # heads, headdim (dv), dstate (dk)


def over(tensor, like):
    """A view of `tensor`'s first bytes with `like`'s shape and dtype (a caller's aliasing)."""
    n = like.numel() * like.element_size()
    return tensor.view(-1).view(torch.uint8)[:n].view(like.dtype).view(like.shape)


def mamba2_token(slots, T=None, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    t = () if T is None else (T,)
    d = dict(x=torch.randn(slots, H, *t, P, generator=gen),
             dt=torch.randn(slots, H, *t, generator=gen),
             A=-torch.rand(H, generator=gen) - 0.2,
             B=torch.randn(slots, 1, *t, N, generator=gen),
             C=torch.randn(slots, 1, *t, N, generator=gen))
    return {k: v.to(device) for k, v in d.items()}


def mamba2_flush_cache(draft=0):
    cache = ReplayCache.empty(2, H, P, N, window=2, draft=draft, act_dtype=torch.float32)
    cache.cursors.fill_(1 if draft == 0 else 2)
    cache.ring_x.normal_()
    cache.ring_B.normal_()
    cache.ring_dt.uniform_()
    return cache


def gdn_cache(per_channel, draft=0):
    cache = GDNReplayCache.empty(2, H, P, N, per_channel=per_channel, window=2, draft=draft)
    cache.cursors.fill_(1 if draft == 0 else 2)
    for name in ("ring_u", "ring_v", "ring_k"):
        getattr(cache, name).normal_()
    cache.ring_g.fill_(-0.1)
    cache.ring_beta.fill_(0.5)
    return cache


def gdn_token(per_channel, T=None):
    gen = torch.Generator().manual_seed(1)
    return make_token(gen, 2, H, P, N, per_channel, ndraft=T)


MSG = "expected a tensor that shares no memory with the cache, got one that shares"


def test_mamba2_decode_refuses_x_over_the_recurrence_copy_on_a_flush_step():
    """x as a view of cache.hi on a flush step: refused naming x and cache.hi."""
    cache, token = mamba2_flush_cache(), mamba2_token(2)
    token["x"] = over(cache.hi, token["x"])
    with pytest.raises(ValueError, match=f"x: {MSG} cache.hi's"):
        mamba2_replay_decode(cache, **token)


@pytest.mark.parametrize("name, target", [("B", "ring_B"), ("dt", "ring_dt"), ("C", "lo"),
                                          ("A", "cursors")])
def test_mamba2_decode_refuses_any_input_over_any_cache_tensor(name, target):
    """Each input is checked against every cache tensor (ring, read copy, counters)."""
    cache, token = mamba2_flush_cache(), mamba2_token(2)
    token[name] = over(getattr(cache, target), token[name])
    with pytest.raises(ValueError, match=f"{name}: {MSG} cache.{target}'s"):
        mamba2_replay_decode(cache, **token)


def test_mamba2_verify_and_state_update_refuse_inputs_over_the_cache():
    """The speculative verify (B over the ring) and the conventional update (x over the
    state) refuse the same aliasing."""
    cache, token = mamba2_flush_cache(draft=2), mamba2_token(2, T=2)
    token["B"] = over(cache.ring_B, token["B"])
    with pytest.raises(ValueError, match=f"B: {MSG} cache.ring_B's"):
        mamba2_replay_verify(cache, **token)
    state = StateCache.empty(2, H, P, N, format="fp16")
    token = mamba2_token(2)
    token["x"] = over(state.state, token["x"])
    with pytest.raises(ValueError, match=f"x: {MSG} cache.state's"):
        mamba2_state_update(state, **token)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_gdn_entry_points_refuse_inputs_over_the_cache(per_channel):
    """GDN/KDA decode (v over hi on a flush step), verify (k over ring_k) and the
    conventional update (q over the state) refuse by name."""
    decode = kda_replay_decode if per_channel else gdn_replay_decode
    verify = kda_replay_verify if per_channel else gdn_replay_verify
    update = kda_state_update if per_channel else gdn_state_update
    cache, token = gdn_cache(per_channel), gdn_token(per_channel)
    token["v"] = over(cache.hi, token["v"])
    with pytest.raises(ValueError, match=f"v: {MSG} cache.hi's"):
        decode(cache, **token)
    cache, token = gdn_cache(per_channel, draft=2), gdn_token(per_channel, T=2)
    token["k"] = over(cache.ring_k, token["k"])
    with pytest.raises(ValueError, match=f"k: {MSG} cache.ring_k's"):
        verify(cache, **token)
    state, token = StateCache.empty(2, H, P, N, format="bf16"), gdn_token(per_channel)
    token["q"] = over(state.state, token["q"])
    with pytest.raises(ValueError, match=f"q: {MSG} cache.state's"):
        update(state, **token)


def test_cache_tensors_sharing_memory_are_refused():
    """A cache whose read copy is its recurrence copy (a flush writes one while it reads the
    other) or whose ring lies over a copy is refused by name, for every cache type."""
    cache = mamba2_flush_cache()
    cache.lo = cache.hi
    with pytest.raises(ValueError, match="cache.hi: .* shares cache.lo's"):
        mamba2_replay_decode(cache, **mamba2_token(2))
    cache = gdn_cache(False)
    cache.ring_u = over(cache.lo, cache.ring_u)
    with pytest.raises(ValueError, match="cache.lo: .* shares cache.ring_u's"):
        gdn_replay_decode(cache, **gdn_token(False))
    state = StateCache.empty(2, H, P, N, format="nvfp4")
    state.global_scale = state.scales.view(-1)[:4].view(2, H)
    with pytest.raises(ValueError, match="cache.scales: .* shares cache.global_scale's"):
        mamba2_state_update(state, **mamba2_token(2))


def test_meta_caches_and_inputs_are_refused_by_name():
    """A cache on the meta device (no data for the kernels to read) and a meta
    input beside a CPU cache are refused naming the tensor; so are the host wrappers'."""
    meta = "expected a tensor with data, got one on the meta device"
    for make in (lambda: ReplayCache.empty(2, H, P, N, window=2, device="meta"),
                 lambda: GDNReplayCache.empty(2, H, P, N, window=2, device="meta")):
        with pytest.raises(ValueError, match=f"cache.hi: {meta}"):
            make()
    with pytest.raises(ValueError, match=f"cache.state: {meta}"):
        StateCache.empty(2, H, P, N, device="meta")
    cache = ReplayCache.empty(2, H, P, N, window=2)
    cache.hi = cache.hi.to("meta")
    with pytest.raises(ValueError, match=f"cache.hi: {meta}"):
        mamba2_replay_decode(cache, **mamba2_token(2))
    with pytest.raises(ValueError, match=f"cache.hi: {meta}"):
        mamba2_replay_commit(cache, 0)
    cache = GDNReplayCache.empty(2, H, P, N, window=2)
    cache.hi = cache.hi.to("meta")
    with pytest.raises(ValueError, match=f"cache.hi: {meta}"):
        gdn_replay_decode(cache, **gdn_token(False))
    state = StateCache.empty(2, H, P, N)
    state.state = state.state.to("meta")
    with pytest.raises(ValueError, match=f"cache.state: {meta}"):
        gdn_state_update(state, **gdn_token(False))
    cache, token = gdn_cache(True), gdn_token(True)
    token["beta"] = token["beta"].to("meta")
    with pytest.raises(ValueError, match="beta: expected device cpu, got meta"):
        kda_replay_decode(cache, **token)
    cache = gdn_cache(False)
    cache.flushes = cache.flushes.to("meta")
    with pytest.raises(ValueError, match="cache.flushes: expected device cpu, got meta"):
        gdn_replay_decode(cache, **gdn_token(False))
    x = torch.ones(4, 32, device="meta")
    with pytest.raises(ValueError, match="x: expected a tensor with data"):
        numerics.round_to(x, "fp16")
    with pytest.raises(ValueError, match="x: expected a tensor with data"):
        numerics.quantize(x, "nvfp4")
    with pytest.raises(ValueError, match="device: expected a device with memory"):
        numerics.random_words_host(0, 0, 0, 8, device="meta")


@pytest.mark.parametrize("make, rounding_name", [
    (lambda **kw: ReplayCache.empty(1, H, P, N, **kw), "hi_rounding"),
    (lambda **kw: GDNReplayCache.empty(1, H, P, N, **kw), "hi_rounding"),
    (lambda **kw: StateCache.empty(1, H, P, N, **kw), "rounding"),
], ids=["mamba2-replay", "gdn-replay", "state"])
def test_caches_refuse_sr_settings_by_name(make, rounding_name):
    """Every cache takes sr_bits in {8, 13, 16, 32} and philox_rounds in [1, 10] (13 and 7 make
    a cache), refuses others by name at .empty and on a call after a field is changed, and keeps
    the defaults (16, 7) for an RN copy, as lowprec does."""
    sr = {rounding_name: "sr"}
    cache = make(sr_bits=13, philox_rounds=7, **sr)
    assert (cache.sr_bits, cache.philox_rounds) == (13, 7)
    with pytest.raises(ValueError, match=r"sr_bits: expected random bits per element in "
                                         r"\[8, 13, 16, 32\], got 12"):
        make(sr_bits=12, **sr)
    with pytest.raises(ValueError, match=r"philox_rounds: expected Philox rounds in \[1, 10\], "
                                         r"got 11"):
        make(philox_rounds=11, **sr)
    with pytest.raises(ValueError, match=f"sr_bits: expected the default 16 with "
                                         f"{rounding_name}='rn' .*got 8"):
        make(sr_bits=8, **{rounding_name: "rn"})
    with pytest.raises(ValueError, match=f"philox_rounds: expected the default 7 with "
                                         f"{rounding_name}='rn' .*got 10"):
        make(philox_rounds=10, **{rounding_name: "rn"})
    rn = make(**{rounding_name: "rn"})
    assert (rn.sr_bits, rn.philox_rounds) == (16, 7)
    cache.philox_rounds = 0
    with pytest.raises(ValueError, match=r"cache.philox_rounds: expected Philox rounds in"):
        if isinstance(cache, ReplayCache):
            mamba2_replay_decode(cache, **mamba2_token(1))
        elif isinstance(cache, GDNReplayCache):
            gdn_replay_decode(cache, **make_token(torch.Generator().manual_seed(0), 1, H, P, N,
                                                  False))
        else:
            gdn_state_update(cache, **make_token(torch.Generator().manual_seed(0), 1, H, P, N,
                                                 False))
