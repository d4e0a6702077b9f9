"""The Triton GDN/KDA ReplaySSM decode step equals lowprec's, stored copies bit for bit.

For the same cache and token the emulation's step gives:
- the current record's u and the output within the fp32 bounds of
  `emulation.gdn_replay_decode` (module docstring: derived there, evaluated in fp64 by
  `output_bound_window` / `output_bound_flush`) of `lowprec.gdn`'s replay forms on the same
  cache (non-flush: read copy + cached u; flush: every u recomputed from the recurrence copy);
- at flush slots an unrounded new state (`debug_state`) within the flush bound, and stored
  copies equal, bit for bit, to what lowprec's GDNReplay/KDAReplay with the same policy
  (`Policy('separate', fmt=lo, hi_fmt=hi, hi_rounding=...)`, fp32) writes from that state:
  hi words, lo values, block scales and nvfp4's s_g;
- the record appended at the slot's own ring position, cursors and flush counters moved.
Over several windows every step is checked against lowprec on the emulation's own cache, and
the whole run's drift against the fp64 recurrence (`lowprec.gdn.gdn_step`). The recurrence copy's
SR draws take the cache's `sr_bits` random bits from `philox_rounds`-round Philox, as lowprec's.
Tests with a `cuda` variant run the compiled kernels on a GPU with the same checks.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton cannot compile for a CPU: interpret (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gdn_emulation_cases import (  # noqa: E402
    CPU_ONLY,
    DEVICES,
    SEED,
    SR_FAST,
    SR_SETTINGS,
    filled_cache,
    make_token,
    run_and_check_step,
    snapshot,
)

from emulation.gdn_replay_decode import (  # noqa: E402
    GDNReplayCache,
    gdn_replay_decode,
    kda_replay_decode,
)
from lowprec import formats, gdn, kda, philox  # noqa: E402

LO_FORMATS = [name for name in formats.names() if name != "fp64"]
# every read format for GDN; for KDA (the same kernel, one flag) those with distinct scale rules
KDA_FAST = ("nvfp4", "mxfp4", "fp8_e4m3_row", "fp16")
FORMAT_CASES = [pytest.param(lo, pc, id=f"{lo}-{'kda' if pc else 'gdn'}",
                             marks=() if not pc or lo in KDA_FAST else pytest.mark.slow)
                for pc in (False, True) for lo in LO_FORMATS]
DECODE = {False: gdn_replay_decode, True: kda_replay_decode}
RECURRENCES = [pytest.param(False, id="gdn"), pytest.param(True, id="kda")]


@CPU_ONLY
@pytest.mark.parametrize("lo, per_channel", FORMAT_CASES)
def test_step_copies_bit_exact_every_read_format(lo, per_channel):
    """Slots at ring positions L-1 (flush), 0 and 2 in one call (nheads 3, dv 5, dk 32): u and
    y to the fp32 bound, hi = FP16-SR(S_new) with each slot's own flush counter and lo =
    RN_lo(S_new) as lowprec's GDNReplay/KDAReplay writes them, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    window = 4
    cache = filled_cache(gen, 3, 3, 5, 32, ("fp16", "sr"), lo, per_channel,
                         cursors=[window - 1, 0, 2], flushes=[5, 0, 2], window=window)
    run_and_check_step(cache, make_token(gen, 3, 3, 5, 32, per_channel), DECODE[per_channel])


