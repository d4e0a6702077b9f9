"""The pipe model of `python -m tools.instruction_count --pipes`: counts by pipe add up,
the floor is the busiest limit, and the per-token budgets follow the window formula."""

import collections
import csv
import os

import pytest

from tools import instruction_count as ic


def test_pipe_counts_partition_every_instruction():
    """Every opcode lands in exactly one pipe (unknown ones in 'other'), per element."""
    ops = collections.Counter(
        {"LOP3": 70, "IMAD": 13, "FFMA": 9, "MUFU": 3, "LDG": 5, "HMMA": 2, "XYZW": 1}
    )
    p = ic.pipe_counts(ops, 7)
    parts = sum(p[k] for k in ("alu", "heavy", "fp32", "xu", "other"))
    assert p["total"] == pytest.approx(103 / 7)
    assert parts == pytest.approx(p["total"])
    assert p["alu"] == pytest.approx(10.0) and p["heavy"] == pytest.approx(13 / 7)
    assert p["other"] == pytest.approx(8 / 7)  # LDG, HMMA and the unknown opcode


@pytest.mark.parametrize(
    "ops, limit, cycles",
    [
        ({"LOP3": 11, "FFMA": 3}, "ALU pipe", 22.0),  # half-rate ALU beats 14 issued
        ({"IMAD": 9, "FFMA": 5, "LDG": 1}, "FMA heavy", 18.0),
        ({"IMAD": 3, "FFMA": 13, "LOP3": 1}, "issue", 17.0),  # heavy + fp32 = 16 < 17 issued
        ({"IMAD": 5, "FFMA": 13, "LOP3": 1}, "issue", 19.0),
        ({"MUFU": 5, "LDG": 2}, "XU", 20.0),
    ],
)
def test_issue_floor_is_the_busiest_limit(ops, limit, cycles):
    got, name = ic.issue_floor_cycles(ic.pipe_counts(collections.Counter(ops), 1))
    assert (name, got) == (limit, pytest.approx(cycles))


def test_floor_us_is_cycles_over_clock():
    """A sub-partition handles 32 elements per warp instruction: 132 SMs x 4 x 32 elements at
    one cycle each take one cycle, 1/1.98 ns."""
    assert ic.floor_us(1.0, 132 * 4 * 32) == pytest.approx(1 / 1980.0)
    assert ic.floor_us(3.0, 5 * 132 * 4 * 32, clock_ghz=1.5) == pytest.approx(15 / 1500.0)


def _row(run, kernel, step, scheme, time_us, nbytes, batch=256, shape="nemotron3-super"):
    return dict(run=run, kernel=kernel, step=step, scheme=scheme, shape=shape,
                batch=batch, window=16, cursor=-1, time_us=time_us, bytes=nbytes,
                copy_gbps=4000.0, status="ok")  # fmt: skip


