"""experiments.kernel_bench on the CPU: its command line, its byte accounting, the derived rows
and plots it makes from a CSV, and (when scripts/peers/prepare.sh has built .peers/vllm) the
vLLM adapters run under Triton's interpreter against the lowprec reference."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments import cases, harness, peers
from experiments import kernel_bench as kb

REPO = Path(__file__).resolve().parent.parent
# Odd sizes everywhere a kernel does not need multiples: 4 heads in 2 groups, headdim 16,
# dstate 32 (nvfp4 needs blocks of 16).
TINY = kb.BenchShape("tiny", nheads=4, headdim=16, dstate=32, ngroups=2, source="test")


def test_bench_shapes_are_the_mamba2_layers_of_lowprec_models():
    """Both benchmarked shapes take their numbers from lowprec.models, under the same names
    and order."""
    from lowprec import models

    assert list(kb.SHAPES) == ["nemotron3-super", "mamba2-2.7b"]
    for name, shape in kb.SHAPES.items():
        assert shape.name == name
        assert shape.ssm == models.get(name).ssm
    m2 = kb.SHAPES["mamba2-2.7b"]
    assert (m2.nheads, m2.headdim, m2.dstate, m2.ngroups) == (80, 64, 128, 1)
    assert "state-spaces/mamba2-2.7b" in m2.source


def test_help_runs_on_a_cpu_only_machine():
    """`python -m experiments.kernel_bench --help` imports and prints the options (no GPU)."""
    result = subprocess.run([sys.executable, "-m", "experiments.kernel_bench", "--help"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--shapes", "--batches", "--windows", "--kernels", "--peers", "--out",
                   "--plot-dir", "--quick", "--budget-s", "--merge"):
        assert option in result.stdout


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--shapes", "nemotron3-super,nope"], "shapes"),
        (["--batches", "1,x"], "batches"),
        (["--batches", "8,,16"], "batches"),  # an empty item is a typo, not dropped
        (["--shapes", "nemotron3-super,"], "shapes"),
        (["--kernels", "cute:nonflush:nvfp4,,cute:nonflush:fp32"], "kernels"),
        (["--windows", "64"], "windows"),
        (["--kernels", "cute:nonflush:fp64"], "kernels"),
        (["--peers", "sglang"], "peers"),
        (["--merge", "a.csv", "--plot-only", "b.csv"],
         "--plot-only: not allowed with argument --merge"),
        # a CSV given twice (however spelled) would have every row merged twice
        (["--merge", str(REPO / "results" / "kernel_bench.csv"),
          str(REPO / "results" / ".." / "results" / "kernel_bench.csv")], "--merge: the CSV"),
        # each repeat would be timed again
        (["--batches", "256,256"], "batches: expected each once, got 256 twice"),
        (["--kernels", "cute:nonflush:nvfp4,cute:nonflush:nvfp4"], "kernels: expected each once"),
        (["--peers", "vllm,vllm"], "peers: expected each once"),
        (["--budget-s", "nan"], "budget_s: expected a finite number > 0"),
        (["--kernels", "none", "--peers", "none"], "leaves nothing to time"),
        # the default --out is the committed headline CSV: a merge must name its output
        (["--merge", str(REPO / "results" / "kernel_bench.csv")],
         "--merge: name the merged CSV with --out"),
        # argparse's abbreviations are refused: a flag reads as typed
        (["--batch", "1"], "unrecognized arguments: --batch"),
    ],
)
def test_bad_argument_is_one_line_error(argv, word, capsys):
    """A bad value exits with status 2 and one line on stderr that names the argument."""
    with pytest.raises(SystemExit) as exit_info:
        kb.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and word in err


def test_output_paths_of_the_wrong_kind_are_one_line_errors(tmp_path, capsys):
    """--out naming a folder, or --plot-dir naming a file, is an argument error before any
    CSV is read or written."""
    (tmp_path / "f.png").write_text("")
    for argv in (["--merge", str(REPO / "results" / "kernel_bench.csv"), "--out", str(tmp_path)],
                 ["--plot-only", str(REPO / "results" / "kernel_bench.csv"), "--plot-dir",
                  str(tmp_path / "f.png")]):
        with pytest.raises(SystemExit) as exit_info:
            kb.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("--out" in err or "--plot-dir" in err), err


def test_unwritable_output_paths_are_one_line_errors(tmp_path, capsys):
    """--out or --plot-dir under a file (/dev/null/x) is an argument error before the work
    (both were tracebacks: the merge's write, the plot's mkdir)."""
    (tmp_path / "f").write_text("")
    csv = str(REPO / "results" / "kernel_bench.csv")
    for argv, flag in ((["--merge", csv, "--out", str(tmp_path / "f" / "x.csv")], "--out"),
                       (["--plot-only", csv, "--plot-dir", str(tmp_path / "f" / "x")],
                        "--plot-dir")):
        with pytest.raises(SystemExit) as exit_info:
            kb.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"error: {flag}: " in err, err


@pytest.mark.parametrize("argv, expected", [
    ([], dict(batches=kb.BenchConfig.batches, windows=kb.BenchConfig.windows, reps=20,
              out="results/kernel_bench.csv")),
    (["--quick"], dict(batches=(1, 256), windows=(16,), reps=5,
                       shapes=(kb.BenchConfig.shapes[0],),
                       out="runs/kernel_bench_quick/kernel_bench.csv")),
    (["--quick", "--out", "q.csv"], dict(out="q.csv")),
    (["--quick", "--batches", "8", "--windows=32", "--shapes", "mamba2-2.7b"],
     dict(batches=(8,), windows=(32,), reps=5, shapes=("mamba2-2.7b",))),
    (["--batches=4,64"], dict(batches=(4, 64), windows=kb.BenchConfig.windows)),
])
def test_grid_flags_win_over_the_defaults_and_quick(argv, expected):
    """--shapes, --batches and --windows, in either spelling (--batches 8 or --batches=8),
    set the grid, with or without --quick, whose small grid fills in what is not given; a
    smoke test writes its own CSV unless --out says otherwise, not the committed one."""
    config = kb.config_from_args(kb.build_parser().parse_args(argv))
    for name, value in expected.items():
        assert getattr(config, name) == (tuple(value) if isinstance(value, tuple) else value)


def test_targets_come_from_the_first_run_whatever_the_merge_order(tmp_path, capsys):
    """Where two runs timed a point, the targets, speedups and plots take the first run by
    label (a same-run pair first), so --merge A B and --merge B A print the same targets,
    each line naming its run, whatever the file order."""
    frame = _synthetic_frame()
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    frame.to_csv(a, index=False)
    frame.assign(run="h200", time_us=frame["time_us"] * 1.5, frac_copy=frame["frac_copy"] / 1.5
                 ).to_csv(b, index=False)
    printed = []
    for order in ((a, b), (b, a)):
        out = tmp_path / "merged.csv"
        assert kb.main(["--merge", *map(str, order), "--out", str(out), "--plot-dir",
                        "none"]) == 0
        printed.append(capsys.readouterr().out)
        summary = kb.summarize(kb.read_csv(out))
        assert set(summary["run"]) == {"h100"}, summary
    assert printed[0] == printed[1] and "(run h100)" in printed[0]


def test_profile_launches_each_set_once_inside_the_profilers_window(monkeypatch, capsys):
    """--profile builds the kernel at the first shape, batch and window asked for and launches
    it once per set between cudaProfilerStart and cudaProfilerStop (after warm passes)."""
    seen, events = {}, []

    class FakeCase:
        reset = None

        def launchers(self):
            return [lambda i=i: events.append(f"launch {i}") for i in range(3)]

    def fake_build(spec, shape, batch, window, cursor, sets, device, seed, peers_dir, act):
        seen.update(kernel=spec.name, batch=batch, window=window, cursor=cursor)
        return FakeCase()

    class FakeCudart:
        def cudaProfilerStart(self):
            events.append("start")

        def cudaProfilerStop(self):
            events.append("stop")

    monkeypatch.setattr(kb, "build_case", fake_build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    argv = ["--shapes", "nemotron3-super", "--batches", "96", "--windows", "8"]
    config = kb.config_from_args(kb.build_parser().parse_args(argv))
    assert kb.profile(config, "cute:nonflush:nvfp4") == 0
    assert seen == {"kernel": "cute:nonflush:nvfp4", "batch": 96, "window": 8, "cursor": 4}
    window = events[events.index("start"):events.index("stop") + 1]
    assert window == ["start", "launch 0", "launch 1", "launch 2", "stop"]
    assert events[:events.index("start")].count("launch 0") == 3
    assert "profiled cute:nonflush:nvfp4" in capsys.readouterr().err


def test_lead_cycles_reach_the_configuration_and_bad_values_are_refused(capsys):
    """--lead-cycles N sets the spin queued before each timed region (default LEAD_CYCLES, 0
    turns it off); a negative count is one line on stderr and exit status 2."""
    for argv, expected in (([], harness.LEAD_CYCLES), (["--lead-cycles", "0"], 0),
                           (["--lead-cycles", "12345"], 12345)):
        argv = ["--quick", *argv]
        assert kb.config_from_args(kb.build_parser().parse_args(argv)).lead_cycles == expected
    with pytest.raises(SystemExit) as exit_info:
        kb.main(["--quick", "--lead-cycles", "-5", "--plot-dir", "none"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lead_cycles" in err


def test_warm_replays_reach_the_configuration_and_are_left_out_of_the_times(monkeypatch,
                                                                            capsys):
    """--warm-replays N (default WARM_REPLAYS = 32) untimed replays come first, and only the
    `reps` after them are returned (per launch); a negative count is refused in one line."""
    for argv, expected in (([], harness.WARM_REPLAYS), (["--warm-replays", "3"], 3),
                           (["--warm-replays", "0"], 0)):
        argv = ["--quick", *argv]
        assert kb.config_from_args(kb.build_parser().parse_args(argv)).warm_replays == expected
    assert harness.WARM_REPLAYS == 32
    with pytest.raises(SystemExit) as exit_info:
        kb.main(["--quick", "--warm-replays", "-1", "--plot-dir", "none"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "warm_replays" in err

    replays = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: (_ for _ in ()).throw(RuntimeError("cpu")))

    def fake_time(fn, lead_cycles):
        fn()
        replays.append(lead_cycles)
        return 0.003 * len(replays)  # ms of the whole replay: 3 us more each time

    monkeypatch.setattr(harness, "event_time_ms", fake_time)
    launched = []
    times, method = harness.time_launches([lambda: launched.append(0), lambda: launched.append(1)],
                                     lambda: None, reps=4, lead_cycles=9, warm_replays=7)
    assert method == "events"
    assert replays == [9] * 11 and launched == [0, 1] * 12  # one eager pass, then 7 + 4
    assert times == pytest.approx([1.5 * k for k in (8, 9, 10, 11)])


def test_the_spin_is_queued_before_the_start_event(monkeypatch):
    """event_time_ms queues the GPU spin, then the start event, the work and the end event,
    in that order (so the start event waits behind the spin while the host submits the work);
    with lead_cycles=0 there is no spin."""
    calls, made = [], []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            self.name = ("start", "end")[len(made) % 2]  # created start first, then end
            made.append(self)

        def record(self):
            calls.append(self.name)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.5

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(f"spin {cycles}"))
    assert harness.event_time_ms(lambda: calls.append("work"), 777) == 1.5
    assert calls == ["spin 777", "start", "work", "end"]
    calls.clear()
    harness.event_time_ms(lambda: calls.append("work"), 0)
    assert calls == ["start", "work", "end"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_measuring_without_cuda_fails_with_one_clear_line(tmp_path, capsys):
    code = kb.main(["--quick", "--out", str(tmp_path / "x.csv"), "--plot-dir", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "CUDA" in err
    assert not (tmp_path / "x.csv").exists()


# --------------------------------------------------------------------------------------------
# bytes: a hand count at the tiny shape, batch 3, cursor 5


STATE = {"fp32": 4 * 16 * 32 * 4, "fp16": 4 * 16 * 32 * 2, "fp8_e4m3": 4 * 16 * 32,
         # codes (two per byte) + one E4M3 byte per 16 + one fp32 per head
         "nvfp4": 4 * 16 * 32 // 2 + 4 * 16 * 32 // 16 + 4 * 4}
RECORD = 4 * (16 * 2 + 4) + 2 * 32 * 2  # x (bf16) and dt (fp32) per head, B (bf16) per group
TOKEN = 2 * 4 * 16 * 2 + 4 * 2 + 2 * 2 * 32 * 2  # x and y, dt (bf16), B and C
FP32_DT = 4 * 2  # 2 bytes more per head where the raw dt is fp32 (the kit's kernels)


@pytest.mark.parametrize(
    "name, per_slot",
    [
        ("cute:nonflush:nvfp4", STATE["nvfp4"] + 6 * RECORD + TOKEN + FP32_DT),
        ("cute:nonflush:fp8_e4m3", STATE["fp8_e4m3"] + 6 * RECORD + TOKEN + FP32_DT),
        ("cute:nonflush:fp32", STATE["fp32"] + 6 * RECORD + TOKEN + FP32_DT),
        ("cute:flush:fp16sr+nvfp4",
         2 * STATE["fp16"] + STATE["nvfp4"] + 6 * RECORD + TOKEN + FP32_DT),
        ("cute:flush:fp32", 2 * STATE["fp32"] + 6 * RECORD + TOKEN + FP32_DT),
        ("cute:update:fp16sr", 2 * STATE["fp16"] + TOKEN + FP32_DT),
        ("vllm:nonflush:fp32", STATE["fp32"] + 6 * RECORD + TOKEN),
        ("vllm:flush:fp32", 2 * STATE["fp32"] + 5 * RECORD + TOKEN),  # no append on its flush
        ("flashinfer:update:fp32", 2 * STATE["fp32"] + TOKEN + FP32_DT),
        ("flashinfer:flush:fp16", 2 * STATE["fp16"] + 6 * RECORD + TOKEN),
        ("emulation:nonflush:nvfp4", STATE["fp32"] + 6 * RECORD + TOKEN + FP32_DT),
    ],
)
def test_kernel_bytes_equal_a_hand_count(name, per_slot):
    """Bytes = states read and written in their formats, `cursor` records read, the appended
    records, and the token's x, y, dt, B, C (module docstring, **Bytes**)."""
    assert kb.kernel_bytes(name, TINY, batch=3, cursor=5) == 3 * per_slot


