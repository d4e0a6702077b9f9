"""cute_kernels/gdn_state_update.py: the conventional GDN decode baseline against lowprec.

CPU: fp32 and bf16 states compile for sm_90a with 128-bit state accesses only; bad arguments
raise ValueErrors naming them. GPU (marker `gpu`): the unrounded new state matches
lowprec.gdn.gdn_step (fp64) within the emulation's one-step flush bound, the stored state is
its fp32 value or bf16 RN bit for bit, outputs match.
"""

import math
import os
import re

import pytest
import torch
from checks import assert_within

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cute_kernels import gdn_cache as gc  # noqa: E402
from cute_kernels import gdn_replay_flush as gf  # noqa: E402
from cute_kernels import gdn_state_update as gs  # noqa: E402
from lowprec import gdn  # noqa: E402

DEVICE = torch.device("cuda")
QWEN = dict(nheads=32, dv=128, dk=128)
ODD = dict(nheads=3, dv=48, dk=128)


def config(fmt, shape=QWEN, act="bf16", debug=False):
    return gf.GDNConfig(nheads=shape["nheads"], dv=shape["dv"], dk=shape["dk"], window=1,
                        hi_format=fmt, hi_rounding="rn", lo_format="none", act=act,
                        has_debug=debug)


@pytest.mark.parametrize("fmt, per_pass", [("fp32", 4), ("bf16", 2)])
def test_gdn_state_update_compiles_for_sm90a_with_128_bit_state_accesses(fmt, per_pass):
    """Each thread's 64 state elements: 4 passes of one 16-element chunk, read and written as
    128-bit accesses (fp32: 4 a pass, bf16: 2)."""
    cfg = config(fmt)
    ptx = gs.compile_gdn_state_update(cfg, keep_ptx=True).__ptx__
    stores = len(re.findall(r"st\.global\.v4\.b32", ptx))
    loads = len(re.findall(r"ld\.global\.v4\.b32", ptx))
    assert stores == per_pass * cfg.passes, stores
    assert loads >= per_pass * cfg.passes, loads


def test_gdn_state_update_refuses_other_state_formats_by_name():
    with pytest.raises(ValueError, match=re.escape("format: expected one of ['fp32', 'bf16']")):
        gc.GDNStateCache.empty(2, 2, 32, 128, format="fp16")
    with pytest.raises(ValueError, match=re.escape("cfg.hi_format: expected one of")):
        gs.compile_gdn_state_update(config("fp16"))


def cpu_args(slots=3, shape=ODD, fmt="fp32"):
    gen = torch.Generator().manual_seed(2)
    S, H = slots, shape["nheads"]
    cache = gc.GDNStateCache.empty(S, H, shape["dv"], shape["dk"], format=fmt)
    token = dict(q=torch.randn(S, H, shape["dk"], generator=gen),
                 k=torch.randn(S, H, shape["dk"], generator=gen),
                 v=torch.randn(S, H, shape["dv"], generator=gen),
                 g=-torch.rand(S, H, generator=gen), beta=torch.rand(S, H, generator=gen))
    return cache, token


@pytest.mark.parametrize("change, message", [
    (dict(output_from="stored"), "output_from: expected one of ('unrounded',)"),
    (dict(check_counters=1), "check_counters: expected a bool"),
    (dict(k="f16"), "k: expected dtype torch.float32"),
    (dict(v="short"), "v: expected shape"),
    (dict(state="dk"), "cache.state.shape: dk: expected one of (128, 256, 512)"),
    (dict(), "cache.state: expected a CUDA tensor"),
])
def test_gdn_state_update_checks_name_the_bad_argument(change, message):
    """Every check runs on CPU tensors; the device is refused last."""
    cache, token = cpu_args()
    kwargs = {}
    for name, what in change.items():
        if what == "f16":
            token[name] = token[name].to(torch.float16)
        elif what == "short":
            token[name] = token[name][..., :-16]
        elif what == "dk":
            cache.state = cache.state[..., :96].contiguous()
        else:
            kwargs[name] = what
    with pytest.raises(ValueError, match=re.escape(message)):
        gs.gdn_state_update(cache, **token, **kwargs)


def test_gdn_state_update_traffic_bytes_are_the_stated_counts():
    """Qwen3-Next head, bf16 activations: state 65,536 B each way (fp32) or 32,768 (bf16),
    q, k, v 768, g and beta 8, y 256."""
    assert gs.traffic_bytes("fp32", "bf16", 1, 1, 128, 128) == 2 * 65536 + 768 + 8 + 256
    assert gs.traffic_bytes("bf16", "bf16", 2, 32, 128, 128) == 64 * (2 * 32768 + 1032)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [ODD, QWEN], ids=["odd", "qwen3-next"])
def test_gdn_state_update_matches_lowprec_and_stores_the_rounded_state(fmt, shape):
    """Three steps from a random state: each unrounded state within the one-step bound of
    lowprec.gdn.gdn_step (fp64) on the stored state, the stored state its RN in the format
    bit for bit, y within its bound."""
    from gdn_emulation_cases import make_token

    from emulation.gdn_replay_decode import output_bound_flush

    gen = torch.Generator().manual_seed(17)
    S, H, P, N = 3, shape["nheads"], shape["dv"], shape["dk"]
    cache = gc.GDNStateCache.empty(S, H, P, N, format=fmt, device=DEVICE)
    cache.state.copy_(torch.randn(S, H, P, N, generator=gen).to(cache.state.dtype))
    for _ in range(3):
        token = make_token(gen, S, H, P, N, False)
        before = cache.state.double().cpu()
        debug = torch.full((S, H, P, N), math.nan, device=DEVICE)
        y = gs.gdn_state_update(cache, **{n: t.to(DEVICE) for n, t in token.items()},
                                debug_state=debug)
        t64 = {n: t.double() for n, t in token.items()}
        y_ref, s_ref = gdn.gdn_step(before, **t64)
        ring = {n: t64[n][:, :, None] for n in ("v", "k", "g", "beta")}
        s_bound, y_bound = output_bound_flush(before, ring["v"], ring["k"], ring["g"],
                                              ring["beta"], torch.ones(S, dtype=torch.long),
                                              t64["q"], False)
        assert_within(debug, s_ref, s_bound, f"unrounded new state ({fmt})")
        assert_within(y.float(), y_ref, y_bound, f"y ({fmt})")
        want = debug.to(cache.state.dtype)
        assert torch.equal(cache.state.view(torch.int16 if fmt == "bf16" else torch.int32),
                           want.view(torch.int16 if fmt == "bf16" else torch.int32)), fmt
