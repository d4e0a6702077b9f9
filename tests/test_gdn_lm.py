"""The byte-level Gated DeltaNet LM: the chunked scan against the plain recurrence (values and
gradients), its token decode against its parallel forward, and its checkpoints (bit-for-bit
round trips, a Qwen3NextForCausalLM written by transformers and read back by it)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from experiments import gdn_lm, train_lm
from lowprec import gdn as ref_gdn

# odd sizes: 1 key head serving 3 value heads (or 3 of each), d_k 16 x d_v 8, hidden 24,
# MLP 40, 29 tokens over chunks of 8 (not a whole chunk)
SMALL = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, linear_num_key_heads=1,
             linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=8)
CHUNK = 8


def small_model(seed=0, **overrides):
    return gdn_lm.GDNLM(gdn_lm.GDNConfig(**{**SMALL, **overrides})).init_weights(seed)


def ids(batch=2, length=29, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode_logits(model, tokens):
    dtype = model.lm_head.weight.dtype
    dec = gdn_lm.Decoder(model, tokens.shape[0], gdn_lm.ExactGDN(model, tokens.shape[0], dtype))
    return torch.stack([dec.step(tokens[:, t]) for t in range(tokens.shape[1])], dim=1)


def logits_tolerance(config, length, dtype):
    """Relative RMS difference allowed between two evaluation orders of the same logits.

    Every value passes through ``L`` layers of two residual branches (the mixer, the MLP),
    each a chain of reductions: the projections over d, d_v H or the MLP's width, the conv
    over K, the norms, and the recurrence, whose output ``S q`` sums ``d_k`` products over up
    to ``T`` tokens (the chunked form: a triangular solve over a chunk and products over d_k
    and the chunk instead, the same count). In precision ``u`` a reduction of length ``K``
    errs by about ``u sqrt(K)`` relative (random rounding errors), and the residual stream
    adds the branches' errors: ``u sqrt(Kmax) (2 L + 1)``. The decays ``exp(sum g)`` add
    ``u |sum g|``, below ``u sqrt(Kmax)`` here. Factor 32 of headroom, as the Mamba-2 LM's:
    measured errors sit 150-300x below this bound (about 10 u in fp32 and fp64)."""
    u = torch.finfo(dtype).eps / 2
    kmax = max(config.hidden_size, config.intermediate_size, config.value_dim,
               config.linear_key_head_dim * length)
    return 32 * u * math.sqrt(kmax) * (2 * config.num_hidden_layers + 1)


def rel_rms(a, b):
    return ((a - b).double().pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


def recurrence_inputs(b=2, T=21, H=3, dk=8, dv=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    return dict(
        q=torch.randn(b, T, H, dk, **f64) / math.sqrt(dk),
        k=F.normalize(torch.randn(b, T, H, dk, **f64), dim=-1),
        v=torch.randn(b, T, H, dv, **f64),
        g=-torch.rand(b, T, H, **f64) * 2,
        beta=torch.rand(b, T, H, **f64),
        state=torch.randn(b, H, dv, dk, **f64),
    )


def sequential(q, k, v, g, beta, state):
    ys = []
    for t in range(q.shape[1]):
        y, state = ref_gdn.gdn_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        ys.append(y)
    return torch.stack(ys, dim=1), state


def test_chunked_scan_gives_the_recurrence_outputs_state_and_gradients():
    """gdn_chunked's outputs and final state equal lowprec.gdn.gdn_step's, token by token, from
    a random state (fp64, T=21 over chunks of 4: a partial last chunk), and so do the gradients
    of a random functional of both with respect to every input: training descends the
    recurrence's own loss."""
    inputs = recurrence_inputs()
    for t in inputs.values():
        t.requires_grad_(True)
    y, final = gdn_lm.gdn_chunked(**inputs, chunk=4)
    y_ref, final_ref = sequential(**inputs)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    weights = torch.Generator().manual_seed(9)
    wy = torch.randn(y.shape, generator=weights, dtype=torch.float64)
    ws = torch.randn(final.shape, generator=weights, dtype=torch.float64)
    names = list(inputs)
    grads = torch.autograd.grad((y * wy).sum() + (final * ws).sum(), list(inputs.values()))
    grads_ref = torch.autograd.grad((y_ref * wy).sum() + (final_ref * ws).sum(),
                                    list(inputs.values()))
    for name, a, b in zip(names, grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_chunked_scan_is_one_chunk_or_many_alike():
    """Chunks of 1, 5 and 32 tokens (one chunk past the end) give the same outputs to fp64
    rounding: the chunk length is an evaluation order, not a model parameter."""
    inputs = recurrence_inputs(T=17, seed=4)
    y1, s1 = gdn_lm.gdn_chunked(**inputs, chunk=1)
    for chunk in (5, 32):
        y, s = gdn_lm.gdn_chunked(**inputs, chunk=chunk)
        torch.testing.assert_close(y, y1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, s1, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key_heads", [1, 3], ids=["kv1-3", "kv3-3"])
def test_token_decode_reproduces_parallel_forward_in_fp64(key_heads):
    """fp64: the token-by-token decode (conv window + lowprec.gdn.gdn_step) gives the chunked
    parallel forward's logits to fp64 rounding, 29 tokens over 4 chunks of 8, with one key
    head serving three value heads or one each."""
    model = small_model(linear_num_key_heads=key_heads).double()
    tokens = ids()
    with torch.no_grad():
        parallel = model(tokens, chunk=CHUNK)
    tol = logits_tolerance(model.config, tokens.shape[1], torch.float64)
    assert rel_rms(decode_logits(model, tokens), parallel) < tol


def test_fp32_forward_is_within_the_derived_tolerance_of_fp64():
    """The fp32 parallel forward against the fp64 decode: the fp32 tolerance holds, and the
    difference is not below fp64's (the check can fail)."""
    model = small_model(seed=2)
    tokens = ids(length=23, seed=5)
    with torch.no_grad():
        fp32 = model(tokens, chunk=CHUNK)
    exact = decode_logits(model.double(), tokens)
    err = rel_rms(fp32, exact)
    assert logits_tolerance(model.config, 23, torch.float64) < err < logits_tolerance(
        model.config, 23, torch.float32)


def test_checkpoint_round_trips_bit_for_bit(tmp_path):
    """fp32 save -> load gives every tensor bit for bit; an fp16 save gives each matrix's fp16
    rounding and keeps the per-head parameters and norms fp32; saving the loaded model again
    writes the same bytes."""
    model = small_model(seed=5)
    with torch.no_grad():  # norms away from their initial values, so they are checked
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    gdn_lm.save(model, tmp_path / "f32", dtype=torch.float32)
    loaded = gdn_lm.load(tmp_path / "f32")
    for name, t in loaded.state_dict().items():
        assert torch.equal(t.view(torch.int32), reference[name].view(torch.int32)), name
    gdn_lm.save(model, tmp_path / "f16")
    half = gdn_lm.load(tmp_path / "f16").state_dict()
    for name in ("model.layers.1.linear_attn.A_log", "model.layers.1.linear_attn.dt_bias",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.linear_attn.norm.weight"):
        assert torch.equal(half[name], reference[name]), name
    w = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert torch.equal(half[w], reference[w].half().float())
    assert not torch.equal(half[w], reference[w])  # the fp16 save did round
    gdn_lm.save(gdn_lm.load(tmp_path / "f16"), tmp_path / "again")
    for name in (gdn_lm.WEIGHTS_NAME, gdn_lm.CONFIG_NAME):
        assert (tmp_path / "f16" / name).read_bytes() == \
            (tmp_path / "again" / name).read_bytes()


def _transformers_qwen3_next():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip("transformers has no Qwen3NextForCausalLM (it came in 4.57)")
    return transformers


def test_loader_reads_a_transformers_model_and_transformers_reads_ours(tmp_path):
    """A randomly initialised transformers Qwen3NextForCausalLM of linear-attention layers and
    dense MLPs (2 key heads serving 4 value heads, norms moved off their initial values),
    saved with save_pretrained, loads here with the same parameters and gives the same logits;
    this module's save of it loads in transformers with the same tensors (skipped without
    transformers)."""
    transformers = _transformers_qwen3_next()
    config = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention"] * 2, mlp_only_layers=[0, 1], num_experts=0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, use_cache=False)
    torch.manual_seed(0)
    theirs = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(tmp_path / "theirs", safe_serialization=True)
    ours = gdn_lm.load(tmp_path / "theirs")
    for name, t in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t.float()), name
    tokens = ids(batch=1, length=37)
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens, chunk=CHUNK)
    assert rel_rms(got, expected) < logits_tolerance(ours.config, 37, torch.float32)
    gdn_lm.save(ours, tmp_path / "ours", dtype=torch.float32)
    back = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "ours")
    for name, t in back.state_dict().items():
        assert torch.equal(t, theirs.state_dict()[name]), name


