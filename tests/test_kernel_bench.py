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


def test_bench_shapes_are_the_layers_of_lowprec_models():
    """The benchmarked shapes take their numbers and their recurrence from lowprec.models,
    under the same names: two Mamba-2 layers and Qwen3-Next's Gated DeltaNet layer (32 value
    heads of 128 x 128, 16 key heads)."""
    from lowprec import models

    assert list(kb.SHAPES) == ["nemotron3-super", "mamba2-2.7b", "qwen3-next-80b"]
    for name, shape in kb.SHAPES.items():
        assert shape.name == name
        assert shape.ssm == models.get(name).ssm
    m2 = kb.SHAPES["mamba2-2.7b"]
    assert (m2.nheads, m2.headdim, m2.dstate, m2.ngroups, m2.kind) == (80, 64, 128, 1, "mamba2")
    assert "state-spaces/mamba2-2.7b" in m2.source
    qwen = kb.SHAPES["qwen3-next-80b"]
    assert (qwen.nheads, qwen.headdim, qwen.dstate, qwen.ngroups, qwen.kind) == (
        32, 128, 128, 16, "gdn")


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
        # the shape decides the recurrence: a kernel none of the shapes has is refused by name
        (["--shapes", "qwen3-next-80b", "--kernels", "cute:nonflush:fp8_e4m3"],
         "kernels: cute:nonflush:fp8_e4m3 has no Gated DeltaNet form (shape qwen3-next-80b; "
         "it is a Mamba-2 kernel)"),
        (["--shapes", "nemotron3-super,mamba2-2.7b", "--kernels", "cute:update:bf16"],
         "kernels: cute:update:bf16 has no Mamba-2 form (shape nemotron3-super; it is a Gated "
         "DeltaNet kernel)"),
        (["--shapes", "mamba2-2.7b", "--kernels", "fla:update:fp32"],
         "kernels: fla:update:fp32 has no Mamba-2 form"),
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
    `fp16sr<k>r<R>` (parsed back to (k, R); the bare `fp16sr` is the default (16, 7), the
    reference 32/10 is `fp16sr32r10`), schemes that price a token with them, and the default
    kernels' byte counts (the copies' formats are the same)."""
    assert (32, 10) in cases.SR_SETTINGS and (16, 7) not in cases.SR_SETTINGS
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
        assert cases.sr_setting(variant) == (16, 7)
    assert cases.sr_setting("fp16sr32r10+nvfp4") == (32, 10)
    assert cases.sr_variant((16, 7)) == "fp16sr" and cases.sr_variant((13, 4)) == "fp16sr13r4"
    assert cases.sr_variant((32, 10)) == "fp16sr32r10"


@pytest.mark.parametrize("name, setting", [
    ("cute:flush:fp16sr32r10+nvfp4", (32, 10)), ("cute:update:fp16sr8r4", (8, 4)),
    ("cute:flush:fp16sr+nvfp4", (16, 7)), ("cute:update:fp16sr", (16, 7)),
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


def _timed_row(run, kernel, shape, batch, cursor, us) -> dict:
    """A passing row of ``kernel`` timed at ``us`` (p10/p90 at -/+10 %), window 16, its bytes
    from `kernel_bytes` and its fractions of 4,000 GB/s copy and 4,200 GB/s read."""
    spec = kb.KERNELS[kernel]
    nbytes = kb.kernel_bytes(spec, shape, batch, cursor)
    gbps = nbytes / us / 1e3
    return dict(
        run=run, kernel=kernel, impl=spec.impl, step=spec.step, scheme="",
        shape=shape.name, batch=batch, window=16, cursor=cursor, time_us=us,
        time_us_p10=0.9 * us, time_us_p90=1.1 * us, bytes=nbytes, gbps=gbps,
        frac_copy=gbps / 4000, frac_read=gbps / 4200, copy_gbps=4000.0, read_gbps=4200.0,
        check=0.1, status="ok", sets=8, timing="graph", note="")


def _synthetic_frame() -> pd.DataFrame:
    """Timed rows at L = 16 for two batches: non-flush steps at cursors 0, 8, 14 taking
    1 + cursor/8 (nvfp4) or 4 * (1 + cursor/8) us (fp32), flushes 20 and 40 us, updates 30 us;
    batch 256 times are those x 100."""
    rows = []
    shape = kb.SHAPES["nemotron3-super"]

    def add(kernel, batch, cursor, us):
        rows.append(_timed_row("h100", kernel, shape, batch, cursor, us))

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
    """Tier 0 is the first shape's headline point; each kernel is planned at the shapes whose
    recurrence has it, at every batch, window and timed cursor."""
    config = kb.BenchConfig(peers=())
    points = kb.plan(config)
    tiers = [p[0] for p in points]
    assert tiers == sorted(tiers)
    first = points[0]
    assert first[1:] == ("cute:nonflush:nvfp4", "nemotron3-super", 16, 256, 8)
    assert {p[4] for p in points if p[0] == 1} == set(config.batches) - {256}
    assert {p[2] for p in points if p[0] == 2} == {"mamba2-2.7b", "qwen3-next-80b"}
    counted = sum(len(kb.KERNELS[k].cursors(w)) for s in config.shapes
                  for k in config.all_kernels() for w in (8, 16, 32)
                  if kb.SHAPES[s].kind in kb.KERNELS[k].recurrences)
    assert len(points) == counted * len(config.batches)
    assert {p[1] for p in points if p[2] == "qwen3-next-80b"} == {
        "cute:nonflush:nvfp4", "cute:nonflush:fp32", "cute:flush:fp16sr+nvfp4",
        "cute:flush:fp32", "cute:update:fp32", "cute:update:bf16"}


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


def _interpret_afresh(monkeypatch, packages) -> None:
    """Triton's interpreter for the peers' kernels on CPU tensors. Triton decides at decoration
    time whether to interpret, so the env var must be set before the peers' modules are
    imported (`packages` are imported afresh). Triton 3.6's interpreter converts a 1-element
    index tensor with int(), which NumPy >= 2.4 refuses for 1-d arrays; the patch takes its
    one element."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(peers, "_MODULES", {})


