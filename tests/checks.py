"""Failure reports shared by the kernel tests: bit equality with hex dumps of the first
mismatches, and elementwise bounds that name the worst element and count NaNs."""

import math

import pytest
import torch


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str):
    """Same shape and fp32 bits, NaN matching any NaN; on failure the first mismatches in hex."""
    actual = actual.detach().cpu().float()
    expected = expected.detach().cpu().float()
    # == broadcasts: without this a [1] or [n, 1] result passed against any [n, k] expectation
    if actual.shape != expected.shape:
        pytest.fail(f"{what}: shape {list(actual.shape)} vs expected {list(expected.shape)}")
    a_bits = actual.view(torch.int32)
    e_bits = expected.view(torch.int32)
    same = (a_bits == e_bits) | (actual.isnan() & expected.isnan())
    if not bool(same.all()):
        bad = (~same).nonzero()[:4]
        lines = []
        for i in (tuple(j) for j in bad.tolist()):
            a_hex = a_bits[i].item() & 0xFFFFFFFF
            e_hex = e_bits[i].item() & 0xFFFFFFFF
            lines.append(f"  at {list(i)}: {actual[i].item()!r} (0x{a_hex:08x}) vs "
                         f"{expected[i].item()!r} (0x{e_hex:08x})")
        pytest.fail(f"{what}: {int((~same).sum())} of {same.numel()} differ\n" + "\n".join(lines))


def assert_within(actual, expected, bound, what):
    """|actual - expected| <= bound elementwise; on failure the worst element and NaN count."""
    actual = actual.detach().cpu().double()
    if actual.shape != expected.shape:  # the difference broadcasts (see assert_bits_equal)
        pytest.fail(f"{what}: shape {list(actual.shape)} vs expected {list(expected.shape)}")
    err = (actual - expected).abs()
    ok = err <= bound
    if not bool(ok.all()):
        excess = torch.where(ok, 0.0, err / bound.clamp(min=1e-300))
        excess = torch.where(excess.isnan(), math.inf, excess)
        i = tuple(int(j) for j in torch.unravel_index(excess.argmax(), excess.shape))
        pytest.fail(
            f"{what}: {int((~ok).sum())} of {ok.numel()} outside the bound; worst at {i}: "
            f"{actual[i].item()!r} vs {expected[i].item()!r} (bound {bound[i].item():.3e}); "
            f"NaNs: {int(actual.isnan().sum())}"
        )


def to_device(d: dict, device) -> dict:
    """Every tensor of `d` on `device`, contiguous."""
    return {k: v.to(device).contiguous() for k, v in d.items()}
