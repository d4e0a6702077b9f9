"""experiments/spec_error.py: the output error of committed tokens under speculative decoding.

Sizes are small and odd where the format allows (dv = 5, dk = 7 for element formats, dk = 32
for the block formats); each run takes a second or two.
"""

import numpy as np
import pytest
import torch

from experiments import error_growth as eg
from experiments import spec_error as se


def _config(tmp_path, **overrides):
    base = dict(dv=5, dk=7, heads=2, seeds=2, tokens=40, window=(8,), draft=(3,),
                acceptance=(se.Acceptance(rate=0.6),), memory=(eg.parse_memory("long"),),
                arms=eg.parse_arms("separate_exact", "fp64", "sr"), out=str(tmp_path / "s.csv"),
                plot=None)
    base.update(overrides)
    return se.Config(**base)


@pytest.mark.parametrize("recurrence", ["mamba2", "gdn", "kda"])
def test_a_replay_cache_that_rounds_nothing_matches_the_exact_drafts(tmp_path, recurrence):
    """separate:fp64:rn:fp64 through lowprec.replay's verify/commit (flushes, rotations,
    rejected drafts overwritten) gives the direct FP64 recurrence's outputs to FP64 roundoff
    (1e-12) for every committed token, with a random acceptance."""
    c = _config(tmp_path, recurrence=recurrence)
    frame = se.run_cell(c, se.cells(c)[0])
    assert len(frame) == c.seeds * c.tokens and frame["rel_err"].notna().all()
    assert frame["rel_err"].max() < 1e-12


def test_an_nvfp4_read_copy_is_exact_before_its_first_flush_and_rounded_after(tmp_path):
    """separate:fp64:rn:nvfp4 reads the zero initial state exactly until the first flush
    (h + T > L) and the rounded read copy after it: roundoff first, then an error of the
    order of NVFP4's unit roundoff (between 1e-3 and 0.5) on the non-flush tokens."""
    c = _config(tmp_path, dk=32, tokens=64, acceptance=(se.Acceptance(pattern=(2,)),),
                arms=eg.parse_arms("separate_exact", "nvfp4", "sr"))
    frame = se.run_cell(c, se.cells(c)[0])
    # committing 2 of T = 3 a verify: h + 3 > 8 first at h = 6, so tokens 1..6 are exact
    first = frame[frame["token"] <= 6]["rel_err"]
    later = frame[frame["token"] > 8]["rel_err"]
    assert first.max() < 1e-12
    assert 1e-3 < later.median() < 0.5


def test_rate_acceptance_commits_the_expected_mean_and_is_the_same_for_every_arm():
    """Each of T - 1 drafts is accepted with probability p until the first rejection: the
    mean committed count is 1 + p + ... + p^(T-1) (T = 4, p = 0.7: 2.533; 4,000 verifies,
    checked within 0.05); the draws depend on the seed alone."""
    acc = se.Acceptance(rate=0.7)
    rngs = [np.random.default_rng([3, 1])]
    counts = [int(se._committed(acc, rngs, v, 4, 1)[0]) for v in range(4000)]
    assert min(counts) >= 1 and max(counts) <= 4
    assert abs(np.mean(counts) - (1 + 0.7 + 0.49 + 0.343)) < 0.05
    again = [np.random.default_rng([3, 1])]
    assert counts[:50] == [int(se._committed(acc, again, v, 4, 1)[0]) for v in range(50)]
    pattern = se.parse_acceptance("3-1-2")
    assert [int(se._committed(pattern, rngs, v, 3, 2)[1]) for v in range(4)] == [3, 1, 2, 3]


def test_a_conventional_state_under_speculation_grows_and_the_separate_one_does_not(tmp_path):
    """Long memory, FP8 with a row scale, T = 4 at acceptance 0.7, 600 tokens: every_step's
    error at the end is at least 2x its error near the start, separate:fp16:sr stays within
    2x, and at the end every_step > separate (median over seeds of 16-token block means)."""
    c = _config(tmp_path, dk=32, tokens=600, window=(16,), draft=(4,),
                acceptance=(se.Acceptance(rate=0.7),),
                arms=eg.parse_arms("every_step:fp8_e4m3_row:rn,separate_fp16sr",
                                   "fp8_e4m3_row", "sr"))
    frames = [se.run_cell(c, cell) for cell in se.cells(c)]

    def block(frame, lo, hi):
        rows = frame[(frame["token"] > lo) & (frame["token"] <= hi)]
        return rows.groupby("seed")["rel_err"].mean().median()

    every, separate = frames
    assert block(every, 584, 600) > 2 * block(every, 48, 64)
    assert block(separate, 584, 600) < 2 * block(separate, 48, 64)
    assert block(every, 584, 600) > block(separate, 584, 600)