def test_sr_kernel_names_parse_to_every_setting_and_move_the_defaults_bytes():
    """Every SR setting of cases.SR_SETTINGS has a flush and an update kernel named
    `fp16sr<k>r<R>` (parsed back to (k, R); the bare `fp16sr` is (32, 10)), schemes that
    price a token with them, and the default kernels' byte counts (the copies' formats are
    the same)."""
    assert (16, 7) in cases.SR_SETTINGS and (32, 10) not in cases.SR_SETTINGS
    for sr in cases.SR_SETTINGS:
        flush, update = (f"cute:flush:fp16sr{sr[0]}r{sr[1]}+nvfp4",
                         f"cute:update:fp16sr{sr[0]}r{sr[1]}")
        for name, default in ((flush, "cute:flush:fp16sr+nvfp4"),
                              (update, "cute:update:fp16sr")):
            assert cases.sr_setting(kb.KERNELS[name].variant) == sr
            assert not kb.KERNELS[name].default
            assert kb.kernel_bytes(name, TINY, 3, 7) == kb.kernel_bytes(default, TINY, 3, 7)
        assert kb.SCHEMES[f"two-precision-sr{sr[0]}r{sr[1]}"] == ("cute:nonflush:nvfp4", flush)
        assert kb.SCHEMES[f"conventional-fp16sr{sr[0]}r{sr[1]}"] == (update,)
    for variant in ("fp16sr", "fp16sr+nvfp4", "fp32", "nvfp4"):
        assert cases.sr_setting(variant) == (32, 10)
    assert cases.sr_variant((32, 10)) == "fp16sr" and cases.sr_variant((13, 4)) == "fp16sr13r4"