@pytest.fixture
def interpreted_vllm(monkeypatch):
    """vLLM's Triton kernels on CPU tensors (`_interpret_afresh`)."""
    if not VLLM_SITE.is_dir():
        pytest.skip("no .peers/vllm (run scripts/peers/prepare.sh vllm)")
    if torch.cuda.is_available():
        pytest.skip("the interpreter test is for CPU-only machines")
    _interpret_afresh(monkeypatch, ("vllm",))
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


# --------------------------------------------------------------------------------------------
# Gated DeltaNet: the qwen3-next-80b shape builds the GDN kernels of the same names

# An odd GDN head the CuTe kernels take (d_k 128, d_v a multiple of 16): 6 value heads of
# 48 x 128, 3 key heads (2 value heads each).
TINY_GDN = kb.BenchShape("tiny-gdn", nheads=6, headdim=48, dstate=128, ngroups=3, source="test",
                         kind="gdn")
GDN_CUTE = ("cute:nonflush:nvfp4", "cute:nonflush:fp32", "cute:flush:fp16sr+nvfp4",
            "cute:flush:fp32", "cute:update:fp32", "cute:update:bf16")
GDN_PEERS = ("vllm:update:fp32", "vllm:update:bf16", "fla:update:fp32", "fla:update:bf16")


