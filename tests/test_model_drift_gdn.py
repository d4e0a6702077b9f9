"""The model-drift harness on a Gated DeltaNet LM (experiments.model_drift_gdn's state keepers):
its exact arm against the model's parallel forward, exact formats giving KL 0, the recurrence
read from the checkpoint, the emulation backend against the reference, and the gdn-toy preset
(trains its model on first use, then runs)."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from experiments import gdn_lm
from experiments import model_drift as md
from tests.test_gdn_lm import logits_tolerance, rel_rms
from tests.test_model_drift import config as drift_config

# 2 layers of 2 heads of d_v 16 x d_k 32 (nvfp4 blocks of 16, mxfp4 of 32 fit), hidden 16,
# MLP 24, one key head serving both value heads
TINY = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, linear_num_key_heads=1,
            linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=16)


@pytest.fixture(scope="module")
def tiny_gdn(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gdn")
    gdn_lm.save(gdn_lm.GDNLM(gdn_lm.GDNConfig(**TINY)).init_weights(11), folder,
                dtype=torch.float32)
    return folder


config = partial(drift_config, preset="gdn-toy")


def test_exact_arm_reproduces_the_parallel_forward(tiny_gdn):
    """The harness's exact arm (fp64 model, Policy('exact') GDN simulators) gives the fp32
    training forward's logits (chunks of 8) within the fp32 tolerance of logits_tolerance
    (23 tokens, 2 segments of the committed held-out text), and exact_state_logits keeps
    those logits at the grid positions."""
    from experiments.model_drift_gdn import ReferenceGDN

    c = config(tiny_gdn)
    model64 = gdn_lm.load(c.model, dtype=torch.float64)
    decoder = gdn_lm.Decoder(model64, c.segments, ReferenceGDN(model64, [None], c))
    tokens = md.load_segments(c)[:, : c.tokens]
    exact = torch.stack([decoder.step(tokens[:, t]) for t in range(c.tokens)], 1)
    with torch.no_grad():
        parallel = gdn_lm.load(c.model)(tokens, chunk=8)
    assert rel_rms(parallel, exact) < logits_tolerance(model64.config, c.tokens, torch.float32)
    _, _, reached, kept = md.exact_state_logits(c)
    assert reached == c.tokens and sorted(kept) == md.log_grid(c.tokens, c.per_octave)
    assert torch.equal(kept[c.tokens], exact[:, -1])


def test_exact_formats_give_kl_zero_exactly_and_the_rows_say_gdn(tiny_gdn):
    """every_step, shared and separate_exact with the fp64 format round nothing: KL and dlogp
    are exactly 0 and top-1 agrees at every recorded position; an nvfp4 policy beside them
    does drift (KL > 0 somewhere); every row's recurrence is gdn."""
    c = config(tiny_gdn, policies="every_step:fp64,shared:fp64,separate_exact:fp64,"
                                  "separate_fp16sr:nvfp4")
    rows = md.run(c)
    assert len(rows) == 4 * 2 * len(md.log_grid(23, 4))
    assert {r[1] for r in rows} == {"gdn"}
    for row in rows:
        if row[3] == "fp64":
            assert (float(row[8]), float(row[9]), row[10]) == (0.0, 0.0, 1)
    assert max(float(r[8]) for r in rows if r[3] == "nvfp4") > 0


def test_recurrence_is_read_from_the_checkpoint(tiny_gdn, tmp_path):
    """A qwen3_next config is gdn, a mamba2 one (or one without model_type) mamba2, and another
    model type is one ValueError line naming it."""
    assert md.recurrence_of(tiny_gdn) == "gdn"
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    assert md.recurrence_of(tmp_path) == "mamba2"
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="expected a model_type in .* got 'llama'") as err:
        md.recurrence_of(tmp_path)
    assert "\n" not in str(err.value)


def test_emulation_refuses_a_block_format_shared_checkpoint(tiny_gdn):
    """The GDN emulation keeps a shared checkpoint only in an element format with RN, as the
    Mamba-2 one: shared nvfp4 is one ValueError line."""
    with pytest.raises(ValueError, match="shared only with rn and an element format"):
        md.validate(config(tiny_gdn, backend="emulation", policies="shared:nvfp4"))


@pytest.mark.slow
def test_emulation_backend_follows_the_reference(tiny_gdn):
    """The Triton GDN emulation (interpreter on the CPU; fp32 model) gives the reference's KL
    within a factor 2 where the reference KL is well above fp32's own noise, with the same
    Philox words (8 tokens, window 4: a conventional SR, a two-precision and a shared policy);
    its every_step fp32 policy is the exact arm's own cache, KL 0 exactly."""
    policies = "every_step:fp8_e4m3:sr,separate_fp16sr:nvfp4,shared:fp8_e4m3"
    ref = md.run(config(tiny_gdn, tokens=8, policies=policies))
    emu = md.run(config(tiny_gdn, tokens=8, policies=policies + ",every_step:fp32",
                        backend="emulation"))
    assert [r[:8] for r in ref] == [r[:8] for r in emu[:len(ref)]]
    for r, e in zip(ref, emu, strict=False):
        if float(r[8]) > 1e-9:
            assert 0.5 < float(e[8]) / float(r[8]) < 2.0, (r, e)
    assert all(float(e[8]) == 0.0 for e in emu[len(ref):])


@pytest.mark.slow
def test_gdn_toy_preset_trains_its_model_once_then_runs(tmp_path, monkeypatch, capsys):
    """--preset gdn-toy trains train_lm's GDN toy preset into its model folder when absent
    (here a temporary one), then decodes; a second run finds the model and trains nothing.
    64 tokens, the preset's three policies."""
    folder = tmp_path / "toy"
    model = str(folder / "model")
    monkeypatch.setattr(md, "TOY_MODELS", {model: ("gdn", folder)})
    argv = ["--preset", "gdn-toy", "--model", model, "--tokens", "64", "--no-progress",
            "--out", str(tmp_path / "d.csv")]
    assert md.main(argv) == 0
    assert "training the toy model" in capsys.readouterr().err
    frame = md.read_csv(tmp_path / "d.csv")
    assert set(frame["recurrence"]) == {"gdn"} and frame["position"].max() == 64
    assert len(frame.groupby(["arm", "format", "rounding"])) == 3
    assert md.main(argv) == 0
    assert "training the toy model" not in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_graph_replay_gives_the_eager_rows(tiny_gdn):
    """On CUDA the graph path (chunks of 8 tokens) writes the same rows as eager decode, bit
    for bit, for a GDN model (40 tokens: warm-up, four replays and an eager tail)."""
    c = config(tiny_gdn, tokens=40, backend="emulation", device="cuda",
               policies="every_step:nvfp4:sr,shared:fp8_e4m3,separate_fp16sr:mxfp4")
    assert md.run(replace(c, graph_tokens=8)) == md.run(replace(c, graph_tokens=0))


@pytest.mark.gpu
def test_emulation_fp32_policy_gives_kl_zero_on_cuda(tiny_gdn):
    """On CUDA, an every_step fp32 policy (the exact arm's own cache) gives KL 0 exactly, and
    a two-precision NVFP4 policy drifts (KL > 0 somewhere)."""
    c = config(tiny_gdn, tokens=40, backend="emulation", device="cuda",
               policies="every_step:fp32,separate_fp16sr:nvfp4")
    rows = md.run(c)
    assert all(float(r[8]) == 0.0 for r in rows if r[3] == "fp32")
    assert max(float(r[8]) for r in rows if r[3] == "nvfp4") > 0