@pytest.mark.parametrize("name, setting", [
    ("cute:flush:fp16sr16r7+nvfp4", (16, 7)), ("cute:update:fp16sr8r4", (8, 4)),
    ("cute:flush:fp16sr+nvfp4", (32, 10)), ("cute:update:fp16sr", (32, 10)),
])
def test_sr_cases_launch_the_kernel_with_their_setting(name, setting, monkeypatch):
    """A case of an SR kernel hands the public function a cache carrying its (sr_bits,
    philox_rounds), which the cache checks accept (stand-ins for the kernels: CPU)."""
    rf, su, kv = cases.cute("replay_flush"), cases.cute("state_update"), cases.cute("cache")
    seen = []
    monkeypatch.setattr(rf, "mamba2_replay_flush", lambda cache, *a, **k: seen.append(cache))
    monkeypatch.setattr(su, "mamba2_state_update", lambda cache, *a, **k: seen.append(cache))
    spec = kb.KERNELS[name]
    case = cases.build_case(spec, TINY, 3, 8, spec.cursors(8)[0], 2, "cpu")
    case.launcher(1)()
    (cache,) = seen
    assert (cache.sr_bits, cache.philox_rounds) == setting
    check = kv.check_state_cache if spec.step == "update" else kv.check_replay_cache
    check(cache)


