"""The command lines of cute_kernels.bench_read and bench_write (CPU): a bad argument or a
machine without CUDA is a one-line error with exit status 2, not a traceback, and --help
names the module and its defaults."""

import pytest
import torch

from cute_kernels import bench_read, bench_write

BAD = {
    bench_read: [["--batch", "256", "0"], ["--h", "16"], ["--h", "0"], ["--reps", "0"],
                 ["--window", "-1"], ["--splits", "0"],
                 # combinations that ran something else than asked (the last list only, or
                 # a flag ignored), now refused before the GPU
                 ["--ablations", "--prologue-variants"], ["--no-variants", "--ablations"],
                 ["--splits-sweep", "--knob-variants"], ["--splits", "2", "4"],
                 ["--no-variants", "--splits-sweep"],
                 # each was found only on the GPU, after the timing (--out) or during it
                 ["--splits-sweep", "--splits", "1", "3"], ["--splits-sweep", "--splits", "8"],
                 ["--batch", "8", "8"], ["--out", "{tmp}"], ["--out", "{tmp}/file.txt/x.csv"]],
    bench_write: [["--batch", "0"], ["--window", "0"], ["--reps", "-1"], ["--replays", "0"],
                  ["--only", "flush", "nvfp5"], ["--only", "=flush"], ["--out", "{tmp}"]],
}


