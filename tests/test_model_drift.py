"""The model-drift harness: its exact arm against the model's parallel forward, exact formats
giving KL 0, the tie-aware agreement, the CSV reader, the Pareto figure, the command line, and
its policies as cells of experiments.sharding (one process, and two gloo ranks under torchrun:
about 30 s on a 2-core machine, marked slow)."""

import json
import math
from dataclasses import replace

import pytest
import torch
from torchrun import torchrun

from experiments import mamba2_lm as lm
from experiments import model_drift as md
from tests.test_mamba2_lm import logits_tolerance, rel_rms

# 2 layers of 2 heads of 16 x 32 (nvfp4 blocks of 16, mxfp4 of 32 fit), odd hidden size 16
TINY = dict(hidden_size=16, num_hidden_layers=2, num_heads=2, head_dim=16, state_size=32,
            chunk_size=8)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    lm.save(lm.Mamba2LM(lm.Mamba2Config(**TINY)).init_weights(11), folder, dtype=torch.float32)
    return folder


def config(model, preset="toy", **kw):
    """``md.PRESETS[preset]`` on ``model`` at test size (23 tokens of 2 segments, window 4, 4
    points an octave), then ``kw``."""
    base = replace(md.PRESETS[preset], model=str(model), tokens=23, segments=2, window=4,
                   per_octave=4, progress=False)
    return replace(base, **kw)


def test_exact_arm_reproduces_the_parallel_forward(tiny_model):
    """The harness's exact arm (fp64 model, Policy('exact') simulators, as
    `exact_state_logits` decodes it) gives the fp32 training forward's logits within the fp32
    tolerance of logits_tolerance (23 tokens, 2 segments of the committed held-out text)."""
    c = config(tiny_model)
    model64 = lm.load(c.model, dtype=torch.float64)
    keeper = md.ReferenceSSM(model64, [None], c)
    tokens = md.load_segments(c)[:, : c.tokens]
    decoder = lm.Decoder(model64, c.segments, keeper)
    exact = torch.stack([decoder.step(tokens[:, t]) for t in range(c.tokens)], 1)
    with torch.no_grad():
        parallel = lm.load(c.model)(tokens)
    tol = logits_tolerance(model64.config, c.tokens, torch.float32)
    assert rel_rms(parallel, exact) < tol
    _, _, reached, kept = md.exact_state_logits(c)
    assert reached == c.tokens and sorted(kept) == md.log_grid(c.tokens, c.per_octave)
    assert torch.equal(kept[c.tokens], exact[:, -1])


def test_exact_formats_give_kl_zero_exactly(tiny_model):
    """every_step, shared and separate_exact with the fp64 format round nothing: KL and dlogp
    are exactly 0 and top-1 agrees at every recorded position; an nvfp4 policy beside them
    does drift (KL > 0 somewhere)."""
    c = config(tiny_model, policies="every_step:fp64,shared:fp64,separate_exact:fp64,"
                                    "every_step:nvfp4")
    rows = md.run(c)
    assert len(rows) == 4 * 2 * len(md.log_grid(23, 4))
    for row in rows:
        kl, dlogp, agree = float(row[8]), float(row[9]), row[10]
        if row[3] == "fp64":
            assert (kl, dlogp, agree) == (0.0, 0.0, 1)
    assert max(float(r[8]) for r in rows if r[3] == "nvfp4") > 0


def test_top1_agreement_counts_ties_in_the_exact_logits():
    """Exact logits [1, 3, 3, 0] tie at indices 1 and 2: a policy whose argmax is 2 agrees, one
    whose argmax is 0 does not, and one tied at 0 and 1 (first index 0) does not. KL and dlogp
    against hand-computed values."""
    exact = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    policy = torch.tensor([[[1.0, 2.9, 3.1, 0.0]], [[4.0, 3.0, 3.0, 0.0]],
                           [[3.5, 3.5, 1.0, 0.0]]])
    target = torch.tensor([1])
    kl, dlogp, agree = md.token_metrics(exact, policy, target)
    assert agree.tolist() == [[True], [False], [False]]
    pe = torch.softmax(exact.double(), -1)[0]
    pp = torch.softmax(policy[0, 0].double(), -1)
    assert kl[0, 0].item() == pytest.approx((pe * (pe / pp).log()).sum().item(), rel=1e-12)
    assert dlogp[0, 0].item() == pytest.approx(math.log(pp[1] / pe[1]), rel=1e-12)