def _write_rows(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_flush_budgets_follow_the_window_formula(tmp_path):
    """Budget = L R / g - (L T - F); the non-flush fraction needed spends what the flush at
    copy speed leaves. Checked on odd made-up times, one run complete, one without its
    reference (skipped), and rows of another batch ignored."""
    T, F, R32, Rrep = 97.3, 701.9, 541.7, 301.3
    flush_bytes, token_bytes = 1.3e9, 2.7e8
    rows = [
        _row("X", "cute:token:two-precision", "token", "two-precision", T, token_bytes),
        _row("X", "cute:flush:fp16sr+nvfp4", "flush", "", F, flush_bytes),
        _row("X", "cute:token:fp32-replay", "token", "fp32-replay", Rrep, 1e9),
        _row("X", "cute:token:conventional-fp32", "token", "conventional-fp32", R32, 2e9),
        _row("Y", "cute:token:two-precision", "token", "two-precision", 90.0, token_bytes),
        _row("Y", "cute:flush:fp16sr+nvfp4", "flush", "", 650.0, flush_bytes),
        _row("X", "cute:token:two-precision", "token", "two-precision", 3.0, 1.0, batch=8),
    ]
    path = tmp_path / "kb.csv"
    _write_rows(path, rows)
    got = {(b["run"], b["goal"]): b for b in ic.flush_budgets(str(path))}
    assert set(got) == {("X", 4.0), ("X", 7.5)}
    nonflush_us, nonflush_bytes = 16 * T - F, 16 * token_bytes - flush_bytes
    at_copy = flush_bytes / 4.0e6
    for goal, ref in ((4.0, Rrep), (7.5, R32)):
        b = got[("X", goal)]
        assert b["budget_us"] == pytest.approx(16 * ref / goal - nonflush_us)
        assert b["flush_at_copy_us"] == pytest.approx(at_copy)
        assert b["nonflush_frac"] == pytest.approx(nonflush_bytes / nonflush_us / 4.0e6)
        assert b["nonflush_frac_needed_at_copy"] == pytest.approx(
            nonflush_bytes / (16 * ref / goal - at_copy) / 4.0e6
        )


QWEN = "qwen3-next-80b"


def test_gdn_budgets_price_the_fastest_peer_of_each_state_dtype(tmp_path):
    """At the Qwen3-Next layer the goals are 5x and 2.5x the faster peer's FP32- and
    bf16-state token (here FLA's FP32 and vLLM's bf16); rows of the Mamba-2 layer are not
    read."""
    T, F = 101.7, 655.3
    rows = [
        _row("G", "cute:token:two-precision", "token", "two-precision", T, 2.1e8, shape=QWEN),
        _row("G", "cute:flush:fp16sr+nvfp4", "flush", "", F, 6.9e8, shape=QWEN),
        _row("G", "vllm:token:vllm-conventional-fp32", "token", "vllm-conventional-fp32",
             371.3, 1e9, shape=QWEN),
        _row("G", "fla:token:fla-conventional-fp32", "token", "fla-conventional-fp32", 353.9,
             1e9, shape=QWEN),
        _row("G", "vllm:token:vllm-conventional-bf16", "token", "vllm-conventional-bf16",
             183.1, 5e8, shape=QWEN),
        _row("G", "fla:token:fla-conventional-bf16", "token", "fla-conventional-bf16", 391.0,
             5e8, shape=QWEN),
        _row("G", "cute:token:two-precision", "token", "two-precision", 1.0, 1.0),
    ]
    path = tmp_path / "gdn.csv"
    _write_rows(path, rows)
    got = {b["goal"]: b for b in ic.flush_budgets(str(path), shape=QWEN)}
    assert set(got) == {5.0, 2.5}
    for goal, ref in ((5.0, 353.9), (2.5, 183.1)):
        assert got[goal]["budget_us"] == pytest.approx(16 * ref / goal - (16 * T - F))


_NCU_RAW = """==PROF== Disconnected from process 516
  kernel_cutlass_flush_like (128, 256, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
  gpu__time_duration.sum                                         us               753.66
  sm__inst_executed.avg.per_cycle_active                         inst/cycle         2.72
  sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active    %                 63.00
  sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active    %                 25.50
  sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active    %                 17.00
  sass__inst_executed_per_opcode                                                   474,053,271
                                                                                 (101,423,009;
  smsp__inst_executed.sum                                        inst        474,053,271
  kernel_cutlass_counter_like (2, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
  gpu__time_duration.sum                                         us                 2.27
  smsp__inst_executed.sum                                        inst                176
  void at::vectorized_elementwise_kernel<4, at::Add<int>>(int, T1) (1, 1, 1)x(128, 1, 1), Context 1
  gpu__time_duration.sum                                         us                 1.50
"""


def test_read_ncu_raw_keeps_each_launch_and_its_single_values(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(_NCU_RAW)
    first, second, third = ic.read_ncu_raw(str(path))
    assert first["grid"] == (128, 256, 1) and second["grid"] == (2, 1, 1)
    assert third["kernel"].startswith("void at::") and third["gpu__time_duration.sum"] == 1.5
    assert first["smsp__inst_executed.sum"] == 474053271
    assert first["sass__inst_executed_per_opcode"] == 474053271  # the total, not an instance
    assert second["gpu__time_duration.sum"] == pytest.approx(2.27)


def test_ncu_per_element_shares_follow_pipe_rates(tmp_path):
    """Instructions per element from the executed count; a pipe's share is its % of peak
    times its rate (ALU and LSU half a warp instruction a cycle, FMA one) over the issue rate
    of a sub-partition (2.72 / 4 = 0.68)."""
    path = tmp_path / "raw.txt"
    path.write_text(_NCU_RAW)
    k = ic.read_ncu_raw(str(path))[0]
    elements = 3 * 474053271  # any count: 32 / 3 instructions an element in all
    d = ic.ncu_per_element(k, elements)
    assert d["total"] == pytest.approx(32 / 3)
    assert d["issue_per_cycle"] == pytest.approx(0.68)
    assert d["alu"] == pytest.approx(32 / 3 * 0.63 * 0.5 / 0.68)
    assert d["fma"] == pytest.approx(32 / 3 * 0.255 / 0.68)
    assert d["lsu"] == pytest.approx(32 / 3 * 0.17 * 0.5 / 0.68)
    assert d["xu"] is None  # not in the report


def test_occupancy_is_read_where_the_report_has_it(tmp_path):
    """The Occupancy and Scheduler Statistics metrics of a launch become one line: active
    warps of the most an SM allows, the CTAs an SM each resource allows, a scheduler's active
    and eligible warps; a report without them prints none. Launch-wide metrics are read with
    their one instance in parentheses, as ncu prints them."""
    extra = ("  launch__occupancy_limit_registers              block                4 (4)\n"
             "  launch__occupancy_limit_shared_mem             block                5 (5)\n"
             "  sm__maximum_warps_avg_per_active_cycle         warp               32 (32)\n"
             "  sm__warps_active.avg.per_cycle_active          warp            30.49\n"
             "  smsp__warps_active.avg.per_cycle_active        warp             7.57\n"
             "  smsp__warps_eligible.avg.per_cycle_active      warp             1.74\n")
    path = tmp_path / "raw.txt"
    executed = "  smsp__inst_executed.sum"
    path.write_text(_NCU_RAW.replace(executed, extra + executed, 1))  # the first launch
    first, second, _ = ic.read_ncu_raw(str(path))
    assert ic.occupancy_line(first) == ("30.5 of 32 warps an SM active (CTAs an SM: registers 4, "
                                        "shared memory 5); a scheduler 7.57 active, 1.74 eligible")
    assert ic.occupancy_line(second) is None
    assert ic.occupancy_line({"smsp__warps_eligible.avg.per_cycle_active": 0.5}) == (
        "a scheduler 0.50 eligible")
    assert ic.occupancy_line({"sm__maximum_warps_avg_per_active_cycle": 16.0,
                              "launch__occupancy_limit_registers": 2.0}) == (
        "at most 16 warps an SM (CTAs an SM: registers 2)")


def test_nonflush_fraction_needed_grows_with_the_flush_and_is_inf_past_the_budget():
    b = {"window_budget_us": 1000.0, "nonflush_bytes": 3.1e9, "copy_bytes_per_us": 4.2e6}
    fast, slow = ic.nonflush_frac_needed(b, 300.0), ic.nonflush_frac_needed(b, 450.0)
    assert fast == pytest.approx(3.1e9 / 700.0 / 4.2e6) and slow > fast
    assert ic.nonflush_frac_needed(b, 1000.0) == float("inf")


def test_ncu_pipes_script_keeps_every_line_the_reader_needs():
    """`scripts/gpu.sh profile` trims ncu's report to the kernel headers and NCU_METRICS:
    every metric the reader uses survives its grep, and an instanced line of another metric
    does not (the trimmed file is what results/ keeps)."""
    import re
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu.sh"
    keep = re.search(r"^\s*keep='(.*)'$", script.read_text(), re.M)[1]
    pattern = re.compile(keep)  # grep -E's syntax, the same as Python's for this pattern
    for name in ic.NCU_METRICS + ic.OCCUPANCY_METRICS:
        assert pattern.search(f"  {name}          %          63.63"), name
    assert pattern.search("  kernel_x (128, 256, 1)x(256, 1, 1), Context 1, Stream 7")
    assert not pattern.search("  sass__inst_executed_per_opcode          474,053,271")
    assert not pattern.search("  sm__inst_executed_pipe_alu.max.pct_of_peak_sustained_active % 64")


@pytest.mark.parametrize("argv, message", [
    (["--ncu", "{tmp}/missing.txt"], "--ncu: no such file"),
    (["--pipes", "--csv", "{tmp}/missing.csv"], "--csv: no such file"),  # was skipped silently
    (["--csv", "{tmp}/missing.csv"], "--csv: only with --pipes"),  # was ignored
    # a CSV that is not kernel_bench's was a KeyError traceback
    (["--pipes", "--csv", "{tmp}/other.csv"], "is not a kernel_bench CSV (no column run, "),
    (["--pipes", "--with-fallbacks"], "--with-fallbacks: only for the default count"),  # ignored
    (["--ncu", "{tmp}/other.csv", "--with-fallbacks"], "--with-fallbacks: only"),
    (["--layer", "qwen3-next-80b"], "--layer: only with --ncu or --pipes"),
    (["--pipes", "--layer", "qwen3-next-80b", "--sr", "32:10"], "--sr: only for the Mamba-2"),
])
def test_bad_report_or_csv_paths_are_argument_errors(tmp_path, capsys, argv, message):
    """Checked before anything compiles: one line on stderr and exit status 2."""
    (tmp_path / "other.csv").write_text("shape,batch\nx,1\n")
    with pytest.raises(SystemExit) as exit_:
        ic.main([a.format(tmp=tmp_path) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_durations_are_read_in_microseconds_whatever_unit_ncu_prints(tmp_path):
    """ncu prints a long launch in ms and a short one in ns; the reader kept the number and
    dropped the unit, so a 1.21 ms flush read as 1.21 us and fell under the 10 us cut."""
    path = tmp_path / "raw.txt"
    path.write_text(_NCU_RAW.replace("us               753.66", "ms                 1.21")
                    .replace("us                 2.27", "nsecond          2,270"))
    first, second, _ = ic.read_ncu_raw(str(path))
    assert first["gpu__time_duration.sum"] == pytest.approx(1210.0)
    assert second["gpu__time_duration.sum"] == pytest.approx(2.27)
    assert [k["kernel"] for k in ic.ncu_launches(str(path))] == ["kernel_cutlass_flush_like"]
    path.write_text(_NCU_RAW.replace("us               753.66", "cycle          1,234"))
    with pytest.raises(ValueError, match="not a time unit"):
        ic.read_ncu_raw(str(path))


def test_the_issue_rate_comes_from_either_metric_and_a_missing_pipe_is_none(tmp_path):
    """scripts/ncu_flush_stages.sh keeps a sub-partition's issue-active fraction instead of
    an SM's executed rate: 0.68 either way, and the same shares; a pipe the report lacks is
    None (it was a TypeError when printed)."""
    path = tmp_path / "raw.txt"
    path.write_text(_NCU_RAW.replace(
        "sm__inst_executed.avg.per_cycle_active                         inst/cycle         2.72",
        "smsp__issue_active.avg.per_cycle_active                                           0.68"))
    k = ic.read_ncu_raw(str(path))[0]
    assert "sm__inst_executed.avg.per_cycle_active" not in k
    d = ic.ncu_per_element(k, 3 * 474053271)
    assert d["issue_per_cycle"] == pytest.approx(0.68)
    assert d["alu"] == pytest.approx(32 / 3 * 0.63 * 0.5 / 0.68) and d["xu"] is None
    del k["smsp__issue_active.avg.per_cycle_active"]
    with pytest.raises(ValueError, match="no sm__inst_executed.avg.per_cycle_active or smsp__"):
        ic.ncu_per_element(k, 1)


def test_two_real_flush_reports_read_their_issue_rates_and_executed_counts(capsys):
    """Two trimmed reports of scripts/ncu_flush_stages.sh (tests/data, the flush at batch 256
    with fp16 RN and no read copy, and fp16 SR + nvfp4) read as ncu printed them: the issue
    rate a sub-partition and the executed instructions per element."""
    from pathlib import Path

    data = Path(__file__).resolve().parent / "data"
    for tag, issue, executed in (("rn_none", 0.42, 164.5e6), ("sr_nvfp4", 0.65, 391.8e6)):
        assert ic.main(["--ncu", str(data / f"ncu_flush_{tag}.trim.txt")]) == 0
        out = capsys.readouterr().out
        assert f"issued {issue:.3f} a cycle" in out
        total = float(out.split("total")[1].split()[0])
        assert total == pytest.approx(executed * 32 / (256 * 128 * 64 * 128), abs=0.01)
    # the same report read as the Qwen3-Next layer's: a quarter of the elements a slot
    assert ic.main(["--ncu", str(data / "ncu_flush_sr_nvfp4.trim.txt"), "--layer",
                    "qwen3-next-80b"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-next-80b layer" in out
    total = float(out.split("total")[1].split()[0])
    assert total == pytest.approx(391.8e6 * 32 / (256 * 32 * 128 * 128), abs=0.01)


def test_a_gzipped_report_reads_as_the_plain_one(tmp_path):
    import gzip

    plain, packed = tmp_path / "raw.txt", tmp_path / "raw.txt.gz"
    plain.write_text(_NCU_RAW)
    with gzip.open(packed, "wt") as f:
        f.write(_NCU_RAW)
    assert ic.read_ncu_raw(str(packed)) == ic.read_ncu_raw(str(plain))


@pytest.mark.parametrize("text, argv, message", [
    (None, ["--ncu", "{tmp}"], "--ncu: {tmp} is a folder"),
    ("kernel,us\nx,1\n", ["--ncu", "{path}"], "no kernel header"),  # exit status 1 before
    (_NCU_RAW.replace("us               753.66", "us                 7.5"), ["--ncu", "{path}"],
     "no profiled launch over 10 us"),
    (_NCU_RAW.replace("  smsp__inst_executed.sum                                        inst"
                      "        474,053,271\n", ""), ["--ncu", "{path}"],
     "no smsp__inst_executed.sum"),  # a KeyError traceback before
    # the floor --pipes prices is the flush's; a non-flush report was taken for it
    (_NCU_RAW.replace("kernel_cutlass_flush_like", "kernel_cutlass_replay_outputReplayOutput"),
     ["--pipes", "--ncu", "{path}"], "--ncu with --pipes: the report's first launch is not"),
])
def test_a_file_that_is_not_a_usable_report_is_an_argument_error(tmp_path, capsys, text, argv,
                                                                  message):
    path = tmp_path / "report.txt"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        ic.main([a.format(tmp=tmp_path, path=path) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_ptxas_is_never_triton_s_too_old_one(tmp_path, monkeypatch):
    """Triton's wheel carries a ptxas older than CuTe DSL's PTX 8.8 needs: only its cuobjdump
    may stand in for a toolkit's."""
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # no toolkit there
    monkeypatch.setattr(ic.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match=r"ptxas not found \(set CUDA_HOME to a CUDA 12\.9\+"):
        ic._tool("ptxas")
    assert "toolkit" in ic.tools_problem() and not ic.tools_available()
    triton = pytest.importorskip("triton")
    assert ic._tool("cuobjdump").startswith(os.path.dirname(triton.__file__))


@pytest.mark.parametrize("pair", [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none")])
def test_the_counted_flush_is_the_one_mamba2_replay_flush_runs(pair):
    """The tool counts `rf.flush_config`'s choice for the Nemotron head: the public defaults
    (elements per thread, fold, the SR setting 16/7), not a hand-built configuration."""
    from cute_kernels import replay_flush as rf
    from lowprec import philox

    cfg = ic.flush_config(*pair)
    assert (cfg.hi_format, cfg.hi_rounding, cfg.lo_format) == pair
    assert (cfg.sr_bits, cfg.philox_rounds) == (philox.DEFAULT_SR_BITS,
                                                philox.DEFAULT_PHILOX_ROUNDS)
    assert (cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups, cfg.window) == (128, 64, 128, 8, 16)
    assert cfg.elements_per_thread == rf.default_elements_per_thread(64, 128, pair[0])
    assert cfg.has_D and cfg.has_dt_bias and not cfg.has_z and not cfg.has_debug


@pytest.mark.parametrize("lo_format", ["nvfp4", "fp32"])
def test_the_counted_nonflush_kernel_is_the_one_output_config_selects(lo_format):
    """At batch 3 (a cache small enough for the CPU) the tool's configuration equals what
    `ro.output_config` picks for a Nemotron-layer cache with the same token inputs."""
    import torch

    from cute_kernels import replay_output as ro
    from cute_kernels.cache import ReplayCache

    cache = ReplayCache.empty(3, 128, 64, 128, ngroups=8, window=16, lo_format=lo_format)
    x = torch.randn(3, 128, 64).to(torch.bfloat16)
    dt, per_head = torch.randn(3, 128), torch.randn(128)
    chosen = ro.output_config(cache, x, dt, D=per_head, dt_bias=per_head,
                              sm_count=ic._compile.H200_SM_COUNT)
    assert ic.nonflush_config(lo_format, batch=3) == chosen


@pytest.mark.parametrize("lo_format, hi", [("nvfp4", ("fp16", "sr")), ("none", ("fp32", "rn"))])
def test_the_counted_gdn_nonflush_kernel_is_the_one_a_decode_step_launches(lo_format, hi):
    """The tool's GDN configuration equals what `gdn_replay_decode` builds for a Qwen3-Next
    cache with bf16 inputs, as `launch_gdn_output` compiles it (RN, no debug output)."""
    import dataclasses

    from cute_kernels import gdn_cache as gc
    from cute_kernels import gdn_replay_flush as gf

    shape = ic.QWEN3_NEXT
    cache = gc.GDNReplayCache.empty(3, shape["nheads"], shape["dv"], shape["dk"],
                                    window=shape["window"], hi_format=hi[0], hi_rounding=hi[1],
                                    lo_format=lo_format)
    built = gf.config_of(cache, gc.check_gdn_cache(cache), "bf16")
    launched = dataclasses.replace(built, hi_rounding="rn", has_debug=False)
    assert ic.gdn_nonflush_config(lo_format) == launched


@pytest.mark.slow
def test_the_gdn_flush_fits_two_ctas_an_sm_without_spilling():
    """The GDN flush at the Qwen3-Next layer (256 threads, 64 fp32 state elements a thread)
    asks for two CTAs an SM and compiles to at most 128 registers with no local-memory
    traffic."""
    from cute_kernels import gdn_replay_flush as gf

    cfg = ic.gdn_flush_config()
    assert gf.min_ctas_per_sm(cfg) == 2
    ptx = gf.compile_gdn_flush(cfg, keep_ptx=True).__ptx__
    assert ".minnctapersm 2" in ptx
    if not ic.tools_available():
        pytest.skip(f"SASS counts: {ic.tools_problem()}")
    [(_, _, registers, _)] = ic.count_gdn_flush(formats=("nvfp4",))
    assert registers <= 128, registers
    ops, _ = ic.sass_histogram(ptx)
    assert not ops.get("LDL") and not ops.get("STL"), ops


@pytest.mark.slow
def test_the_gdn_tensor_core_dots_fit_eight_ctas_an_sm_with_fewer_instructions():
    """The non-flush step's forms at the Qwen3-Next layer keep the 64-register cap (FFMA:
    four 256-thread CTAs an SM, no local memory; mma: eight 128-thread CTAs, at most six
    local-memory loads and stores a thread: ptxas spills 12 bytes there), and a head's warps
    issue fewer instructions in the mma form (the decode and dots of 64 elements a stripe
    become 16 mma and a share of the B operands' staging)."""
    if not ic.tools_available():
        pytest.skip(f"SASS counts: {ic.tools_problem()}")
    from cute_kernels import gdn_replay_output as go

    cfg = ic.gdn_nonflush_config("nvfp4")
    histograms = {}
    for dots in go.DOTS:
        ops, registers = ic.sass_histogram(go.compile_gdn_output(cfg, keep_ptx=True,
                                                                 dots=dots).__ptx__)
        local = ops.get("LDL", 0) + ops.get("STL", 0)
        assert registers <= 64 and local <= (6 if dots == "mma" else 0), (dots, ops)
        assert go.min_ctas_per_sm(cfg, dots) == {"ffma": 4, "mma": 8}[dots]
        histograms[dots] = ops
    warps = {dots: go.cta_threads(cfg, dots) // 32 for dots in go.DOTS}
    counts = {dots: sum(ops.values()) * warps[dots] for dots, ops in histograms.items()}
    assert histograms["mma"]["HMMA"] == 16 * 2  # two stripes a warp
    assert counts["mma"] < 0.8 * counts["ffma"], counts
