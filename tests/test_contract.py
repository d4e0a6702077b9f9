"""lowprec.contract: the bytes a flush must store, and the bit-for-bit comparison a user runs
on their own kernel's buffers. The expected bytes are tied to a second implementation (the
Triton emulation's quantiser and Philox words, under TRITON_INTERPRET on a CPU); the CuTe
flush's GPU tests (tests/test_cute_replay_flush.py::check_flush) compare through it too."""

from __future__ import annotations

import re

import pytest
import torch

from lowprec import contract
from lowprec import quantize as q
from lowprec.formats import FP16

SHAPE = (3, 2, 5, 96)  # slots, heads, d_v, d_k: odd sizes; 6 nvfp4, 3 mxfp4 blocks a row


def _state(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # rows of different magnitudes, a zero block and a tiny row (nvfp4's scales at both ends)
    state = torch.randn(SHAPE, generator=gen) * torch.logspace(-3, 2, SHAPE[2])[:, None]
    state[1, 0, 2, 16:32] = 0.0
    state[2, 1, 4] *= 2.0**-40
    return state


@pytest.mark.parametrize("lo_format", ["nvfp4", "mxfp4", "fp8_e4m3"])
def test_flush_copies_are_the_emulations_stores(lo_format):
    """The emulation's fp16-SR recurrence copy (its own Philox words, slot s, counter
    flushes[s]) and its RN read copy, packed, are flush_copies' bytes."""
    from emulation import numerics as em

    state = _state()
    slots, flushes = torch.tensor([4, 0, 9]), torch.tensor([2, 17, 0])
    want = contract.flush_copies(state, lo_format=lo_format, seed=0xBEEF, slots=slots,
                                 flushes=flushes)
    words = torch.stack([em.random_words_host(0xBEEF, int(s), int(f), state[0].numel())
                         for s, f in zip(slots, flushes, strict=True)]).reshape(SHAPE)
    hi = em.round_to(state, "fp16", "sr", words)
    lo = em.quantize(state, lo_format, "rn")
    got = {"hi": q.encode_bits(hi, FP16).to(torch.int16)}  # int16: the same 16 bits
    got.update({f"lo.{k}": v for k, v in q.pack(lo).items()})
    assert sorted(got) == sorted(want)
    assert contract.mismatches(got, want) == []
    # and the words matter: another counter for slot 9 changes its recurrence copy
    other = contract.flush_copies(state, lo_format=lo_format, seed=0xBEEF, slots=slots,
                                  flushes=torch.tensor([2, 17, 1]))
    assert torch.equal(other["hi"][:2], want["hi"][:2])
    assert not torch.equal(other["hi"][2], want["hi"][2])


def test_defaults_are_the_kits_scheme_and_slot_rows():
    """fp16 SR + nvfp4, slots 0..rows-1, counter 0, seed 0; an RN fp32 copy is the state's
    bits, and no read copy leaves the lo tensors out."""
    state = _state(1)
    want = contract.flush_copies(state)
    assert sorted(want) == ["hi", "lo.codes", "lo.global_scale", "lo.scales"]
    assert want["hi"].dtype == torch.uint16 and want["lo.codes"].shape == (3, 2, 5, 48)
    explicit = contract.flush_copies(state, hi_format="fp16", hi_rounding="sr",
                                     lo_format="nvfp4", seed=0, slots=torch.arange(3),
                                     flushes=torch.zeros(3, dtype=torch.int32))
    assert contract.mismatches(explicit, want) == []
    fp32 = contract.flush_copies(state, hi_format="fp32", hi_rounding="rn", lo_format=None)
    assert list(fp32) == ["hi"] and torch.equal(fp32["hi"].view(torch.float32), state)


def test_mismatches_names_each_differing_element_by_index_and_bits():
    state = _state(2)
    want = contract.flush_copies(state, seed=5, flushes=3)
    got = {k: v.clone() for k, v in want.items()}
    got["hi"] = got["hi"].view(torch.float16)  # a kernel's fp16 tensor: compared by its bits
    got["lo.codes"][2, 1, 0, 7] ^= 0x08  # one sign bit of one E2M1 code
    got["lo.codes"][0, 0, 3, 0] ^= 0x80
    got["lo.global_scale"][1, 1] = torch.nextafter(got["lo.global_scale"][1, 1],
                                                   torch.tensor(1e30))
    bits = int(want["lo.global_scale"][1, 1].view(torch.int32))
    problems = contract.mismatches(got, want, limit=1)
    assert problems == [
        f"lo.codes: 2 of 1440 elements differ; (0, 0, 3, 0): "
        f"{int(want['lo.codes'][0, 0, 3, 0]) ^ 0x80:02x} against "
        f"{int(want['lo.codes'][0, 0, 3, 0]):02x}",
        f"lo.global_scale: 1 of 6 elements differ; (1, 1): {bits + 1:08x} against {bits:08x}",
    ]
    codes = [int(want["lo.codes"][i]) for i in ((0, 0, 3, 0), (2, 1, 0, 7))]
    assert contract.mismatches(got, want)[0] == (
        f"lo.codes: 2 of 1440 elements differ; (0, 0, 3, 0): {codes[0] ^ 0x80:02x} against "
        f"{codes[0]:02x}, (2, 1, 0, 7): {codes[1] ^ 0x08:02x} against {codes[1]:02x}")


def test_mismatches_reports_missing_wider_and_misshapen_tensors():
    want = contract.flush_copies(_state(3), lo_format="fp8_e4m3")
    got = {"hi": torch.zeros(SHAPE), "lo.codes": want["lo.codes"][:, :, :4], "extra": 1}
    assert contract.mismatches(got, want) == [
        "hi: 32-bit elements (torch.float32) against 16-bit (torch.uint16)",
        "lo.codes: shape [3, 2, 4, 96] against [3, 2, 5, 96]",
    ]
    assert contract.mismatches({}, want) == [
        "hi: missing (got [])", "lo.codes: missing (got [])"]
    assert contract.mismatches({"hi": "x", **{k: v for k, v in want.items() if k != "hi"}},
                               want) == ["hi: expected a tensor, got str"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(state=torch.randn(2, 5, 96)), r"state: expected an fp32 tensor \[slots, h, d_v, d_k\], "
                                        r"got torch.float32 \[2, 5, 96\]"),
    (dict(state=torch.randn(SHAPE, dtype=torch.float64)), r"got torch.float64"),
    (dict(hi_format="nvfp4"), r"hi_format: expected an element format"),
    (dict(hi_format="fp12"), r"fp12"),
    (dict(hi_rounding="rz"), r"hi_rounding: expected 'rn' or 'sr', got 'rz'"),
    (dict(lo_format="nvfp5"), r"nvfp5"),
    (dict(seed=-1), r"seed: expected an int in \[0, 2\^64\), got -1"),
    (dict(seed=1.5), r"seed: expected an int"),
    (dict(slots=torch.arange(2)), r"slots: expected integers \[3\] \(a list or tensor\), "
                                  r"got torch.int64 \[2\]"),
    (dict(slots=7), r"slots: expected integers \[3\] .*got 7"),  # every row one slot's words
    (dict(flushes=torch.zeros(3)), r"flushes: .*got torch.float32 \[3\]"),
    (dict(flushes=1 << 20), r"flushes: expected values in \[0, 2\^20\), got range"),
    (dict(slots=[0, -1, 2]), r"slots: expected values in \[0, 2\^20\)"),
    (dict(flushes=True), r"flushes: expected an int or integers \[3\] .*got True"),
], ids=["3-d", "fp64", "block-hi", "unknown-hi", "rounding", "unknown-lo", "negative-seed",
        "float-seed", "slots-shape", "slots-int", "float-flushes", "flushes-range",
        "negative-slot", "bool-flushes"])