def test_nemotron_state_and_record_bytes_match_the_design():
    """DESIGN.md: an NVFP4 read copy of 590,336 B and a record of 18,944 B per sequence."""
    shape = kb.SHAPES["nemotron3-super"]
    nonflush = kb.kernel_bytes("cute:nonflush:nvfp4", shape, batch=1, cursor=0)
    assert nonflush == 590_336 + 18_944 + cases.token_bytes(shape, dt_bytes=4)


# --------------------------------------------------------------------------------------------
# derived rows and plots from a synthetic CSV


def _synthetic_frame() -> pd.DataFrame:
    """Timed rows at L = 16 for two batches: non-flush steps at cursors 0, 8, 14 taking
    1 + cursor/8 (nvfp4) or 4 * (1 + cursor/8) us (fp32), flushes 20 and 40 us, updates 30 us;
    batch 256 times are those x 100."""
    rows = []
    shape = kb.SHAPES["nemotron3-super"]

    def add(kernel, batch, cursor, us):
        spec = kb.KERNELS[kernel]
        nbytes = kb.kernel_bytes(spec, shape, batch, cursor)
        gbps = nbytes / us / 1e3
        rows.append(dict(
            run="h100", kernel=kernel, impl=spec.impl, step=spec.step, scheme="",
            shape=shape.name, batch=batch, window=16, cursor=cursor, time_us=us,
            time_us_p10=0.9 * us, time_us_p90=1.1 * us, bytes=nbytes, gbps=gbps,
            frac_copy=gbps / 4000, frac_read=gbps / 4200, copy_gbps=4000.0, read_gbps=4200.0,
            check=0.1, status="ok", sets=8, timing="graph", note=""))

    for batch, scale in ((1, 1.0), (256, 100.0)):
        for cursor in (0, 8, 14):
            add("cute:nonflush:nvfp4", batch, cursor, scale * (1 + cursor / 8))
            add("cute:nonflush:fp32", batch, cursor, scale * 4 * (1 + cursor / 8))
        add("cute:flush:fp16sr+nvfp4", batch, 15, scale * 20.0)
        add("cute:flush:fp32", batch, 15, scale * 40.0)
        add("cute:update:fp32", batch, 0, scale * 30.0)
        add("vllm:update:fp32", batch, 0, scale * 35.0)
    rows.append(dict(rows[-1], kernel="flashinfer:update:fp32", impl="flashinfer",
                     time_us=math.nan, status="unavailable: flashinfer not importable"))
    return pd.DataFrame(rows, columns=kb.COLUMNS)