def test_qwen3_next_alone_times_the_gdn_kernels_and_their_peers():
    """--shapes qwen3-next-80b: the six CuTe GDN kernels by default, the GDN peers' four, 21
    (batch, window) points each (a non-flush step at three cursors), the headline first;
    --list-kernels says which recurrences each kernel has."""
    config = kb.config_from_args(kb.build_parser().parse_args(["--shapes", "qwen3-next-80b"]))
    assert config.kernels == GDN_CUTE
    assert set(config.all_kernels()) == set(GDN_CUTE + GDN_PEERS)
    points = kb.plan(config)
    assert points[0][1:] == ("cute:nonflush:nvfp4", "qwen3-next-80b", 16, 256, 8)
    assert len(points) == 7 * 3 * (3 + 3 + 1 + 1 + 1 + 1 + 4)
    everything = kb.config_from_args(kb.build_parser().parse_args(
        ["--shapes", "qwen3-next-80b", "--kernels", "all"]))
    assert set(everything.kernels) == set(GDN_CUTE + GDN_PEERS)
    assert kb.BenchConfig().peers == ("vllm", "flashinfer", "fla")


def test_list_kernels_names_each_kernels_recurrences(capsys):
    assert kb.main(["--list-kernels"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["cute:nonflush:nvfp4"].endswith("default   Mamba-2, Gated DeltaNet")
    assert lines["cute:nonflush:fp8_e4m3"].endswith("Mamba-2")
    assert lines["fla:update:bf16"].endswith("default   Gated DeltaNet")


@pytest.mark.parametrize("call", [
    lambda: kb.kernel_bytes("cute:update:fp16sr", TINY_GDN, 1, 0),
    lambda: cases.build_case("flashinfer:update:fp32", TINY_GDN, 1, 8, 0, 1, "cpu"),
    lambda: cases.check_kernel("cute:nonflush:fp16", TINY_GDN, 8, "cpu"),
    lambda: kb.kernel_bytes("fla:update:fp32", TINY, 1, 0),
])
def test_a_kernel_the_shapes_recurrence_lacks_is_refused_by_name(call):
    """Bytes, cases and checks of a kernel without a form for the shape's recurrence raise a
    ValueError naming the kernel, the shape and the recurrence's kernels."""
    with pytest.raises(ValueError, match=r"^kernel: \S+ has no (Gated DeltaNet|Mamba-2) form "
                                         r"\(shape tiny(-gdn)?; it is a .* kernel\); the .* "
                                         r"kernels are cute:nonflush:nvfp4, "):
        call()


# Hand counts at TINY_GDN, bf16 activations, per slot (module docstring of gdn_cases):
GDN_STATE = {"fp32": 6 * 48 * 128 * 4, "bf16": 6 * 48 * 128 * 2, "fp16": 6 * 48 * 128 * 2,
             # codes (two a byte) + one E4M3 byte per 16 + one fp32 per head
             "nvfp4": 6 * (48 * 128 // 2 + 48 * 128 // 16 + 4)}
NONFLUSH_RECORD = 6 * (48 * 4 + 128 * 2 + 4)  # u fp32, k bf16, g fp32: 452 a head
APPEND = 6 * (48 * 4 + (48 + 128) * 2 + 8)  # u, v, k, g, beta: 552 a head
FLUSH_RECORD = 6 * ((48 + 128) * 2 + 8)  # v, k, g, beta: 360 a head
KIT_TOKEN = 6 * (2 * 128 * 2 + 2 * 48 * 2 + 8)  # q, k per value head; v, y; g, beta fp32
FLA_TOKEN = 3 * 2 * 128 * 2 + 6 * (2 * 48 * 2 + 8)  # q, k per key head; v, y; g, beta fp32
VLLM_TOKEN = 3 * 2 * 128 * 2 + 6 * (2 * 48 * 2 + 2 * 2)  # ...; the raw gates a, b in bf16


@pytest.mark.parametrize("name, cursor, per_slot", [
    ("cute:nonflush:nvfp4", 5, GDN_STATE["nvfp4"] + 5 * NONFLUSH_RECORD + APPEND + KIT_TOKEN),
    ("cute:nonflush:fp32", 5, GDN_STATE["fp32"] + 5 * NONFLUSH_RECORD + APPEND + KIT_TOKEN),
    ("cute:flush:fp16sr+nvfp4", 7,
     2 * GDN_STATE["fp16"] + GDN_STATE["nvfp4"] + 8 * FLUSH_RECORD + KIT_TOKEN),
    ("cute:flush:fp32", 7, 2 * GDN_STATE["fp32"] + 8 * FLUSH_RECORD + KIT_TOKEN),
    ("cute:update:bf16", 0, 2 * GDN_STATE["bf16"] + KIT_TOKEN),
    ("vllm:update:bf16", 0, 2 * GDN_STATE["bf16"] + VLLM_TOKEN),
    ("fla:update:fp32", 0, 2 * GDN_STATE["fp32"] + FLA_TOKEN),
    ("fla:update:bf16", 0, GDN_STATE["bf16"] + GDN_STATE["fp32"] + FLA_TOKEN),  # fp32 out
])
def test_gdn_kernel_bytes_equal_a_hand_count(name, cursor, per_slot):
    """GDN bytes at an odd head (6 value heads of 48 x 128, 3 key heads), batch 3: the state
    copies in their formats, the ring records the step reads and appends, the token's
    inputs and output in each kernel's own layout."""
    assert kb.kernel_bytes(name, TINY_GDN, batch=3, cursor=cursor) == 3 * per_slot


@pytest.mark.parametrize("shape", [TINY_GDN, kb.SHAPES["qwen3-next-80b"]], ids=["odd", "qwen"])
def test_gdn_kernel_bytes_are_the_cute_kernels_own_counts(shape):
    """For every CuTe GDN kernel, at every cursor of windows 8 and 32, the benchmark's bytes
    equal the kernel module's `traffic_bytes`."""
    pytest.importorskip("cutlass")
    from cute_kernels import gdn_replay_flush as gf
    from cute_kernels import gdn_replay_output as go
    from cute_kernels import gdn_state_update as gu

    H, V, K = shape.nheads, shape.headdim, shape.dstate
    for window in (8, 32):
        for cursor in range(window - 1):
            for lo in ("nvfp4", "fp32"):
                own = go.traffic_bytes("none" if lo == "fp32" else lo, "bf16", 5, H, V, K,
                                       cursor)
                assert kb.kernel_bytes(f"cute:nonflush:{lo}", shape, 5, cursor) == own
        for name, hi, lo in (("cute:flush:fp16sr+nvfp4", "fp16", "nvfp4"),
                             ("cute:flush:fp32", "fp32", "none")):
            own = gf.traffic_bytes(hi, lo, "bf16", 5, H, V, K, window)
            assert kb.kernel_bytes(name, shape, 5, window - 1) == own
    for fmt in ("fp32", "bf16"):
        own = gu.traffic_bytes(fmt, "bf16", 5, H, V, K)
        assert kb.kernel_bytes(f"cute:update:{fmt}", shape, 5, 0) == own


def _gdn_frame() -> pd.DataFrame:
    """Timed GDN rows at L = 16, batches 1 and 256: non-flush steps 1 + cursor/8 us, the flush
    20 us, the kit's updates 30 (fp32) and 16 (bf16) us, vLLM's 32 and 17, FLA's 35 and 25;
    batch 256 times are those x 100."""
    rows = []
    shape = kb.SHAPES["qwen3-next-80b"]

    def add(kernel, batch, cursor, us):
        rows.append(_timed_row("h200", kernel, shape, batch, cursor, us))

    for batch, scale in ((1, 1.0), (256, 100.0)):
        for cursor in (0, 8, 14):
            add("cute:nonflush:nvfp4", batch, cursor, scale * (1 + cursor / 8))
        add("cute:flush:fp16sr+nvfp4", batch, 15, scale * 20.0)
        for kernel, us in (("cute:update:fp32", 30.0), ("cute:update:bf16", 16.0),
                           ("vllm:update:fp32", 32.0), ("vllm:update:bf16", 17.0),
                           ("fla:update:fp32", 35.0), ("fla:update:bf16", 25.0)):
            add(kernel, batch, 0, scale * us)
    return pd.DataFrame(rows, columns=kb.COLUMNS)


def test_gdn_token_rows_and_goals_against_the_fastest_peer():
    """A GDN window costs ((L-1) mean non-flush + flush) / L per committed token, as Mamba-2's;
    the GDN goals compare it with the fastest peer's fp32 and bf16 states at batch 256 and
    with the fastest peer of all at batch 1 (here vLLM's every time)."""
    frame = kb.with_token_rows(_gdn_frame())
    tokens = frame[frame["step"] == "token"].set_index(["scheme", "batch"])
    two = (15 * (1 + 7 / 8) + 20.0) / 16
    assert tokens.loc[("two-precision", 1), "time_us"] == pytest.approx(two, rel=1e-12)
    shape = kb.SHAPES["qwen3-next-80b"]
    window_bytes = (sum(kb.kernel_bytes("cute:nonflush:nvfp4", shape, 1, c) for c in range(15))
                    + kb.kernel_bytes("cute:flush:fp16sr+nvfp4", shape, 1, 15))
    assert tokens.loc[("two-precision", 1), "bytes"] == pytest.approx(window_bytes / 16)
    assert tokens.loc[("fla-conventional-bf16", 256), "time_us"] == 2500.0
    summary = kb.summarize(frame, "qwen3-next-80b").set_index("comparison")
    assert summary["goal"].tolist() == [0.85, 5.0, 2.5, 1.0]
    assert summary["achieved"].iloc[1:].tolist() == pytest.approx([32 / two, 17 / two, 17 / two])
    assert summary["met"].tolist() == [False, True, True, True]
    text = kb.format_summary(frame)
    assert "goals (qwen3-next-80b, Gated DeltaNet, batch 256, L = 16):" in text
    assert "goals (nemotron3-super" not in text
    both = pd.concat([_synthetic_frame(), _gdn_frame()], ignore_index=True)
    text = kb.format_summary(kb.with_token_rows(both))
    assert text.index("goals (nemotron3-super") < text.index("goals (qwen3-next-80b")


@pytest.mark.slow
def test_plots_draw_a_mamba2_and_a_gdn_shape_side_by_side(tmp_path):
    """A CSV of both recurrences plots into the three figures, one column per shape, each
    panel at most six series (the GDN kernels, schemes and comparisons have their facets)."""
    import matplotlib.pyplot as plt

    from experiments import kernel_bench_plots as plots

    path = tmp_path / "both.csv"
    pd.concat([_synthetic_frame(), _gdn_frame()], ignore_index=True).to_csv(path, index=False)
    figures = []
    save = plots.save_figure
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots, "save_figure", lambda fig, p: figures.append(fig) or save(fig, p))
        patch.setattr(plt, "close", lambda fig: None)
        paths = kb.plot(path, tmp_path)
    assert [p.name for p in paths] == ["both_time.png", "both_speedup.png", "both_formats.png"]
    for fig in figures:
        assert fig.axes[0].get_gridspec().ncols == 2
        for ax in fig.axes:
            assert len([line for line in ax.get_lines() if line.get_ls() != ":"
                        and line.get_color() != "black"]) <= 6
        titles = " ".join(ax.get_title() for ax in fig.axes)
        assert "qwen3-next-80b" in titles and "nemotron3-super" in titles


@pytest.mark.parametrize("batches, width, upright", [
    ([1, 8, 32, 64, 128, 256, 512], 6.0, False),  # an octave is over half an inch
    ([1, 256, 512], 2.0, True),  # 256 and 512 beside each other
])
def test_batch_labels_turn_upright_only_where_they_would_overlap(batches, width, upright):
    import matplotlib.pyplot as plt

    from experiments import kernel_bench_plots as plots

    fig, ax = plt.subplots(figsize=(width, 2.0))
    ax.set_xscale("log")
    plots._batch_ticks(ax, batches)
    fig.canvas.draw()
    labels = ax.get_xticklabels()
    assert [t.get_text() for t in labels] == [str(b) for b in batches]
    assert {t.get_rotation() for t in labels} == {90.0 if upright else 0.0}
    plt.close(fig)


def test_gdn_cute_cases_pass_every_check_of_the_kernels_but_the_device_one():
    """Each CuTe GDN case's caches and token tensors, built on the CPU, pass every check the
    public function makes (shapes, dtypes, strides, the cache's pairing, no aliasing); the
    last check refuses the CPU device by name."""
    pytest.importorskip("cutlass")
    for name in GDN_CUTE:
        spec = kb.KERNELS[name]
        case = cases.build_case(spec, TINY_GDN, 3, 8, cases.check_cursors(spec, 8), 2, "cpu")
        field = "cache.state" if spec.step == "update" else "cache.hi"
        for launch in case.launchers():
            with pytest.raises(ValueError, match=f"^{field}: expected a CUDA tensor"):
                launch()


class EmulatedCute:
    """The CuTe GDN replay functions' stand-in on the CPU: the packed cache mirrored into the
    Triton emulation's (fp32 containers, interpreted; the single FP32 copy as an fp32 read
    copy), stepped there, and what the step writes copied back: y, the ring, the counters,
    the fp32 recurrence copy. `wrong_decay` multiplies g on its way to the emulation."""

    def __init__(self, wrong_decay: float = 1.0):
        self.wrong_decay = wrong_decay

    def step(self, cache, q, k, v, g, beta, *, out):
        from emulation.gdn_replay_decode import GDNReplayCache, gdn_replay_decode

        packed = dict(lo=cache.lo, lo_scales=cache.lo_scales, lo_global=cache.lo_global)
        single = cache.lo_format == "none"
        twin = GDNReplayCache(
            hi=cache.hi.float().clone(),
            lo=cache.hi.float().clone() if single else cases.dequantize(packed, "nvfp4").float(),
            lo_scales=None if single else cache.lo_scales.view(torch.float8_e4m3fn).float(),
            lo_global=None if single else cache.lo_global.clone(),
            **{n: getattr(cache, n).clone() for n in ("ring_u", "ring_v", "ring_k", "ring_g",
                                                     "ring_beta", "cursors", "flushes")},
            hi_format="fp32" if single else "fp16", hi_rounding=cache.hi_rounding,
            lo_format="fp32" if single else "nvfp4", window=cache.window, seed=cache.seed)
        gdn_replay_decode(twin, q, k, v, g * self.wrong_decay, beta, out=out)
        for name in ("ring_u", "ring_v", "ring_k", "ring_g", "ring_beta", "cursors", "flushes"):
            getattr(cache, name).copy_(getattr(twin, name))
        if single:
            cache.hi.copy_(twin.hi)

    gdn_replay_output = step
    gdn_replay_flush = step


@pytest.mark.parametrize("name, wrong_decay, passes", [
    ("cute:nonflush:nvfp4", 1.0, True),
    ("cute:nonflush:fp32", 1.0, True),
    ("cute:flush:fp32", 1.0, True),
    ("cute:nonflush:nvfp4", 1.5, False),
    ("cute:flush:fp32", 1.5, False),
])
def test_gdn_replay_check_passes_the_emulation_and_fails_a_wrong_decay(monkeypatch, name,
                                                                       wrong_decay, passes):
    """The check of a CuTe GDN replay step, run on the Triton emulation in the kernels' place
    (an implementation of its own, checked against lowprec by its tests), passes, from the
    NVFP4 read copy, the single fp32 copy, and through the flush's fold; the same steps fed
    g x 1.5 fail it."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter test is for CPU-only machines")
    pytest.importorskip("cutlass")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from experiments import gdn_cases

    real = gdn_cases.cute
    stand_in = EmulatedCute(wrong_decay)
    monkeypatch.setattr(gdn_cases, "cute",
                        lambda module: stand_in if module == "gdn_replay_decode" else real(module))
    ratio = cases.check_kernel(name, TINY_GDN, 8, "cpu", act=torch.float16)
    assert (ratio <= 1.0) == passes, ratio


FLA_SITE = REPO / ".peers" / "fla" / "site"
PEER_SITES = {"fla": FLA_SITE, "vllm": VLLM_SITE}


@pytest.fixture
def interpreted_gdn_peers(monkeypatch):
    """FLA's and vLLM's GDN kernels on CPU tensors (`_interpret_afresh`). vLLM's vendored
    op.py binds `exp = tl.exp` at import, a function object the interpreter does not swap for
    its own ('Did you forget to add @triton.jit ?'): a function that looks `tl.exp` up when
    called, by when the interpreter has patched triton.language, stands in for it here
    (compiled, the alias is fine)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter test is for CPU-only machines")
    _interpret_afresh(monkeypatch, ("vllm", "fla"))
    if VLLM_SITE.is_dir():
        import triton.language as tl

        monkeypatch.syspath_prepend(str(VLLM_SITE))
        from vllm.third_party.flash_linear_attention.ops import fused_recurrent

        monkeypatch.setattr(fused_recurrent, "exp", lambda x: tl.exp(x))
    return REPO / ".peers"


def _need_peer(name: str) -> None:
    site = PEER_SITES[name.split(":")[0]]
    if not site.is_dir():
        pytest.skip(f"no {site.parent.relative_to(REPO)} (run scripts/peers/prepare.sh "
                    f"{site.parent.name})")


@pytest.mark.parametrize("name", GDN_PEERS)
def test_gdn_peer_adapter_matches_the_reference_under_the_interpreter(interpreted_gdn_peers,
                                                                       name):
    """Each GDN peer kernel, given its inputs in its own layout (q and k per key head; vLLM's
    packed mixed_qkv, raw gates and slot indices; FLA's [dk, dv] state and fp32 final state),
    reproduces lowprec.gdn on 3 slots. fp16 activations: the interpreter emulates bf16 by
    truncation."""
    _need_peer(name)
    ratio = cases.check_kernel(name, TINY_GDN, 8, "cpu", peers_dir=interpreted_gdn_peers,
                               act=torch.float16)
    assert ratio <= 1.0


@pytest.mark.parametrize("name, entry", [("fla:update:fp32", "fla"),
                                         ("vllm:update:bf16", "vllm-gdn")])
def test_gdn_peer_check_rejects_a_wrong_decay(interpreted_gdn_peers, monkeypatch, name, entry):
    """The check is not vacuous: the peer's kernel fed a decay 1.5 times as strong (FLA's g,
    vLLM's exp(A_log)) fails it."""
    _need_peer(name)
    real = peers.load(entry, interpreted_gdn_peers)

    def wrong(*args, **kwargs):
        if entry == "fla":
            kwargs["g"] = kwargs["g"] * 1.5
        else:
            kwargs["A_log"] = kwargs["A_log"] + math.log(1.5)
        return real(*args, **kwargs)

    monkeypatch.setitem(peers._MODULES, entry, wrong)
    ratio = cases.check_kernel(name, TINY_GDN, 8, "cpu", peers_dir=interpreted_gdn_peers,
                               act=torch.float16)
    assert ratio > 1.0


def test_a_missing_gdn_peer_is_unavailable_with_the_command_that_builds_it(tmp_path,
                                                                           monkeypatch):
    """Without .peers/fla the FLA kernels are recorded as unavailable, the reason naming the
    folder and the prepare.sh target (when no other fla package is importable)."""
    import importlib.util

    monkeypatch.setattr(peers, "_MODULES", {})
    monkeypatch.setattr(sys, "path", [p for p in sys.path if ".peers" not in p])
    for name in [m for m in sys.modules if m.split(".")[0] == "fla"]:
        monkeypatch.delitem(sys.modules, name)
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("an fla package is installed here")
    with pytest.raises(cases.Unavailable, match="run scripts/peers/prepare.sh fla"):
        cases.build_case("fla:update:bf16", TINY_GDN, 1, 8, 0, 1, "cpu", peers_dir=tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GDN_CUTE + GDN_PEERS)
@pytest.mark.parametrize("shape", [TINY_GDN, kb.SHAPES["qwen3-next-80b"]], ids=["odd", "qwen"])
def test_gdn_kernels_pass_the_benchmarks_check_and_time_on_the_gpu(name, shape):
    """Every GDN kernel of the benchmark passes its fp64 check at L = 8 and 16, and its case
    at batch 4 over 2 sets is timed by the harness (CUDA-graph replay for the kit's kernels)
    with positive times. A peer not built in .peers/ is skipped."""
    spec = kb.KERNELS[name]
    try:
        for window in (8, 16):
            ratio = cases.check_kernel(spec, shape, window, "cuda", peers_dir=REPO / ".peers")
            assert ratio <= 1.0, (window, ratio)
        case = cases.build_case(spec, shape, 4, 16, spec.cursors(16)[0], 2, "cuda",
                                peers_dir=REPO / ".peers")
    except cases.Unavailable as error:
        pytest.skip(str(error))
    times, method = harness.time_launches(case.launchers(), case.reset, reps=3, warm_replays=2)
    assert len(times) == 3 and min(times) > 0
    assert method == "graph" or spec.impl != "cute"


def test_gdn_run_end_to_end_on_the_cpu_with_stand_in_timing(interpreted_gdn_peers,
                                                             monkeypatch, tmp_path):
    """run() at a GDN shape on the CPU with the GDN peers alone (interpreted; the ceilings and
    the timer replaced): only their GDN kernels are planned, each checked, built over 4 sets
    whose launches all run, and priced per token. The peers take any head: 4 value heads of
    16 x 32, 2 key heads, to keep the interpreter quick."""
    for peer in ("fla", "vllm"):
        _need_peer(f"{peer}:update:fp32")
    small = kb.BenchShape("small-gdn", nheads=4, headdim=16, dstate=32, ngroups=2,
                          source="test", kind="gdn")
    monkeypatch.setitem(kb.SHAPES, "small-gdn", small)
    monkeypatch.setattr(harness, "measure_ceilings", lambda **_: dict(copy_gbps=4000.0,
                                                                      read_gbps=4200.0, note=""))

    def stand_in(launches, reset, reps, lead_cycles, warm_replays):
        for launch in launches:
            launch()
        return [20.0] * reps, "stand-in"

    monkeypatch.setattr(harness, "time_launches", stand_in)
    config = kb.BenchConfig(shapes=("small-gdn",), batches=(3,), windows=(8,), kernels=(),
                            peers=("vllm", "flashinfer", "fla"), reps=2, l2_multiple=1e-6,
                            device="cpu", act="fp16", out=str(tmp_path / "run.csv"),
                            peers_dir=str(interpreted_gdn_peers))
    frame = kb.run(config, log=lambda _: None)
    timed = frame[frame["step"] != "token"]
    assert sorted(timed["kernel"]) == sorted(GDN_PEERS)
    assert (timed["status"] == "ok").all(), timed["status"].tolist()
    assert (timed["sets"] == 4).all() and (timed["check"] <= 1.0).all()
    tokens = frame[frame["step"] == "token"].set_index("scheme")
    assert set(tokens.index) == {"vllm-conventional-fp32", "vllm-conventional-bf16",
                                 "fla-conventional-fp32", "fla-conventional-bf16"}
    assert tokens.loc["fla-conventional-bf16", "bytes"] == kb.kernel_bytes(
        "fla:update:bf16", small, 3, 0)
