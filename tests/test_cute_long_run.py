"""The CuTe two-precision decode over many windows has the error `lowprec` predicts.

Property: decoding 12 windows with the packed kernels (FP16-SR recurrence copy, NVFP4 read copy)
gives, at every step, the same relative output error against the FP64 recurrence as
`lowprec.replay.Mamba2Replay` under the policy `separate_fp16sr` / `nvfp4` run in FP64 on the
CPU with the same inputs and seed; and that error does not grow with length.

Why the two errors agree closely rather than exactly: the kernel forms its unrounded states in
fp32 and the reference in fp64, so the two quantisers see inputs that differ by ~1e-7
relative; a stored code changes only for an element within that distance of a rounding
threshold (~2^-13 of the fp16 SR draws, far fewer NVFP4 codes), and one fp16 ulp at a few
elements moves the output error by far less than 1%. Both outputs are rounded to bf16 (the
kernel writes x's dtype; the reference is rounded here), whose unit roundoff 2^-9 bounds the
rest: |err_kernel - err_ref| <= 5% of err_ref + 2^-9.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

SLOTS, HEADS, HEADDIM, DSTATE, GROUPS, WINDOW, WINDOWS, SEED = 3, 8, 64, 128, 2, 16, 12, 1234


def _inputs(steps, gen):
    """Long-memory Mamba-2 inputs: softplus(dt + bias) ~ 0.01, A in [-0.2, -0.05], so the
    per-step decay is about 0.998-0.9995; bf16 activations, fp32 dt."""
    bf16 = torch.bfloat16
    x = torch.randn(steps, SLOTS, HEADS, HEADDIM, generator=gen).to(bf16)
    dt = (0.3 * torch.randn(steps, SLOTS, HEADS, generator=gen)).float()
    B = torch.randn(steps, SLOTS, GROUPS, DSTATE, generator=gen).to(bf16)
    C = torch.randn(steps, SLOTS, GROUPS, DSTATE, generator=gen).to(bf16)
    A = -(0.05 + 0.15 * torch.rand(HEADS, generator=gen))
    D = torch.randn(HEADS, generator=gen)
    dt_bias = torch.full((HEADS,), -4.6) + 0.1 * torch.randn(HEADS, generator=gen)
    return x, dt, B, C, A, D, dt_bias


def _rel_err(y_hat, y):
    return (torch.linalg.vector_norm(y_hat - y) / torch.linalg.vector_norm(y)).item()


def test_two_precision_kernels_match_the_lowprec_error_prediction_over_12_windows():
    from cute_kernels.cache import ReplayCache
    from cute_kernels.replay_decode import mamba2_replay_decode
    from lowprec.mamba2 import mamba2_step
    from lowprec.policies import make_policy
    from lowprec.replay import Mamba2Replay

    steps = WINDOW * WINDOWS
    x, dt, B, C, A, D, dt_bias = _inputs(steps, torch.Generator().manual_seed(SEED))
    f64, dev = torch.float64, "cuda"

    policy = make_policy("separate_fp16sr", "nvfp4", window=WINDOW, seed=SEED)
    ref = Mamba2Replay.create(SLOTS, HEADS, HEADDIM, DSTATE, A.double(), ngroups=GROUPS,
                              D=D.double(), dt_bias=dt_bias.double(), policy=policy)
    exact = torch.zeros(SLOTS, HEADS, HEADDIM, DSTATE, dtype=f64)

    cache = ReplayCache.empty(SLOTS, HEADS, HEADDIM, DSTATE, ngroups=GROUPS, window=WINDOW,
                              hi_format="fp16", hi_rounding="sr", lo_format="nvfp4", seed=SEED,
                              device=dev)
    err_kernel, err_ref = [], []
    for t in range(steps):
        xt, dtt, Bt, Ct = x[t], dt[t], B[t], C[t]
        y_exact, exact = mamba2_step(exact, xt.double(), dtt.double(), A.double(), Bt.double(),
                                     Ct.double(), D=D.double(), dt_bias=dt_bias.double())
        y_ref = ref.step(xt.double(), dtt.double(), Bt.double(), Ct.double())
        out = torch.full((SLOTS, HEADS, HEADDIM), float("nan"), dtype=torch.bfloat16, device=dev)
        y_kernel = mamba2_replay_decode(
            cache, xt.to(dev), dtt.to(dev), A.to(dev), Bt.to(dev), Ct.to(dev), D=D.to(dev),
            dt_bias=dt_bias.to(dev), out=out)
        y_kernel = y_kernel.double().cpu()
        assert not torch.isnan(y_kernel).any(), f"step {t}: unwritten output"
        err_kernel.append(_rel_err(y_kernel, y_exact))
        err_ref.append(_rel_err(y_ref.to(torch.bfloat16).double(), y_exact))

    assert cache.flushes.cpu().tolist() == [WINDOWS] * SLOTS
    non_flush = [t for t in range(WINDOW, steps) if (t + 1) % WINDOW]
    worst = max(non_flush, key=lambda t: abs(err_kernel[t] - err_ref[t]) / err_ref[t])
    for t in non_flush:
        assert abs(err_kernel[t] - err_ref[t]) <= 0.05 * err_ref[t] + 2**-9, (
            f"step {t}: kernel {err_kernel[t]:.4e} vs lowprec {err_ref[t]:.4e}; "
            f"worst step {worst}: {err_kernel[worst]:.4e} vs {err_ref[worst]:.4e}")
    # No growth: the read copy's error is one rounding, whatever the length.
    early = [err_kernel[t] for t in non_flush if 3 * WINDOW <= t < 6 * WINDOW]
    late = [err_kernel[t] for t in non_flush if t >= steps - 3 * WINDOW]
    assert sum(late) / len(late) <= 1.5 * sum(early) / len(early), (early, late)
    mean_kernel = sum(err_kernel[t] for t in non_flush) / len(non_flush)
    mean_ref = sum(err_ref[t] for t in non_flush) / len(non_flush)
    print(f"non-flush rel err: kernel mean {mean_kernel:.4e}, lowprec mean {mean_ref:.4e}")