def test_token_rows_average_the_window_and_count_its_bytes():
    """Per token = ((L-1) * mean non-flush + flush) / L; the non-flush time is linear in the
    cursor here, so the interpolated mean over cursors 0..14 is exactly 1 + 7/8 us."""
    frame = kb.with_token_rows(_synthetic_frame())
    tokens = frame[frame["step"] == "token"].set_index(["scheme", "batch"])
    expected = (15 * (1 + 7 / 8) + 20.0) / 16
    assert tokens.loc[("two-precision", 1), "time_us"] == pytest.approx(expected, rel=1e-12)
    assert tokens.loc[("two-precision", 256), "time_us"] == pytest.approx(100 * expected)
    assert tokens.loc[("conventional-fp32", 1), "time_us"] == 30.0
    shape = kb.SHAPES["nemotron3-super"]
    window_bytes = (sum(kb.kernel_bytes("cute:nonflush:nvfp4", shape, 1, c) for c in range(15))
                    + kb.kernel_bytes("cute:flush:fp16sr+nvfp4", shape, 1, 15))
    assert tokens.loc[("two-precision", 1), "bytes"] == pytest.approx(window_bytes / 16)
    assert ("flashinfer-conventional-fp32", 1) not in tokens.index


def test_speedups_and_summary_at_the_headline_point():
    frame = kb.with_token_rows(_synthetic_frame())
    sp = kb.speedups(frame).set_index(["comparison", "batch"])
    assert sp.loc[("non-flush: nvfp4 vs fp32 checkpoint", 256), "speedup"] == pytest.approx(4.0)
    two = (15 * (1 + 7 / 8) + 20.0) / 16
    fp32 = (15 * 4 * (1 + 7 / 8) + 40.0) / 16
    assert sp.loc[("token: two-precision vs FP32 ReplaySSM", 1), "speedup"] == pytest.approx(
        fp32 / two)
    assert sp.loc[("token: two-precision vs conventional fp32", 256), "speedup"] == pytest.approx(
        30.0 / two)
    summary = kb.summarize(frame).set_index("comparison")
    assert summary["goal"].tolist() == [0.85, 5.0, 4.0, 7.5, 1.0]
    assert not summary.loc["non-flush: nvfp4 vs fp32 checkpoint (batch 256)", "met"]
    text = kb.format_summary(frame)
    assert "MISSED" in text and "not timed: flashinfer:update:fp32" in text