@pytest.mark.parametrize("case, message", [
    ("no_folder", "not a folder"),
    ("no_weights", "model.safetensors to exist"),
    ("bad_shape", "expected shape"),
    ("bad_heads", "a multiple of linear_num_key_heads"),
    ("attention", "'linear_attention' for all 2 layers"),
    ("moe", "mixture-of-experts layers"),
    ("mamba2", "expected 'qwen3_next'"),
], ids=["no-folder", "no-weights", "bad-shape", "bad-heads", "attention", "moe", "mamba2"])
def test_load_refuses_a_bad_checkpoint_in_one_line(tmp_path, case, message):
    """A missing folder or file, a tensor of the wrong shape, value heads that are no multiple
    of the key heads, a full-attention layer, mixture-of-experts MLPs and another model type
    are each one ValueError line naming the problem."""
    folder = tmp_path / "m"
    if case != "no_folder":
        gdn_lm.save(small_model(), folder)
    if case == "no_weights":
        (folder / gdn_lm.WEIGHTS_NAME).unlink()
    edits = {
        "bad_shape": {"linear_key_head_dim": 32},
        "bad_heads": {"linear_num_value_heads": 4, "linear_num_key_heads": 3},
        "attention": {"layer_types": ["linear_attention", "full_attention"]},
        "moe": {"mlp_only_layers": [0], "num_experts": 8},
        "mamba2": {"model_type": "mamba2"},
    }
    if case in edits:
        config = json.loads((folder / gdn_lm.CONFIG_NAME).read_text())
        config.update(edits[case])
        (folder / gdn_lm.CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as err:
        gdn_lm.load(folder)
    assert "\n" not in str(err.value)


def test_init_is_deterministic_in_its_seed_and_spreads_the_decays():
    """The same seed gives the same weights bit for bit, another seed different ones; the
    initial decay rates exp(A_log) softplus(dt_bias) lie in [1e-3, 1.6] (time constants from
    about 1 to 1,000 tokens)."""
    a, b, c = (small_model(seed=s).state_dict() for s in (4, 4, 5))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    m = small_model(seed=4, linear_num_value_heads=30, linear_num_key_heads=1).mixers()[0]
    rate = torch.exp(m.A_log) * F.softplus(m.dt_bias)
    assert rate.min() >= 1e-3 * 0.999 and rate.max() <= 16 * 0.1 * 1.001
    assert rate.max() / rate.min() > 30


def test_mixer_splits_the_projections_by_key_head():
    """in_proj_qkvz's rows are grouped by key head (q_j | k_j | v, z of its value heads):
    with one-hot rows the split puts row i of key head j's block where the layout says.
    2 key heads, 4 value heads, d_k 3, d_v 2 (block of 3 + 3 + 2*2 + 2*2 = 14 rows)."""
    config = gdn_lm.GDNConfig(hidden_size=4, intermediate_size=4, num_hidden_layers=1,
                              linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=3, linear_value_head_dim=2)
    mixer = gdn_lm.Mixer(config)
    qkvz = torch.arange(2 * 14, dtype=torch.float64)
    ba = torch.arange(8, dtype=torch.float64)
    qkv, z, b, a = mixer.split_proj(qkvz, ba)
    assert qkv[:6].tolist() == [0, 1, 2, 14, 15, 16]  # q of key heads 0 and 1
    assert qkv[6:12].tolist() == [3, 4, 5, 17, 18, 19]  # k
    assert qkv[12:].tolist() == [6, 7, 8, 9, 20, 21, 22, 23]  # v of value heads 0..3
    assert z.tolist() == [[10, 11], [12, 13], [24, 25], [26, 27]]
    assert b.tolist() == [0, 1, 4, 5] and a.tolist() == [2, 3, 6, 7]


@pytest.mark.slow
def test_gdn_toy_training_is_repeatable_and_writes_its_outputs(tmp_path):
    """Two runs of train_lm's GDN toy preset (3 steps) with one seed write the same loss CSV
    and checkpoint bytes, and every output file of train_lm's docstring; the spectrum has a
    row per value head."""
    outs = []
    for name in ("a", "b"):
        _, c = train_lm.parse_args(["--arch", "gdn", "--preset", "toy", "--steps", "3",
                                    "--device", "cpu", "--out", str(tmp_path / name),
                                    "--no-progress"])
        summary = train_lm.train(c, tmp_path / name)
        outs.append(tmp_path / name)
    a, b = outs
    assert (a / "train_loss.csv").read_bytes() == (b / "train_loss.csv").read_bytes()
    assert (a / "model" / gdn_lm.WEIGHTS_NAME).read_bytes() == \
        (b / "model" / gdn_lm.WEIGHTS_NAME).read_bytes()
    for name in ("train_loss.png", "train_loss.meta.json", "heldout_bpb.csv",
                 "decay_spectrum.csv", "decay_spectrum.png", "model/config.json"):
        assert (a / name).is_file(), name
    assert json.loads((a / "model" / "config.json").read_text())["model_type"] == "qwen3_next"
    assert summary["steps_trained"] == 3 and summary["heads"] == 4
    assert 0 < summary["heldout_bpb"] < 9


def test_train_cli_picks_the_arch_and_its_output_folder():
    """--arch gdn takes the GDN presets (d_model 256, an MLP of 512 for the default) and
    writes the default preset under results/model_drift/gdn; --arch mamba2 is the default and
    keeps its folder; an unknown arch exits 2."""
    _, c = train_lm.parse_args(["--arch", "gdn", "--data", "runs/kjv"])
    assert (c.arch, c.hidden_size, c.intermediate_size) == ("gdn", 256, 512)
    assert c.out == str(train_lm.RESULTS / "gdn")
    _, c = train_lm.parse_args(["--data", "runs/kjv"])
    assert (c.arch, c.out) == ("mamba2", str(train_lm.RESULTS))
    _, c = train_lm.parse_args(["--arch", "gdn", "--preset", "toy"])
    assert c.out.endswith("runs/train_lm_gdn_toy")
    with pytest.raises(SystemExit) as err:
        train_lm.parse_args(["--arch", "kda"])
    assert err.value.code == 2