def test_token_metrics_are_zero_for_identical_logits():
    """The same logits give KL 0, dlogp 0 and agreement exactly, whatever the values."""
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(2))
    target = torch.tensor([0, 5, 16])
    kl, dlogp, agree = md.token_metrics(logits, logits[None].repeat(2, 1, 1), target)
    assert kl.eq(0).all() and dlogp.eq(0).all() and agree.all()


@pytest.mark.parametrize("content, message", [
    (None, "found none"),
    ("", "empty file"),
    ("a,b\n1,2\n", "expected the columns"),
    (",".join(md.CSV_COLUMNS) + "\n", "no rows"),
    (",".join(md.CSV_COLUMNS) + "\nm,mamba2,shared,nvfp4,rn,16,0,1,high,0,1\n",
     "kl: expected a number"),
], ids=["missing", "empty", "columns", "no-rows", "not-a-number"])
def test_csv_reader_refuses_bad_files_in_one_line(tmp_path, content, message):
    """A missing, empty, wrongly headed, row-less or non-numeric CSV is one ValueError line."""
    path = tmp_path / "drift.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        md.read_csv(path)
    assert "\n" not in str(err.value)


def test_a_drift_csv_cut_short_or_with_a_point_twice_is_refused_in_one_line(tmp_path):
    """A drift CSV cut mid-row (no line end after its last row) or with a row repeated is one
    ValueError line naming the file and the line; the whole file reads back typed."""
    import random

    rng = random.Random(7)
    rows = [("m", "mamba2", "shared", "fp8_e4m3", "sr", 16, s, p, f"{rng.random():.6e}",
             f"{rng.uniform(-1, 1):.6e}", rng.randint(0, 1)) for s in range(3) for p in (1, 5, 13)]
    path = tmp_path / "drift.csv"
    md.write_csv(path, rows)
    frame = md.read_csv(path)
    assert len(frame) == 9 and frame["position"].tolist()[:3] == [1, 5, 13]
    assert frame["kl"].iloc[4] == float(rows[4][8])
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])
    with pytest.raises(ValueError, match=r"drift\.csv \(model_drift CSV\): line 10: incomplete"
                       ) as err:
        md.read_csv(path)
    assert "\n" not in str(err.value)
    lines = whole.splitlines(keepends=True)
    path.write_bytes(b"".join(lines + [lines[3]]))
    with pytest.raises(ValueError, match="line 11: repeats the point of line 4") as err:
        md.read_csv(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_log_grid_holds_both_ends_and_thins_out():
    """1 and T are on the grid, positions increase, and the octave [T/2, T] holds at most
    per_octave + 1 of them, at most 8 * 17 + 1 in all (131,072 = 2^17 tokens, 8 a doubling;
    rounding merges the first ones)."""
    grid = md.log_grid(131_072, 8)
    assert grid[0] == 1 and grid[-1] == 131_072
    assert all(a < b for a, b in zip(grid, grid[1:], strict=False))
    assert sum(p >= 65_536 for p in grid) <= 9
    assert len(grid) <= 8 * 17 + 1 and len(set(grid)) == len(grid)


@pytest.mark.parametrize("text, message", [
    ("every_step", "ARM:FORMAT"), ("fastest:nvfp4", "expected an arm"),
    ("shared:fp7", "expected a format"), ("separate_fp16sr:nvfp4:sr", "expected rn"),
    ("shared:nvfp4,shared:nvfp4", "distinct"),
], ids=["no-format", "arm", "format", "separate-sr", "duplicate"])
def test_policies_refuse_bad_items(text, message):
    with pytest.raises(ValueError, match=message):
        md.parse_policies(text)


def test_cli_refuses_bad_input_in_one_line(capsys):
    """A non-positive --tokens, a bad policy and an absent CUDA device exit 2 with one line."""
    argvs = [["--tokens", "0"], ["--policies", "shared:fp7"]]
    if not torch.cuda.is_available():
        argvs.append(["--device", "cuda"])
    for argv in argvs:
        with pytest.raises(SystemExit) as err:
            md.parse_args(argv)
        assert err.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_run_refuses_a_missing_model_in_one_line(tmp_path, capsys):
    """--model pointing at an empty folder: exit 2, one line naming config.json."""
    assert md.main(["--model", str(tmp_path), "--tokens", "4", "--no-progress",
                    "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json" in err[0]


def test_csv_then_figure_then_pareto(tiny_model, tmp_path):
    """A run's CSV has the exact columns and reads back; its figure is drawn from it; the
    Pareto figure from it and the committed kernel_bench CSV places the two policies with a
    kernel time (fp16 RN conventional slower than the two-precision NVFP4 token)."""
    c = config(tiny_model, window=16, policies="every_step:fp16:rn,separate_fp16sr:nvfp4",
               out=str(tmp_path / "d.csv"), plot=str(tmp_path / "d.png"))
    md.write_csv(c.out, md.run(c))
    frame = md.read_csv(c.out)
    assert tuple(frame.columns) == md.CSV_COLUMNS
    md.plot(c.out, c.plot)
    assert (tmp_path / "d.png").stat().st_size > 0
    points = md.pareto(c.out, md.ROOT / "results" / "kernel_bench.csv", tmp_path / "p.png")
    times = {label: us for label, us, _, _ in points}
    assert times["every_step fp16 RN"] > times["separate_fp16sr nvfp4 RN"] > 0
    assert points[0][3]  # the fastest point is on the front


@pytest.mark.slow
def test_emulation_backend_follows_the_reference(tiny_model):
    """The Triton emulation (interpreter on the CPU; fp32 model) gives the reference's KL
    within a factor 2 where the reference KL is well above fp32's own noise, with the same
    Philox words (8 tokens, window 4, a conventional SR and a two-precision policy)."""
    policies = "every_step:fp8_e4m3:sr,separate_fp16sr:nvfp4"
    ref = md.run(config(tiny_model, tokens=8, policies=policies))
    emu = md.run(config(tiny_model, tokens=8, policies=policies, backend="emulation"))
    assert [r[:8] for r in ref] == [r[:8] for r in emu]
    for r, e in zip(ref, emu, strict=True):
        if float(r[8]) > 1e-9:
            assert 0.5 < float(e[8]) / float(r[8]) < 2.0, (r, e)


@pytest.mark.gpu
def test_cuda_graph_replay_gives_the_eager_rows(tiny_model):
    """On CUDA the graph path (chunks of 8 tokens) writes the same rows as eager decode,
    bit for bit (40 tokens: warm-up, four replays and an eager tail)."""
    c = config(tiny_model, tokens=40, backend="emulation", device="cuda",
               policies="every_step:nvfp4:sr,shared:fp8_e4m3,separate_fp16sr:mxfp4")
    assert md.run(replace(c, graph_tokens=8)) == md.run(replace(c, graph_tokens=0))


@pytest.mark.gpu
def test_emulation_fp32_policy_gives_kl_zero_on_cuda(tiny_model):
    """On CUDA, an every_step fp32 policy (the exact arm's own cache) gives KL 0 exactly."""
    c = config(tiny_model, tokens=40, backend="emulation", device="cuda",
               policies="every_step:fp32")
    assert all(float(r[8]) == 0.0 for r in md.run(c))


# --------------------------------------------------------------------------------------------
# cells: one process and several ranks (torchrun, gloo on the CPU)

CELL_POLICIES = "every_step:bf16:sr,shared:nvfp4,separate_fp16sr:mxfp4"


def cli(model, out, policies=CELL_POLICIES):
    return ["--model", str(model), "--tokens", "23", "--segments", "2", "--window", "4",
            "--per-octave", "4", "--policies", policies, "--no-progress", "--out", str(out)]


def test_a_policys_rows_do_not_depend_on_the_other_policies(tiny_model):
    """A cell decodes its policy alone against the process's exact arm: shared nvfp4 run
    beside two other policies gives the same rows, string for string, as run alone (SR draws
    included), and a fp64 control beside them stays at KL 0."""
    c = config(tiny_model, policies=CELL_POLICIES + ",every_step:fp64")
    together = md.run(c)
    alone = md.run(replace(c, policies="shared:nvfp4"))
    assert [r for r in together if r[2] == "shared"] == alone
    assert all(float(r[8]) == 0.0 for r in together if r[3] == "fp64")
    assert max(float(r[8]) for r in alone) > 0


def test_one_process_sweep_writes_the_rows_of_run_and_resumes(tiny_model, tmp_path, capsys,
                                                              monkeypatch):
    """The command's CSV is write_csv(run(config)) byte for byte, its meta.json records world
    size 1 and one cell a policy; a run whose second cell raises stops with exit 1 and keeps
    the first in <out>.cells, and the same command skips it and writes the same bytes."""
    out = tmp_path / "d.csv"
    assert md.main(cli(tiny_model, out)) == 0
    expected = tmp_path / "expected.csv"
    md.write_csv(expected, md.run(config(tiny_model, policies=CELL_POLICIES)))
    assert out.read_bytes() == expected.read_bytes()
    meta = json.loads((tmp_path / "d.meta.json").read_text())
    assert meta["sharding"]["world_size"] == 1 and meta["sharding"]["cells"] == 3
    assert meta["positions_reached"] == 23 and meta["config"]["device"] == "cpu"
    assert not (tmp_path / "d.csv.cells").exists()

    real = md.run_cell

    def second_fails(c, spec):
        if spec.arm == "shared":
            raise ValueError("a failing cell")
        return real(c, spec)

    resumed = tmp_path / "r.csv"
    monkeypatch.setattr(md, "run_cell", second_fails)
    capsys.readouterr()
    assert md.main(cli(tiny_model, resumed)) == 1
    assert "'shared:nvfp4:rn' failed" in capsys.readouterr().err and not resumed.exists()
    monkeypatch.setattr(md, "run_cell", real)
    assert md.main(cli(tiny_model, resumed)) == 0
    assert "resuming: skipping 1 of 3 cells" in capsys.readouterr().err
    assert resumed.read_bytes() == expected.read_bytes()


# ends the process at once (a killed rank) when the policy named by the environment starts
KILLER = """import os, sys
from experiments import model_drift as md
real = md.run_cell
def run_cell(c, spec):
    if md.cell_key(spec) == os.environ.get("KILL_CELL"):
        os._exit(3)
    return real(c, spec)
md.run_cell = run_cell
sys.exit(md.main(sys.argv[1:]))
"""


def _torchrun(tmp_path, argv, **env):
    """The command under torchrun with 2 CPU ranks (tests/torchrun.py); a hang fails the test
    through the timeout."""
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    return torchrun(script, list(argv), cwd=tmp_path, pythonpath=md.ROOT, timeout=240, **env)


@pytest.mark.slow
def test_two_ranks_write_the_one_process_bytes_and_a_killed_rank_resumes(tiny_model,
                                                                          tmp_path):
    """torchrun --nproc-per-node 2 (gloo, reference backend, 3 policies): the merged CSV is
    the single process's bytes and its meta.json records world size 2 and 2 + 1 cells; a
    rank killed when its second policy starts leaves its first in the store, and the same
    command skips it and writes the same bytes."""
    single = tmp_path / "single.csv"
    assert md.main(cli(tiny_model, single)) == 0
    sharded = tmp_path / "sharded.csv"
    done = _torchrun(tmp_path, cli(tiny_model, sharded))
    assert done.returncode == 0, done.stderr[-2000:]
    assert sharded.read_bytes() == single.read_bytes()
    record = json.loads((tmp_path / "sharded.meta.json").read_text())["sharding"]
    assert record["world_size"] == 2
    assert sorted(r["cells"] for r in record["ranks"]) == [1, 2]
    resumed = tmp_path / "resumed.csv"
    killed = _torchrun(tmp_path, cli(tiny_model, resumed), KILL_CELL="separate_fp16sr:mxfp4:rn")
    assert killed.returncode != 0 and not resumed.exists()
    rerun = _torchrun(tmp_path, cli(tiny_model, resumed))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resuming: skipping" in rerun.stderr
    assert resumed.read_bytes() == single.read_bytes()


def test_summary_gives_each_policys_growth_from_positions_1k_2k_to_the_last_octave(tmp_path):
    """``x 1k-2k`` is the last octave's mean KL over the mean at positions 1,025-2,048: a
    policy whose KL is 3x higher in the last octave reads 3.00, one flat with noise about 1,
    on a run of 8,192 positions whose other positions would give other ratios."""
    import numpy as np

    gen = np.random.default_rng(7)
    rows = []
    for arm, fmt, late in (("separate_fp16sr", "nvfp4", 3.0), ("shared", "fp8_e4m3", 1.0)):
        for segment in range(3):
            for position in (17, 300, 1100, 1500, 2000, 3000, 5000, 6000, 8192):
                base = 1e-4 * (1 + 0.1 * gen.standard_normal())
                scale = late if position > 4096 else 7.0 if position <= 1024 else 1.0
                kl = base * scale if position > 1024 else 5e-4 * scale
                rows.append(("m", "mamba2", arm, fmt, "rn", 16, segment, position,
                             f"{kl:.6e}", "0.0", 1))
    path = tmp_path / "drift.csv"
    md.write_csv(path, rows)
    frame = md.read_csv(path)
    table = {line.split()[0] + " " + line.split()[1]: line.split()
             for line in md.summarize(path).splitlines()[1:]}
    for name, (arm, fmt) in (("separate_fp16sr nvfp4", ("separate_fp16sr", "nvfp4")),
                             ("shared fp8_e4m3", ("shared", "fp8_e4m3"))):
        mine = frame[(frame["arm"] == arm) & (frame["format"] == fmt)]
        late = mine[mine["position"] > 4096]["kl"].mean()
        early = mine[(mine["position"] > 1024) & (mine["position"] <= 2048)]["kl"].mean()
        assert float(table[name][5]) == pytest.approx(late / early, abs=0.005)
    assert float(table["separate_fp16sr nvfp4"][5]) == pytest.approx(3.0, rel=0.15)
    assert float(table["shared fp8_e4m3"][5]) == pytest.approx(1.0, rel=0.15)


def test_replot_with_plot_none_draws_nothing(tiny_model, tmp_path, capsys, monkeypatch):
    """`--replot --plot none` summarises the CSV and writes no figure (no file named 'none'
    either); --pareto needs a figure path and says so in one line."""
    c = config(tiny_model, window=16, policies="separate_fp16sr:nvfp4",
               out=str(tmp_path / "d.csv"), plot=str(tmp_path / "d.png"))
    md.write_csv(c.out, md.run(c))
    monkeypatch.chdir(tmp_path)
    assert md.main(["--replot", "--out", c.out, "--plot", "none"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.csv"]
    out = capsys.readouterr().out
    assert "separate_fp16sr" in out and out.strip().endswith(f"wrote {c.out}")
    assert md.main(["--pareto", "--drift-csv", c.out, "--plot", "none"]) == 2
    assert "--plot: expected a figure path with --pareto" in capsys.readouterr().err