def test_plot_and_merge_read_only_the_csv(tmp_path):
    """plot() draws three PNGs from a CSV; --merge of two runs' CSVs keeps both runs and pairs
    speedups within a run first."""
    frame = _synthetic_frame()
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    frame.to_csv(a, index=False)
    frame.assign(run="h200", time_us=frame["time_us"] * 2).to_csv(b, index=False)
    paths = kb.plot(a, tmp_path / "plots")
    assert [p.name for p in paths] == ["a_time.png", "a_speedup.png", "a_formats.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    merged = tmp_path / "merged.csv"
    assert kb.main(["--merge", str(a), str(b), "--out", str(merged), "--plot-dir", "none"]) == 0
    out = kb.read_csv(merged)
    # 4 schemes (two-precision, fp32-replay, conventional fp32, vLLM fp32) x 2 batches x 2 runs
    assert set(out["run"]) == {"h100", "h200"} and (out["step"] == "token").sum() == 4 * 2 * 2
    assert kb.speedups(out)["same_run"].all()


def test_merge_refuses_one_run_label_in_two_files(tmp_path, capsys):
    """Merged runs are kept apart by their run label: two files that both hold run h100 (a copy
    under another name, or two runs left on the default label) would have their rows counted
    together in the per-token rows, so the merge refuses them, naming the label and files."""
    frame = _synthetic_frame()
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    frame.to_csv(a, index=False)
    frame.assign(time_us=frame["time_us"] * 3).to_csv(b, index=False)  # run h100 again
    merged = tmp_path / "merged.csv"
    with pytest.raises(SystemExit) as exit_:
        kb.main(["--merge", str(a), str(b), "--out", str(merged), "--plot-dir", "none"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "run label 'h100' is in both" in err and str(a) in err and str(b) in err
    assert not merged.exists()


def test_plan_orders_the_headline_first_and_tiers_the_rest():
    config = kb.BenchConfig(peers=())
    points = kb.plan(config)
    tiers = [p[0] for p in points]
    assert tiers == sorted(tiers)
    first = points[0]
    assert first[1:] == ("cute:nonflush:nvfp4", "nemotron3-super", 16, 256, 8)
    assert {p[4] for p in points if p[0] == 1} == set(config.batches) - {256}
    assert {p[2] for p in points if p[0] == 2} == {"mamba2-2.7b"}
    counted = sum(len(kb.KERNELS[k].cursors(w)) for k in config.all_kernels() for w in (8, 16, 32))
    assert len(points) == counted * len(config.batches) * len(config.shapes)


def test_sets_rotate_past_the_l2():
    l2 = 60 * 2**20
    assert harness.sets_for(590_000, l2, 4.0) == math.ceil(4 * l2 / 590_000)
    assert harness.sets_for(2**31, l2, 4.0) == 4


def test_dequantize_nvfp4_follows_the_layout():
    """Low nibble = even k; value = E2M1 * E4M3 block scale * second-level scale."""
    # one slot, one head, one row of 16 elements: [slots, heads, headdim, dstate / 2]
    codes = torch.tensor([0x21, 0xF7] + [0] * 6, dtype=torch.uint8).view(1, 1, 1, 8)
    scales = torch.tensor([0x38], dtype=torch.uint8).view(1, 1, 1, 1)  # E4M3 1.0
    lo = {"lo": codes, "lo_scales": scales, "lo_global": torch.tensor([[0.5]])}
    values = cases.dequantize(lo, "nvfp4").flatten()
    assert values[:4].tolist() == [0.25, 0.5, 3.0, -3.0]
    assert values[4:].abs().sum() == 0


# --------------------------------------------------------------------------------------------
# vLLM adapters under the Triton interpreter

VLLM_SITE = REPO / ".peers" / "vllm" / "site"


@pytest.fixture
def interpreted_vllm(monkeypatch):
    """vLLM's Triton kernels on CPU tensors. Triton decides at decoration time whether to
    interpret, so the env var must be set before the vLLM modules are imported (they are
    imported fresh here). Triton 3.6's interpreter converts a 1-element index tensor with
    int(), which NumPy >= 2.4 refuses for 1-d arrays; the patch takes its one element."""
    if not VLLM_SITE.is_dir():
        pytest.skip("no .peers/vllm (run scripts/peers/prepare.sh vllm)")
    if torch.cuda.is_available():
        pytest.skip("the interpreter test is for CPU-only machines")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(peers, "_MODULES", {})
    return REPO / ".peers"


@pytest.mark.parametrize(
    "name", ["vllm:update:fp32", "vllm:update:fp16", "vllm:nonflush:fp32", "vllm:flush:fp32",
             "vllm:flush:fp16"])
def test_vllm_adapter_matches_the_reference_under_the_interpreter(interpreted_vllm, name):
    """Each vLLM kernel, given inputs in its own layout by the adapter, reproduces the lowprec
    reference on 3 slots at different cursors. fp16 activations: the interpreter emulates bf16
    by truncation and has no bf16 dot, which the GPU has."""
    ratio = cases.check_kernel(name, TINY, 8, "cpu", peers_dir=interpreted_vllm, act=torch.float16)
    assert ratio <= 1.0


def test_vllm_check_rejects_a_wrong_decay(interpreted_vllm, monkeypatch):
    """The check is not vacuous: the kernel fed A twice as large fails it."""
    tied = peers.tied

    def wrong(params, shape):
        return tied({**params, "A": params["A"] * 2}, shape)

    monkeypatch.setattr(peers, "tied", wrong)
    ratio = cases.check_kernel("vllm:nonflush:fp32", TINY, 8, "cpu", peers_dir=interpreted_vllm,
                            act=torch.float16)
    assert ratio > 1.0


def test_run_end_to_end_on_the_cpu_with_stand_in_timing(interpreted_vllm, monkeypatch, tmp_path):
    """run() on the CPU (vLLM and the emulation under the interpreter; the ceilings and the
    timer replaced): plan, checks, buffers over 4 sets, launches, rows, token rows, CSV."""
    monkeypatch.setitem(kb.SHAPES, "tiny", TINY)
    monkeypatch.setattr(harness, "measure_ceilings", lambda **_: dict(copy_gbps=4000.0,
                                                                      read_gbps=4200.0, note=""))
    launched = []

    def stand_in(launches, reset, reps, lead_cycles, warm_replays):
        assert lead_cycles == harness.LEAD_CYCLES  # the configuration's spin reaches the timing
        assert warm_replays == 5  # and its warm-up
        launches[-1]()  # the last set's views are valid too
        launched.append(len(launches))
        return [10.0 + len(launches)] * reps, "stand-in"

    monkeypatch.setattr(harness, "time_launches", stand_in)
    config = kb.BenchConfig(shapes=("tiny",), batches=(3,), windows=(8,),
                            kernels=("emulation:nonflush:nvfp4",), peers=("vllm",), reps=3,
                            l2_multiple=1e-6, device="cpu", act="fp16", warm_replays=5,
                            out=str(tmp_path / "run.csv"))
    frame = kb.run(config, log=lambda _: None)
    timed = frame[frame["step"] != "token"]
    assert (timed["status"] == "ok").all(), timed["status"].tolist()
    assert (timed["time_us"] == 14.0).all() and (timed["sets"] == 4).all()
    assert len(launched) == len(timed) == 3 + 1 + 1 + 3 + 1  # emulation, 4 vLLM kernels
    tokens = frame[frame["step"] == "token"].set_index("scheme")
    assert set(tokens.index) == {"vllm-replay-fp32", "vllm-conventional-fp32",
                                 "vllm-conventional-fp16"}
    assert tokens.loc["vllm-replay-fp32", "time_us"] == pytest.approx(14.0)
    assert len(kb.read_csv(tmp_path / "run.csv")) == len(frame)


def test_stream_read_reads_every_element_once(monkeypatch):
    """The read-ceiling kernel's partial sums add up to the sum of its input (interpreter)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter test is for CPU-only machines")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(sys.modules, "experiments._stream_read", raising=False)
    from experiments._stream_read import BLOCK, stream_read

    src = torch.rand(3 * BLOCK + 123, generator=torch.Generator().manual_seed(3))
    partial = torch.full((2,), float("nan"))
    stream_read(src, partial)
    assert partial.sum().item() == pytest.approx(src.sum().item(), rel=1e-5)


def test_emulation_adapter_matches_the_reference_under_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("the interpreter test is for CPU-only machines")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    assert cases.check_kernel("emulation:nonflush:nvfp4", TINY, 8, "cpu") <= 1.0


def test_gpu_identity_parses_nvidia_smi_and_records_failures():
    """The meta files' GPU identity: nvidia-smi's fields by name, and a failure (no
    nvidia-smi, a non-zero exit, a short line) recorded as an error instead of raised."""
    fields = harness.GPU_IDENTITY_FIELDS
    values = ["GPU-1234abcd", "1652023012345", "00000000:19:00.0", "96.00.A5.00.01",
              "580.159.04", "1980 MHz", "3201 MHz", "700.00 W", "Enabled"]
    assert len(values) == len(fields)
    calls = []

    def fake(query, **kwargs):
        calls.append(query)
        return subprocess.CompletedProcess(query, 0, stdout=", ".join(values) + "\n", stderr="")

    identity = harness.gpu_identity(fake)
    assert identity == dict(zip(fields, values, strict=True))
    assert calls[0][0] == "nvidia-smi" and "--id=0" in calls[0]
    assert calls[0][1] == "--query-gpu=" + ",".join(fields)

    def short(query, **kwargs):
        return subprocess.CompletedProcess(query, 0, stdout="GPU-1, 17\n", stderr="")

    def failing(query, **kwargs):
        return subprocess.CompletedProcess(query, 9, stdout="", stderr="no devices were found")

    def missing(query, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    assert "exit 0" in harness.gpu_identity(short)["error"]
    assert "no devices were found" in harness.gpu_identity(failing)["error"]
    assert harness.gpu_identity(missing)["error"].startswith("FileNotFoundError")


def test_a_point_whose_timed_replays_still_settle_is_noted():
    """settling_note flags timed replays whose first half is more than 2% slower than their
    second (a warm-up too short for the machine), and is silent otherwise."""
    gen = torch.Generator().manual_seed(4)
    noise = (1 + 0.004 * torch.rand(20, generator=gen)).tolist()
    settled = [56.2 * n for n in noise]
    assert harness.settling_note(settled) == ""
    drifting = [59.6 * n for n in noise[:7]] + settled[7:]  # 7 slow of the first 10
    note = harness.settling_note(drifting)
    assert note.startswith("still settling: the first 10 timed replays ")
    assert note.endswith("% slower") and float(note.split()[-2].rstrip("%")) > 2.0
    assert harness.settling_note([60.0 * n for n in noise[:3]] + settled[3:]) == ""  # under 2%
    assert harness.settling_note([70.0, 56.0, 56.0]) == ""  # too few replays to tell


# --------------------------------------------------------------------------------------------
# reading a CSV back, outputs beside --out, figures a panel at a time


@pytest.mark.parametrize("defect, words", [
    (lambda f: f.drop(columns=["cursor"]), "missing cursor"),
    (lambda f: f.astype({"batch": str}).assign(batch=["x8"] + list(f["batch"].astype(str))[1:]),
     "line 2: column batch: expected an integer, got 'x8'"),
    (lambda f: f.astype({"time_us": object}).assign(
        time_us=list(f["time_us"])[:3] + ["fast"] + list(f["time_us"])[4:]),
     "line 5: column time_us: expected a float, got 'fast'"),
    (lambda f: pd.concat([f, f.iloc[[2]]], ignore_index=True),
     "line 23: repeats the point of line 4"),  # 21 rows, then the repeat
    (lambda f: f.assign(kernel=["cute:nonflush:fp64"] + list(f["kernel"])[1:]),
     "line 2: column kernel: unknown kernel 'cute:nonflush:fp64'"),
])
def test_a_csv_with_wrong_columns_types_or_repeated_points_is_refused_in_one_line(
        tmp_path, capsys, defect, words):
    """--plot-only and --merge refuse a CSV whose columns, cell types, kernel names or points
    are wrong, in one line naming the file and its line."""
    path = tmp_path / "bad.csv"
    defect(_synthetic_frame()).to_csv(path, index=False)
    for argv in (["--plot-only", str(path), "--plot-dir", "none"],
                 ["--merge", str(path), "--out", str(tmp_path / "m.csv"), "--plot-dir", "none"]):
        with pytest.raises(SystemExit) as exit_info:
            kb.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err and words in err, err
    assert not (tmp_path / "m.csv").exists()


def test_the_committed_csv_reads_back_unchanged():
    """results/kernel_bench.csv passes the reader's checks, token rows recomputed equal."""
    frame = kb.read_csv(REPO / "results" / "kernel_bench.csv")
    assert len(frame) > 1000 and set(frame["run"]) == {"A", "B"}
    again = kb.with_token_rows(frame)
    tokens = frame[frame["step"] == "token"].sort_values(kb.KEY).reset_index(drop=True)
    redone = again[again["step"] == "token"].sort_values(kb.KEY).reset_index(drop=True)
    assert tokens["time_us"].to_numpy() == pytest.approx(redone["time_us"].to_numpy(), rel=1e-9)


def test_merge_writes_its_pngs_beside_the_merged_csv_whatever_the_folder(tmp_path,
                                                                         monkeypatch):
    """--merge ... --out elsewhere/m.csv writes m.csv, its meta.json (the bytes read_csv
    checks) and its three PNGs in elsewhere/, and nothing in the current folder."""
    frame = _synthetic_frame()
    a = tmp_path / "a.csv"
    frame.to_csv(a, index=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "elsewhere" / "m.csv"
    assert kb.main(["--merge", str(a), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "m.csv", "m.meta.json", "m_formats.png", "m_speedup.png", "m_time.png"]
    assert list(cwd.iterdir()) == []
    kb.read_csv(out)


def test_every_panel_draws_at_most_six_series_and_names_them_outside_the_axes(tmp_path,
                                                                              monkeypatch):
    """The figures split the kernels, comparisons and schemes into panels of at most six
    lines each, and every legend sits right of its axes (outside the data)."""
    import matplotlib.pyplot as plt

    from experiments import kernel_bench_plots as plots

    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.append(fig) or path)
    monkeypatch.setattr(plt, "close", lambda fig: None)
    frame = _synthetic_frame()
    extra = frame[frame["kernel"] == "cute:nonflush:nvfp4"]
    for name in ("cute:nonflush:fp8_e4m3", "cute:nonflush:fp16", "cute:update:fp16",
                 "cute:update:fp16sr", "vllm:update:fp16"):
        spec = kb.KERNELS[name]
        part = frame[frame["kernel"] == ("cute:nonflush:nvfp4" if spec.step == "nonflush"
                                         else "cute:update:fp32")]
        extra = pd.concat([extra, part.assign(kernel=name, impl=spec.impl)])
    path = tmp_path / "k.csv"
    pd.concat([frame, extra[extra["kernel"] != "cute:nonflush:nvfp4"]]).to_csv(path,
                                                                                index=False)
    kb.plot(path, tmp_path)
    assert len(figures) == 3
    for fig in figures:
        for ax in fig.axes:
            data = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
            assert len(data) <= 6
            legend = ax.get_legend()
            if legend is not None:
                assert legend.get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1
            assert " us" not in ax.get_ylabel() and "issue" not in ax.get_title()


def test_plot_only_with_out_draws_beside_out_and_leaves_the_read_csv_alone(tmp_path, capsys):
    """--plot-only CSV --out X puts the PNGs in X's folder (not beside the CSV read, which
    may be the committed one); the CSV read keeps its bytes."""
    source = tmp_path / "in" / "bench.csv"
    source.parent.mkdir()
    _synthetic_frame().to_csv(source, index=False)
    before = source.read_bytes()
    out = tmp_path / "out" / "kb.csv"
    out.parent.mkdir()
    assert kb.main(["--plot-only", str(source), "--out", str(out)]) == 0
    capsys.readouterr()
    drawn = list(out.parent.iterdir())
    assert drawn and all(p.suffix == ".png" for p in drawn)
    assert [p.name for p in source.parent.iterdir()] == ["bench.csv"]
    assert source.read_bytes() == before
