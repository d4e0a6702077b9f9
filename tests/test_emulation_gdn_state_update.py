"""The conventional GDN/KDA state update in Triton equals lowprec's conventional policy.

Per step: the unrounded new state within the flush bound of one record
(`emulation.gdn_replay_decode.output_bound_flush` with count 1) of `lowprec.gdn`'s delta
update, the stored state equal bit for bit to `lowprec.policies.round_state` of it with the
slot's token counter (SR words random_words(seed, slot, tokens[slot], element)), and y read
from the stored state. `gdn_generic_step` / `kda_generic_step` drive both kinds of cache from
lowprec.policies' generic inputs and follow lowprec's Simulator. SR draws take the cache's
`sr_bits` random bits from `philox_rounds`-round Philox. Tests with a `cuda` variant run the
compiled kernel on a GPU with the same checks.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton cannot compile for a CPU: interpret (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checks import assert_bits_equal, assert_within  # noqa: E402
from gdn_emulation_cases import CPU_ONLY, SEED, SR_FAST, SR_SETTINGS, make_token  # noqa: E402

from emulation.gdn_replay_decode import (  # noqa: E402
    GDNReplayCache,
    gdn_generic_step,
    kda_generic_step,
    output_bound_flush,
)
from emulation.gdn_state_update import StateCache, gdn_state_update, kda_state_update  # noqa: E402
from lowprec import gdn, philox  # noqa: E402
from lowprec import quantize as lq  # noqa: E402
from lowprec.policies import Simulator, make_policy, round_state  # noqa: E402

UPDATE = {False: gdn_state_update, True: kda_state_update}
RECURRENCES = [pytest.param(False, id="gdn"), pytest.param(True, id="kda")]
H, DV, DK = 3, 5, 32


def _check_tokens(cache, gen, per_channel, steps):
    """`steps` tokens, each stored state checked against lowprec on the state it started from;
    returns the stored state after the first token (CPU)."""
    fmt, rounding = cache.format, cache.rounding
    device = cache.state.device
    sr = dict(sr_bits=cache.sr_bits, philox_rounds=cache.philox_rounds)
    first = None
    for _ in range(steps):
        before = cache.state.cpu().double().clone()
        tokens = cache.tokens.cpu().long().clone()
        token = make_token(gen, 3, H, DV, DK, per_channel, device=device)
        y = torch.full((3, H, DV), math.nan, device=device)
        debug = torch.full(cache.state.shape, math.nan, device=device)
        UPDATE[per_channel](cache, **token, out=y, debug_state=debug)
        y, debug = y.cpu(), debug.cpu()
        t64 = {k: v.cpu().double() for k, v in token.items()}
        one = torch.ones(3, dtype=torch.int64)
        ring = {n: t64[n][:, :, None] for n in ("v", "k", "g", "beta")}
        S_ref = gdn._replay_flush(before, ring["v"], ring["k"], ring["g"], ring["beta"], one,
                                  per_channel)
        S_bound, _ = output_bound_flush(before, ring["v"], ring["k"], ring["g"], ring["beta"],
                                        one, t64["q"], per_channel)
        assert_within(debug, S_ref, S_bound, "unrounded state")
        stored = round_state(debug, fmt, rounding, SEED, torch.arange(3), tokens, **sr)
        assert_bits_equal(cache.state, stored, f"stored state ({fmt} {rounding})")
        first = stored if first is None else first
        q = lq.quantize(debug, fmt)
        if q.scales is not None and rounding == "rn":
            assert_bits_equal(cache.scales, q.scales, "block scales")
        y_ref = torch.einsum("bhvk,bhk->bhv", stored.double(), t64["q"])
        bound = (DK + 2) * 2.0**-24 * torch.einsum("bhvk,bhk->bhv", stored.double().abs(),
                                                   t64["q"].abs())
        assert_within(y, y_ref, bound, "y from the stored state")
        assert (cache.tokens.cpu().long() - tokens).tolist() == [1, 1, 1]
    return first


DEVICE_CASES = [pytest.param("cpu", marks=CPU_ONLY), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("per_channel", RECURRENCES)
@pytest.mark.parametrize("fmt, rounding, device", [
    pytest.param(fmt, rounding, device.values[0], marks=device.marks)
    for fmt, rounding in (("fp16", "sr"), ("nvfp4", "rn"), ("mxfp4", "sr"))
    for device in DEVICE_CASES
] + [
    pytest.param("bf16", "rn", "cpu", marks=(CPU_ONLY, pytest.mark.slow)),
    pytest.param("fp8_e4m3", "sr", "cpu", marks=(CPU_ONLY, pytest.mark.slow)),
])
def test_stored_state_is_lowprecs_rounding_every_token(fmt, rounding, device, per_channel):
    """Three tokens from token counters 0, 5 and 2: each stored state is round_state of the
    kernel's unrounded state (within the one-record bound of the fp64 update), bit for bit, and
    y = S_stored q."""
    gen = torch.Generator().manual_seed(1)
    cache = StateCache.empty(3, H, DV, DK, format=fmt, rounding=rounding, seed=SEED,
                             device=device)
    cache.tokens.copy_(torch.tensor([0, 5, 2], dtype=torch.int32))
    _check_tokens(cache, gen, per_channel, 3)


SR_CASES = [pytest.param(k, r, "cpu", id=f"cpu-{k}b-{r}r",
                         marks=(CPU_ONLY,) if (k, r) in SR_FAST else (CPU_ONLY, pytest.mark.slow))
            for k, r in SR_SETTINGS] + [
    pytest.param(16, 7, "cuda", id="cuda-16b-7r", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("sr_bits, philox_rounds, device", SR_CASES)
def test_stored_state_every_sr_setting(sr_bits, philox_rounds, device):
    """The conventional GDN state stored in FP16 by SR with `sr_bits` random bits per element
    from `philox_rounds`-round Philox, at token counters 0, 2^19 + 5 and 3 (h 3, dv 5, dk 32):
    lowprec's round_state(..., sr_bits=, philox_rounds=) bit for bit over two tokens; a twin
    at the defaults (16, 7) stores another state from the same first token."""
    caches = [StateCache.empty(3, H, DV, DK, format="fp16", rounding="sr", seed=SEED,
                               device=device, **sr)
              for sr in (dict(sr_bits=sr_bits, philox_rounds=philox_rounds), {})]
    for cache in caches:
        cache.tokens.copy_(torch.tensor([0, 2**19 + 5, 3], dtype=torch.int32))
    first = _check_tokens(caches[0], torch.Generator().manual_seed(9), False, 2)
    other = _check_tokens(caches[1], torch.Generator().manual_seed(9), False, 1)
    if (sr_bits, philox_rounds) != (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS):
        assert not torch.equal(first, other)


@CPU_ONLY
@pytest.mark.parametrize("arm, fmt, rounding, rtol, per_channel", [
    # fp32 arithmetic only (exact copies): 1e-5 relative RMS, as the decode drift test
    pytest.param("separate_exact", "fp32", "rn", 1e-5, False, id="separate_exact-gdn"),
    # fp16 stored every token: lowprec rounds its fp64 state, the kernel its fp32 one; the
    # two differ where the rounding falls between them, by one fp16 ulp (2^-11 relative)
    pytest.param("every_step", "fp16", "rn", 2.0**-10, True, id="every_step-fp16-kda"),
    # an nvfp4 read copy: the same, by one e2m1 step at a few elements (2^-6 relative RMS).
    # At these seeds no rounding falls between the two states: all three measure ~1e-7.
    pytest.param("separate_fp16sr", "nvfp4", "rn", 2.0**-6, False, id="separate_fp16sr-gdn"),
    pytest.param("separate_exact", "fp32", "rn", 1e-5, True, id="separate_exact-kda",
                 marks=pytest.mark.slow),
    pytest.param("every_step", "fp16", "rn", 2.0**-10, False, id="every_step-fp16-gdn",
                 marks=pytest.mark.slow),
    pytest.param("separate_fp16sr", "nvfp4", "rn", 2.0**-6, True, id="separate_fp16sr-kda",
                 marks=pytest.mark.slow),
])
def test_generic_step_follows_lowprec_simulator(arm, fmt, rounding, rtol, per_channel):
    """gdn_generic_step / kda_generic_step from the Simulator's generic inputs (a, v, k, q,
    beta), on the cache an arm uses, follow lowprec's Simulator of that arm over two windows
    (L = 4): relative RMS of the outputs' difference within rtol of the outputs."""
    gen = torch.Generator().manual_seed(2)
    window, batch = 4, 2
    policy = make_policy(arm, fmt, rounding, window=window, seed=SEED)
    recurrence = "kda" if per_channel else "gdn"
    sim = Simulator(recurrence, policy, batch, H, DV, DK)
    if arm == "every_step":
        cache = StateCache.empty(batch, H, DV, DK, format=fmt, rounding=rounding, seed=SEED)
    else:
        hi = ("fp32", "rn") if arm == "separate_exact" else ("fp16", "sr")
        cache = GDNReplayCache.empty(batch, H, DV, DK, per_channel=per_channel, window=window,
                                     hi_format=hi[0], hi_rounding=hi[1], lo_format=fmt,
                                     seed=SEED)
    step = kda_generic_step if per_channel else gdn_generic_step
    diffs, refs = [], []
    for _ in range(2 * window):
        t = {k: v.double() for k, v in make_token(gen, batch, H, DV, DK, per_channel).items()}
        a = torch.exp(t["g"])
        y_ref = sim.step(a, t["v"], t["k"], t["q"], t["beta"])
        y = step(cache, a, t["v"], t["k"], t["q"], t["beta"])
        diffs.append(y.double() - y_ref)
        refs.append(y_ref)
    err = torch.stack(diffs).norm() / torch.stack(refs).norm()
    assert err <= rtol, f"relative RMS difference {err:.3e} > {rtol:.1e}"