@pytest.mark.parametrize("module", [bench_read, bench_write], ids=lambda m: m.__name__)
def test_help_names_the_module_and_the_defaults(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: python -m {module.__name__}" in text
    assert "Needs a CUDA GPU." in text
    assert "window L (default: 16)" in text


@pytest.mark.parametrize("module, argv", [(m, a) for m, bad in BAD.items() for a in bad],
                         ids=lambda x: x.__name__ if hasattr(x, "__name__") else " ".join(x))
def test_a_bad_argument_is_a_one_line_error(module, argv, capsys, tmp_path):
    """Refused before the GPU is looked for: here, without one, the error is the argument's."""
    (tmp_path / "file.txt").write_text("a file, not a folder")
    with pytest.raises(SystemExit) as exit_:
        module.main([a.format(tmp=tmp_path) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m {module.__name__}: error: --" in err and "Traceback" not in err


@pytest.mark.parametrize("module", [bench_read, bench_write], ids=lambda m: m.__name__)
def test_without_cuda_the_benchmark_says_so(module, capsys):
    if torch.cuda.is_available():
        pytest.skip("for CPU-only machines")
    with pytest.raises(SystemExit) as exit_:
        module.main([])
    assert exit_.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_read_splits_are_checked_against_the_shape_s_group(capsys):
    """mamba2-2.7b's one group of 80 heads takes head_splits 5 at 4 warps (20 heads a CTA);
    the Nemotron layer's groups of 16 do not (the sweep's check is the shape's)."""
    with pytest.raises(SystemExit) as exit_:
        bench_read.main(["--splits-sweep", "--splits", "5"])
    assert exit_.value.code == 2
    assert "--splits: 5: head_splits * 4 warps must divide the 16 heads of a group of " \
        "nemotron3-super" in capsys.readouterr().err
    if not torch.cuda.is_available():  # past the argument checks, to the GPU's
        with pytest.raises(SystemExit) as exit_:
            bench_read.main(["--splits-sweep", "--splits", "1", "5", "--shape", "mamba2-2.7b"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "needs a CUDA GPU" in err and "--splits" not in err


def test_bench_write_only_lists_the_cases_when_nothing_matches(capsys):
    with pytest.raises(SystemExit):
        bench_write.main(["--only", "fluhs"])
    err = capsys.readouterr().err
    assert "--only: no case name contains 'fluhs'; the cases:" in err
    assert "\n  flush fp16-SR + nvfp4\n" in err and "window/token fp32 single copy" in err


def test_bench_write_only_picks_by_substring_or_exact_name():
    names = [name for name, _, _ in bench_write.bench_cases(bench_write.BenchConfig())]
    assert len(names) == len(set(names)) > 20
    exact = [n for n in names if bench_write.matches(n, ["=flush fp16-SR + nvfp4"])]
    assert exact == ["flush fp16-SR + nvfp4"]
    some = [n for n in names if bench_write.matches(n, ["state_update", "=flush fp32 single copy"])]
    assert some == ["flush fp32 single copy", "state_update fp32", "state_update fp16 RN",
                    "state_update fp16 SR"]


def test_a_failed_csv_write_after_the_timing_is_one_line(tmp_path):
    """bench_read prints its table before writing, and a write that fails says so."""
    (tmp_path / "file.txt").write_text("in the way")
    with pytest.raises(SystemExit) as exit_:
        bench_read.write_csv(str(tmp_path / "file.txt" / "out.csv"), [{"format": "nvfp4"}])
    assert "bench_read: --out " in str(exit_.value) and "the table above" in str(exit_.value)
    bench_read.write_csv(str(tmp_path / "new" / "out.csv"), [{"format": "nvfp4", "us": 1.5}])
    assert (tmp_path / "new" / "out.csv").read_text().splitlines() == ["format,us", "nvfp4,1.5"]


def test_bench_read_shapes_are_the_mamba2_layers_of_lowprec_models():
    """--shape's layers come from lowprec.models, as experiments.kernel_bench's do (the
    numbers were written out in both), in replay_output's names."""
    from lowprec import models

    assert list(bench_read.SHAPES) == ["nemotron3-super", "mamba2-2.7b"]
    for name, layer in bench_read.SHAPES.items():
        ssm = models.get(name).ssm
        assert layer == dict(nheads=ssm.nheads, headdim=ssm.d_v, dstate=ssm.d_k,
                             ngroups=ssm.ngroups)
    assert bench_read.SHAPES["mamba2-2.7b"] == dict(nheads=80, headdim=64, dstate=128,
                                                    ngroups=1)
    assert bench_read.NEMOTRON is bench_read.SHAPES["nemotron3-super"]


@pytest.mark.parametrize("module, argv", [
    ("cute_kernels.bench_read", ["--windo", "16"]),
    ("cute_kernels.bench_write", ["--rep", "3"]),
    ("cute_kernels.instruction_count", ["--pip"]),
    ("cute_kernels.stall_sites", ["x.csv", "--to", "3"]),
    ("lowprec.__main__", ["--hea", "1"]),
])
def test_a_shortened_flag_is_refused_as_the_experiments_refuse_it(module, argv, capsys):
    """argparse took a flag's prefix (`--rep 3` as `--reps 3`), so a command copied into a
    results file could read differently from --help; the experiments' parser refuses it."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv)
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {' '.join(argv[-2:] if len(argv) > 1 else argv)}" in \
        capsys.readouterr().err


def test_every_flush_case_builds_a_config_that_flushconfig_accepts(monkeypatch):
    """FlushConfig refuses what replay_flush refuses; each bench_write flush case's knobs
    (register caps, folds, chunks, ablations, elements per thread) must pass, or the case
    would fail on the GPU only. The config is built before any CUDA call, so here each flush
    case stops right after it."""
    built = []

    class Built(Exception):
        pass

    def record(*args, **knobs):
        built.append(bench_write_flush_config(*args, **knobs))
        raise Built

    bench_write_flush_config = bench_write.flush_config
    monkeypatch.setattr(bench_write, "flush_config", record)
    names = []
    for name, _, bench in bench_write.bench_cases(bench_write.BenchConfig()):
        if name.startswith("flush"):
            with pytest.raises(Built):
                bench()
            names.append(name)
    assert len(built) == len(names) >= 15
    assert {c.min_ctas_per_sm for c in built} >= {0, 5, 6}
    assert {c.hi_format for c in built} == {"fp16", "fp32"}


def test_bench_write_warms_every_set_for_kernel_bench_s_passes():
    """A graph of `reps` launches cycling over `sets` sets (launch r on set r % sets) is
    replayed untimed until every set it launches on has had WARM_REPLAYS (32) passes, counted
    here launch by launch: 4 sets in a 32-launch graph, 4 replays; the window's graph of 2
    launches on 1 set, 16; 3 sets in 10 launches, 11 (set 1 gets 3 a replay)."""
    from collections import Counter

    from cute_kernels import bench_read, bench_write

    assert bench_read.WARM_REPLAYS == 32
    expected = {(4, 32): 4, (1, 2): 16, (3, 10): 11, (7, 5): 32, (5, 5): 32}
    for (sets, reps), n in expected.items():
        assert bench_write.warm_graph_replays(sets, reps) == n
        passes = Counter(r % sets for _ in range(n) for r in range(reps))
        assert min(passes.values()) >= 32  # every set launched on is warmed
        fewer = Counter(r % sets for _ in range(n - 1) for r in range(reps))
        assert min(fewer.values()) < 32  # and no replay more than that needs