def test_bad_arguments_are_named(kwargs, message):
    state = kwargs.pop("state", _state())
    with pytest.raises(ValueError, match=message):
        contract.flush_copies(state, **kwargs)


def test_mismatches_limit_is_checked():
    with pytest.raises(ValueError, match=r"limit: expected an int >= 1, got 0"):
        contract.mismatches({}, {}, limit=0)


def test_the_readme_recipe_runs_and_tells_a_faithful_kernel_from_a_faulty_one(capsys):
    """docs/design.md's recipe ("Checking a kernel of your own"), run as written on the buffers
    of a stand-in kernel (the emulation's stores) and again with one scale byte off."""
    from pathlib import Path

    from emulation import numerics as em

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = text.split("### Checking a kernel of your own")[1]
    code = re.search(r"\n\n((?:    .*\n|\n)+)", section)[1]  # the first indented block
    recipe = "\n".join(line[4:] for line in code.splitlines())
    assert recipe.startswith("from lowprec import contract")
    s_new, seed, slots, flushes_before = _state(4), 77, torch.tensor([1, 2, 0]), 5
    words = torch.stack([em.random_words_host(seed, int(s), flushes_before, s_new[0].numel())
                         for s in slots]).reshape(SHAPE)
    hi = em.round_to(s_new, "fp16", "sr", words).half()
    packed = q.pack(em.quantize(s_new, "nvfp4", "rn"))
    names = dict(s_new=s_new, seed=seed, slots=slots, flushes_before=flushes_before, hi=hi,
                 lo_codes=packed["codes"], lo_scales=packed["scales"],
                 lo_global_scale=packed["global_scale"])
    exec(recipe, dict(names))
    assert capsys.readouterr().out == "stored bit for bit\n"
    names["lo_scales"] = names["lo_scales"].clone()
    names["lo_scales"][2, 0, 1, 3] += 1
    exec(recipe, dict(names))
    assert capsys.readouterr().out.startswith("lo.scales: 1 of 180 elements differ; (2, 0, 1, 3)")


def test_a_conventional_sr_store_is_checked_with_the_token_counter_as_flushes():
    """The every-token SR store (docs/design.md: the token counter is the Philox `flush`
    field) is flush_copies' recurrence copy with `flushes` the tokens stored before: checked
    here on the emulation's conventional step, three tokens in."""
    from emulation.state_update import StateCache, mamba2_state_update

    gen = torch.Generator().manual_seed(6)
    slots, heads, headdim, dstate, groups = 3, 2, 5, 32, 1
    cache = StateCache.empty(slots, heads, headdim, dstate, format="fp16", rounding="sr",
                             seed=0xACE)
    debug = torch.empty(slots, heads, headdim, dstate)
    for _ in range(3):
        tokens_before = cache.tokens.clone()
        mamba2_state_update(
            cache, torch.randn(slots, heads, headdim, generator=gen),
            torch.randn(slots, heads, generator=gen), -torch.rand(heads, generator=gen),
            torch.randn(slots, groups, dstate, generator=gen),
            torch.randn(slots, groups, dstate, generator=gen), debug_state=debug)
    want = contract.flush_copies(debug, hi_format="fp16", hi_rounding="sr", lo_format=None,
                                 seed=0xACE, flushes=tokens_before)
    assert contract.mismatches({"hi": cache.state.half()}, want) == []
    assert contract.mismatches({"hi": cache.state.half()}, contract.flush_copies(
        debug, lo_format=None, seed=0xACE, flushes=tokens_before + 1)) != []