def test_main_writes_csv_meta_png_and_replot_checks_the_csv(tmp_path, capsys):
    """A tiny run through main (two T, a rate and a pattern): CSV with the spec columns, one
    row per (cell, seed, token), meta.json, PNG; --replot redraws; a negative error is
    refused in one line naming the file and the line."""
    out = tmp_path / "spec.csv"
    argv = ["--dv", "3", "--dk", "5", "--seeds", "2", "--tokens", "30", "--window", "8",
            "--draft", "2,4", "--acceptance", "0.5,2-1", "--arms", "every_step:fp16:rn,"
            "separate:bf16:sr:fp8_e4m3", "--memory", "short", "--out", str(out),
            "--no-progress"]
    assert se.main(argv) == 0
    frame = se.read_csv(out)
    assert tuple(frame.columns) == se.CSV_COLUMNS
    assert len(frame) == 2 * 2 * 2 * 2 * 30  # T x acceptance x arms x seeds x tokens
    assert set(frame["acceptance"]) == {"p0.5", "2-1"} and set(frame["draft"]) == {2, 4}
    assert (tmp_path / "spec.meta.json").is_file() and (tmp_path / "spec.png").is_file()
    assert se.main(["--replot", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    lines[3] = ",".join([*lines[3].split(",")[:-1], "-1.000000e-03"])
    out.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        se.main(["--replot", "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "line 4: rel_err" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--draft", "32"], "draft: expected T <= every window L"),
    (["--acceptance", "1.5"], "acceptance: expected a rate in [0, 1]"),
    (["--acceptance", "5-1"], "a pattern commits at most T"),
    (["--acceptance", "0-1"], "committed counts >= 1"),
    (["--tokens", "0"], "tokens: expected an integer >= 1"),
    (["--arms", "separate:fp16:xx:nvfp4"], "not a rounding"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    """Each bad argument: exit status 2, one line naming it, nothing written."""
    with pytest.raises(SystemExit) as info:
        se.main([*argv, "--out", str(tmp_path / "x.csv")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not list(tmp_path.iterdir())


def test_snapshots_keep_the_accepted_draft_state_per_slot(tmp_path):
    """The conventional cache under speculation continues, per slot, from the state after its
    own accepted count (slot 0 after 1 draft, slot 1 after 3)."""
    c = _config(tmp_path)
    cache = se._Snapshots(c, batch=2)
    drafts = se._drafts([torch.Generator().manual_seed(s) for s in range(2)],
                        se.Config(**{**c.__dict__, "memory": c.memory}), 3)
    cache.verify(*drafts)
    cache.commit(torch.tensor([1, 3]))
    assert torch.equal(cache.state[0], cache.pending[0][0])
    assert torch.equal(cache.state[1], cache.pending[2][1])
    assert cache.count.tolist() == [1, 3]


@pytest.mark.parametrize("recurrence", ["gdn", "kda"])
def test_the_delta_rule_presets_read_an_exact_checkpoint_until_the_first_flush(tmp_path,
                                                                               recurrence):
    """--preset gdn-toy / kda-toy (48 tokens, 2 seeds) through main: every row is of the
    recurrence and its four arms; with T = 4, L = 16 no verify flushes before 13 tokens are
    committed (h + 4 > 16 first at h = 13), so the separate arms are FP64-exact on tokens
    1..12 and carry the NVFP4 read copy's error (1e-3 .. 0.5) on tokens past 32, while
    every_step:fp16 is rounded from token 1 (error above 1e-6)."""
    out = tmp_path / "d.csv"
    assert se.main(["--preset", f"{recurrence}-toy", "--tokens", "48", "--seeds", "2",
                    "--out", str(out), "--plot", "none", "--no-progress"]) == 0
    frame = se.read_csv(out)
    assert set(frame["recurrence"]) == {recurrence}
    assert set(frame["arm"]) == {"every_step:fp16:rn", "shared:nvfp4:rn",
                                 "separate:fp64:rn:nvfp4", "separate:fp16:sr:nvfp4"}
    assert len(frame) == 4 * 2 * 2 * 2 * 48  # arms x acceptance x memory x seeds x tokens
    separate = frame[frame["arm"].str.startswith("separate")]
    assert separate[separate["token"] <= 12]["rel_err"].max() < 1e-12
    assert 1e-3 < separate[separate["token"] > 32]["rel_err"].median() < 0.5
    every = frame[frame["arm"] == "every_step:fp16:rn"]
    assert every["rel_err"].min() > 1e-6
