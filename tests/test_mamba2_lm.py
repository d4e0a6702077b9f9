"""The byte-level Mamba-2 LM: its token decode against its parallel forward, the chunked SSD
against the plain recurrence, and its checkpoints (bit-for-bit round trips, the safetensors
container, a model written by transformers)."""

import json
import math

import pytest
import torch

from experiments import mamba2_lm as lm
from experiments import train_lm
from lowprec import mamba2 as ref_mamba2

# odd sizes: 3 heads of 16 in 1 or 3 groups, state 8, chunk 8, 29 tokens (not a whole chunk)
SMALL = dict(hidden_size=24, num_hidden_layers=2, num_heads=3, head_dim=16, state_size=8,
             chunk_size=8)


def small_model(seed=0, **overrides):
    return lm.Mamba2LM(lm.Mamba2Config(**{**SMALL, **overrides})).init_weights(seed)


def ids(batch=2, length=29, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode_logits(model, tokens):
    dec = lm.Decoder(model, tokens.shape[0], lm.ExactSSM(model, tokens.shape[0],
                                                        model.lm_head.weight.dtype))
    return torch.stack([dec.step(tokens[:, t]) for t in range(tokens.shape[1])], dim=1)


def logits_tolerance(config, length, dtype):
    """Relative RMS difference allowed between two evaluation orders of the same logits.

    Every value passes through ``L`` layers, each a chain of reductions (in_proj over d, the
    conv over K, the SSD over up to ``T`` positions and ``N`` states, out_proj over E, the norms);
    in precision ``u`` a reduction of length ``K`` errs by about ``u sqrt(K)`` relative (random
    rounding errors), and the residual stream adds the layers' errors: ``u sqrt(Kmax) (L + 1)``.
    The decays ``exp(sum dt A)`` add ``u |sum dt A|``, below ``u sqrt(Kmax)`` here. Factor 32 of
    headroom: measured errors sit 10-100x below this bound."""
    u = torch.finfo(dtype).eps / 2
    kmax = max(config.hidden_size, config.intermediate_size, config.state_size * length, length)
    return 32 * u * math.sqrt(kmax) * (config.num_hidden_layers + 1)


def rel_rms(a, b):
    return ((a - b).double().pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("n_groups", [1, 3], ids=["g1", "g3"])
def test_token_decode_reproduces_parallel_forward_in_fp64(n_groups):
    """fp64: the token-by-token decode (conv window + lowprec.mamba2_step) gives the chunked
    parallel forward's logits to fp64 rounding, 29 tokens over 4 chunks of 8."""
    model = small_model(n_groups=n_groups).double()
    tokens = ids()
    with torch.no_grad():
        parallel = model(tokens)
    tol = logits_tolerance(model.config, tokens.shape[1], torch.float64)
    assert rel_rms(decode_logits(model, tokens), parallel) < tol


def test_ssd_chunks_give_the_recurrence_state_and_outputs():
    """ssd_chunked's outputs and final state equal the plain recurrence's (fp64), T=21 over
    chunks of 4 (a partial last chunk), 4 heads in 2 groups."""
    g = torch.Generator().manual_seed(3)
    b, T, H, P, G, N = 2, 21, 4, 5, 2, 6
    x = torch.randn(b, T, H, P, generator=g, dtype=torch.float64)
    dt = torch.rand(b, T, H, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2 - 0.1
    B = torch.randn(b, T, G, N, generator=g, dtype=torch.float64)
    C = torch.randn(b, T, G, N, generator=g, dtype=torch.float64)
    y, final = lm.ssd_chunked(x, dt, A, B, C, chunk=4)
    S = torch.zeros(b, H, P, N, dtype=torch.float64)
    for t in range(T):
        yt, S = ref_mamba2.mamba2_step(S, x[:, t], dt[:, t], A, B[:, t], C[:, t],
                                       dt_softplus=False)
        torch.testing.assert_close(y[:, t], yt, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, S, rtol=1e-12, atol=1e-12)


def test_checkpoint_round_trips_bit_for_bit(tmp_path):
    """fp32 save -> load gives every tensor bit for bit; an fp16 save gives each matrix's fp16
    rounding and keeps the per-head parameters fp32; saving the loaded model again writes the
    same bytes."""
    model = small_model(seed=5)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    lm.save(model, tmp_path / "f32", dtype=torch.float32)
    loaded = lm.load(tmp_path / "f32")
    for name, t in loaded.state_dict().items():
        assert torch.equal(t.view(torch.int32), reference[name].view(torch.int32)), name
    lm.save(model, tmp_path / "f16")
    half = lm.load(tmp_path / "f16").state_dict()
    assert torch.equal(half["backbone.layers.1.mixer.A_log"],
                       reference["backbone.layers.1.mixer.A_log"])
    w = "backbone.layers.0.mixer.in_proj.weight"
    assert torch.equal(half[w], reference[w].half().float())
    assert not torch.equal(half[w], reference[w])  # the fp16 save did round
    lm.save(lm.load(tmp_path / "f16"), tmp_path / "again")
    for name in (lm.WEIGHTS_NAME, lm.CONFIG_NAME):
        assert (tmp_path / "f16" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_safetensors_files_match_the_library(tmp_path):
    """Our writer's file reads back with the safetensors library and the library's file with
    our reader, tensor for tensor (skipped where safetensors is not installed)."""
    st = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(7)
    tensors = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).half(),
               "c": torch.arange(11, dtype=torch.int64), "d": torch.randn(2, 3).bfloat16()}
    lm.save_safetensors(tensors, tmp_path / "ours.safetensors")
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    st.save_file(tensors, str(tmp_path / "lib.safetensors"))
    ours = lm.load_safetensors(tmp_path / "lib.safetensors")
    for name, t in tensors.items():
        assert torch.equal(theirs[name], t) and theirs[name].dtype == t.dtype
        assert torch.equal(ours[name], t) and ours[name].dtype == t.dtype


def test_loader_reads_a_transformers_model(tmp_path):
    """A randomly initialised transformers Mamba2ForCausalLM, saved with save_pretrained,
    loads here with the same parameters and gives the same logits (skipped without
    transformers)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Mamba2Config(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
        state_size=8, n_groups=1, expand=2, conv_kernel=4, chunk_size=8, use_cache=False)
    torch.manual_seed(0)
    theirs = transformers.Mamba2ForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = lm.load(tmp_path)
    for name, t in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t.float()), name
    tokens = ids(batch=1, length=16)
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    assert rel_rms(got, expected) < logits_tolerance(ours.config, 16, torch.float32)


@pytest.mark.parametrize("case, message", [
    ("no_folder", "not a folder"),
    ("no_weights", "model.safetensors to exist"),
    ("bad_shape", "expected shape"),
    ("bad_config", r"num_heads \* head_dim"),
], ids=["no-folder", "no-weights", "bad-shape", "bad-config"])
def test_load_refuses_a_bad_checkpoint_in_one_line(tmp_path, case, message):
    """A missing folder or file, a tensor of the wrong shape and an inconsistent config are
    each one ValueError line naming the problem."""
    folder = tmp_path / "m"
    if case != "no_folder":
        lm.save(small_model(), folder)
    if case == "no_weights":
        (folder / lm.WEIGHTS_NAME).unlink()
    if case in ("bad_shape", "bad_config"):
        config = json.loads((folder / lm.CONFIG_NAME).read_text())
        if case == "bad_shape":
            config["state_size"] = 16
        else:
            config["head_dim"] = 15
        (folder / lm.CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as err:
        lm.load(folder)
    assert "\n" not in str(err.value)


def test_init_is_deterministic_in_its_seed():
    """The same seed gives the same weights bit for bit; another seed different ones."""
    a, b, c = (small_model(seed=s).state_dict() for s in (4, 4, 5))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


@pytest.mark.slow
def test_toy_training_is_repeatable_and_writes_its_outputs(tmp_path):
    """Two toy runs of 3 steps with one seed write the same loss CSV and checkpoint bytes, and
    every output file of train_lm's docstring."""
    outs = []
    for name in ("a", "b"):
        _, c = train_lm.parse_args(["--preset", "toy", "--steps", "3", "--device", "cpu",
                                    "--out", str(tmp_path / name), "--no-progress"])
        summary = train_lm.train(c, tmp_path / name)
        outs.append(tmp_path / name)
    a, b = outs
    assert (a / "train_loss.csv").read_bytes() == (b / "train_loss.csv").read_bytes()
    assert (a / "model" / lm.WEIGHTS_NAME).read_bytes() == \
        (b / "model" / lm.WEIGHTS_NAME).read_bytes()
    for name in ("train_loss.png", "train_loss.meta.json", "heldout_bpb.csv",
                 "decay_spectrum.csv", "decay_spectrum.png", "model/config.json"):
        assert (a / name).is_file(), name
    assert summary["steps_trained"] == 3 and summary["heads"] == 4
    assert 0 < summary["heldout_bpb"] < 9


def test_train_cli_refuses_bad_input_in_one_line(capsys):
    """The default preset without --data, and a non-positive --steps, exit 2 with one line."""
    for argv in (["--preset", "default"], ["--preset", "toy", "--steps", "0"]):
        with pytest.raises(SystemExit) as err:
            train_lm.parse_args(argv)
        assert err.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