@pytest.mark.parametrize("device, per_channel", [
    pytest.param("cpu", False, id="cpu-gdn", marks=CPU_ONLY),
    pytest.param("cpu", True, id="cpu-kda", marks=CPU_ONLY),
    pytest.param("cuda", False, id="cuda-gdn", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize(
    "dims, hi, lo, act_dtype",
    [
        ((3, 7, 48), ("fp32", "rn"), "nvfp4", torch.float32),
        ((2, 24, 32), ("bf16", "sr"), "mxfp4", torch.bfloat16),
        ((3, 7, 48), ("fp16", "rn"), "fp8_e4m3_row", torch.float16),
    ],
    ids=["h3-v7-k48-fp32-nvfp4", "h2-v24-k32-bf16sr-mxfp4-bf16act",
         "h3-v7-k48-fp16rn-e4m3row-f16act"],
)
def test_step_odd_shapes_and_activation_dtypes(dims, hi, lo, act_dtype, per_channel, device):
    """Odd shapes (dv 7 and 24, dk 48: not powers of two), bf16/fp16 activations, other copy
    formats, four slots at positions L-1, 1, L-1, 0."""
    gen = torch.Generator().manual_seed(2)
    h, dv, dk = dims
    cache = filled_cache(gen, 4, h, dv, dk, hi, lo, per_channel, cursors=[4, 1, 4, 0],
                         flushes=[0, 3, 1, 9], window=5, act_dtype=act_dtype, device=device)
    token = make_token(gen, 4, h, dv, dk, per_channel, act_dtype=act_dtype, device=device)
    run_and_check_step(cache, token, DECODE[per_channel])


def _windows(per_channel, window, hi, lo, tokens, seed, device="cpu", **sr):
    """`tokens` steps from slots at random ring positions, each checked on the emulation's
    own cache; returns (flushes done per slot, the largest error / bound seen)."""
    gen = torch.Generator().manual_seed(seed)
    cursors = torch.randint(0, window, (3,), generator=gen).tolist()
    cache = filled_cache(gen, 3, 2, 5, 32, hi, lo, per_channel, cursors=cursors,
                         flushes=[0, 7, 2], window=window, device=device, **sr)
    before = cache.flushes.cpu().clone()
    worst = 0.0
    for _ in range(tokens):
        _, ratio = run_and_check_step(cache, make_token(gen, 3, 2, 5, 32, per_channel,
                                                        device=device), DECODE[per_channel])
        worst = max(worst, ratio)
    expected = [(c + tokens) // window for c in cursors]
    return (cache.flushes.cpu() - before).tolist(), expected, worst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_channel", RECURRENCES)
def test_windows_multiple_flushes_from_random_positions(per_channel, device):
    """L = 8, 19 tokens from random ring positions: two or three flushes per slot, every step
    matching lowprec on the emulation's own cache, copies bit for bit at every flush."""
    done, expected, _ = _windows(per_channel, 8, ("fp16", "sr"), "nvfp4", 19, 4, device)
    assert done == expected and min(done) >= 2


# every setting on the CPU; on the GPU one lane split per width class (13 bits: a masked
# 16-bit lane at 10 rounds; 8 bits: four lanes a word at 4 rounds)
SR_CASES = [pytest.param(k, r, "cpu", id=f"cpu-{k}b-{r}r",
                         marks=(CPU_ONLY,) if (k, r) in SR_FAST else (CPU_ONLY, pytest.mark.slow))
            for k, r in SR_SETTINGS] + [
    pytest.param(13, 10, "cuda", id="cuda-13b-10r", marks=pytest.mark.gpu),
    pytest.param(8, 4, "cuda", id="cuda-8b-4r", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("sr_bits, philox_rounds, device", SR_CASES)
def test_flush_hi_words_every_sr_setting(sr_bits, philox_rounds, device):
    """GDN flush of an FP16-SR recurrence copy with `sr_bits` random bits per element from
    `philox_rounds`-round Philox: the stored words are lowprec's (GDNReplay with the same
    policy) bit for bit, at slots flushing with counters 0, 2^19 + 5 and 3 beside one that
    does not (h 3, dv 7, dk 48: a head's 336 elements start mid-counter for 8 bits). A twin
    cache at the defaults (16, 7) stores other words at the flush slots (the setting reaches
    the store), and the same read copy."""
    gen = torch.Generator().manual_seed(12)
    window = 3
    sr = dict(sr_bits=sr_bits, philox_rounds=philox_rounds)
    cache = filled_cache(gen, 4, 3, 7, 48, ("fp16", "sr"), "nvfp4", False,
                         cursors=[window - 1, window - 1, 0, window - 1],
                         flushes=[0, 2**19 + 5, 1, 3], window=window, device=device, **sr)
    twin = filled_cache(torch.Generator().manual_seed(12), 4, 3, 7, 48, ("fp16", "sr"),
                        "nvfp4", False, cursors=[window - 1, window - 1, 0, window - 1],
                        flushes=[0, 2**19 + 5, 1, 3], window=window, device=device)
    token = make_token(gen, 4, 3, 7, 48, False, device=device)
    run_and_check_step(cache, token, gdn_replay_decode)
    gdn_replay_decode(twin, **token)
    fl = torch.tensor([0, 1, 3])
    after, other = snapshot(cache), snapshot(twin)
    assert torch.equal(after["lo"], other["lo"])
    if (sr_bits, philox_rounds) != (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS):
        assert not torch.equal(after["hi"][fl], other["hi"][fl])


@CPU_ONLY
@pytest.mark.slow
@pytest.mark.parametrize("per_channel", RECURRENCES)
@pytest.mark.parametrize("window", [8, 16, 32])
@pytest.mark.parametrize("lo", LO_FORMATS)
def test_windows_every_format_and_window(lo, window, per_channel):
    """Every read-copy format at L = 8, 16, 32 (FP16-SR recurrence copy): L + 3 tokens from
    random ring positions, so every slot flushes once or twice."""
    done, expected, _ = _windows(per_channel, window, ("fp16", "sr"), lo, window + 3, window)
    assert done == expected and min(done) >= 1


@CPU_ONLY
@pytest.mark.parametrize("per_channel", RECURRENCES)
def test_bound_holds_and_is_not_vacuous(per_channel):
    """The derived fp32 bound holds on every u and y of three windows, and is within three
    decades of the error seen (a bound a thousand times too loose would pass anything)."""
    _, _, worst = _windows(per_channel, 8, ("fp32", "rn"), "fp32", 17, 11)
    assert 1e-3 < worst <= 1.0, worst


@CPU_ONLY
@pytest.mark.parametrize("per_channel", RECURRENCES)
def test_drift_against_fp64_recurrence(per_channel):
    """Three windows (L = 4) from the zero state with fp32 copies: outputs within 1e-5
    relative RMS of the fp64 recurrence decoded token by token (lowprec gdn_step/kda_step).
    Each step's error is a few units of 2^-24 times d_k + L (the bound); the delta rule with
    beta < 1 and unit keys contracts, so 12 steps stay near 1e-6; 1e-5 is a 10x margin."""
    gen = torch.Generator().manual_seed(5)
    h, dv, dk, window = 2, 5, 32, 4
    cache = GDNReplayCache.empty(2, h, dv, dk, per_channel=per_channel, window=window,
                                 hi_format="fp32", hi_rounding="rn", lo_format="fp32",
                                 seed=SEED)
    step = kda.kda_step if per_channel else gdn.gdn_step
    state = torch.zeros(2, h, dv, dk, dtype=torch.float64)
    errs, refs = [], []
    for _ in range(3 * window):
        token = make_token(gen, 2, h, dv, dk, per_channel)
        y_ref, state = step(state, *(token[n].double() for n in ("q", "k", "v", "g", "beta")))
        y = DECODE[per_channel](cache, **token)
        errs.append(y.double() - y_ref)
        refs.append(y_ref)
    err = torch.stack(errs).norm() / torch.stack(refs).norm()
    assert err <= 1e-5, f"relative RMS error {err:.3e}"


@CPU_ONLY
def test_kda_with_equal_channel_decays_is_gdn():
    """A KDA cache whose per-channel decays are all equal to a GDN cache's per-head decay
    decodes the same outputs (to fp32 rounding) and stores the same copies."""
    gen = torch.Generator().manual_seed(8)
    caches = [GDNReplayCache.empty(2, 2, 5, 32, per_channel=pc, window=3, lo_format="nvfp4",
                                   seed=SEED) for pc in (False, True)]
    for _ in range(4):
        token = make_token(gen, 2, 2, 5, 32, False)
        y_gdn = gdn_replay_decode(caches[0], **token)
        kda_token = dict(token, g=token["g"][..., None].expand(-1, -1, 32).contiguous())
        y_kda = kda_replay_decode(caches[1], **kda_token)
        assert torch.allclose(y_gdn, y_kda, rtol=0, atol=1e-6)
    assert torch.equal(caches[0].lo, caches[1].lo) or math.isclose(
        float((caches[0].lo - caches[1].lo).abs().max()), 0.0, abs_tol=1e-6)
    assert caches[0].flushes.tolist() == caches[1].flushes.tolist() == [1, 1]
