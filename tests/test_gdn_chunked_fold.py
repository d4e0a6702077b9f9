"""The chunked order of the GDN/KDA flush (`lowprec.gdn.gdn_replay_flush_chunked`, the CuTe
flush's ``fold='chunked'``) rounded in fp32 stays within the flush bound the kernels are held
to (`emulation.gdn_replay_decode.output_bound_flush`) of the exact fold, on inputs as the
models make them: L2-normalised keys, beta in (0, 1), short and long memory side by side;
its error is of the sequential fp32 fold's size."""

import pytest
import torch
from gdn_emulation_cases import log_decay, make_token

from emulation.gdn_replay_decode import output_bound_flush
from lowprec.gdn import gdn_replay_flush, gdn_replay_flush_chunked
from lowprec.kda import kda_replay_flush, kda_replay_flush_chunked

F64 = torch.float64


def window_case(seed, slots, nheads, dv, dk, window, per_channel, state_scale):
    """A checkpoint (fp16 values times `state_scale`) and `window` records a slot."""
    gen = torch.Generator().manual_seed(seed)
    ckpt = (torch.randn(slots, nheads, dv, dk, generator=gen) * state_scale).half().float()
    tokens = [make_token(gen, slots, nheads, dv, dk, per_channel) for _ in range(window)]
    rings = {name: torch.stack([t[name] for t in tokens], dim=2) for name in ("v", "k", "g",
                                                                           "beta")}
    return ckpt, rings


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("window, counts, state_scale", [
    (32, None, 1.0),  # the longest window, every slot full (as the kernel folds)
    (16, [16, 1, 9, 16, 3], 30.0),  # slots holding fewer records, a larger state
    (7, None, 1e-3),  # a small state: the values dominate
])
def test_chunked_fold_in_fp32_is_within_the_flush_bound(per_channel, window, counts,
                                                        state_scale):
    slots, nheads, dv, dk = 5, 3, 48, 128
    ckpt, r = window_case(11 + window, slots, nheads, dv, dk, window, per_channel, state_scale)
    count = torch.tensor(counts or [window] * slots)
    exact_fold, chunked_fold = ((kda_replay_flush, kda_replay_flush_chunked) if per_channel
                                else (gdn_replay_flush, gdn_replay_flush_chunked))
    args64 = [t.to(F64) for t in (ckpt, r["v"], r["k"], r["g"], r["beta"])]
    exact = exact_fold(*args64, count)
    got = chunked_fold(ckpt, r["v"], r["k"], r["g"], r["beta"], count)
    assert got.dtype == torch.float32
    q = torch.ones(slots, nheads, dk, dtype=F64)
    bound, _ = output_bound_flush(*args64, count, q, per_channel)
    ratio = ((got.to(F64) - exact).abs() / bound).max().item()
    assert ratio <= 1.0, f"chunked fp32 fold: error {ratio:.3g} of the flush bound"
    # and it rounds about as well as the sequential fold in fp32
    sequential = exact_fold(ckpt, r["v"], r["k"], r["g"], r["beta"], count)
    seq_ratio = ((sequential.to(F64) - exact).abs() / bound).max().item()
    assert 0.0 < ratio <= 3.0 * seq_ratio, (ratio, seq_ratio)


def test_strong_decay_and_a_wide_key_keep_the_chunked_fold_within_the_bound():
    """Decays near e^-8 a record (the products reach e^-250 over 32 records, below fp32's
    range) and dk = 512: the chunked products underflow to 0 where the sequential state
    decays to 0 too."""
    gen = torch.Generator().manual_seed(5)
    slots, nheads, dv, dk, window = 2, 2, 16, 512, 32
    ckpt, r = window_case(5, slots, nheads, dv, dk, window, False, 4.0)
    r["g"] = -8.0 * torch.rand(slots, nheads, window, generator=gen) + log_decay(
        gen, (slots, nheads, window))
    count = torch.tensor([window] * slots)
    args64 = [t.to(F64) for t in (ckpt, r["v"], r["k"], r["g"], r["beta"])]
    exact = gdn_replay_flush(*args64, count)
    got = gdn_replay_flush_chunked(ckpt, r["v"], r["k"], r["g"], r["beta"], count)
    bound, _ = output_bound_flush(*args64, count, torch.ones(slots, nheads, dk, dtype=F64),
                                  False)
    assert ((got.to(F64) - exact).abs() <= bound).all()
