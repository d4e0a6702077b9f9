"""A byte-level Gated DeltaNet language model in plain PyTorch, in the layout of
``transformers``' ``Qwen3NextForCausalLM`` with every layer a linear-attention (Gated DeltaNet)
layer and a dense MLP, with a chunked parallel forward for training and a token-by-token decode
whose recurrent state is kept by a pluggable stepper.

There is no ``transformers`` class for a model of Gated DeltaNet layers alone; a
``Qwen3NextConfig`` with ``layer_types = ["linear_attention"] * L`` and every layer in
``mlp_only_layers`` (``num_experts = 0``) is one, so that is the layout here: ``config.json``
uses ``Qwen3NextConfig``'s keys (``model_type: qwen3_next``) and the parameters its names,
``load(DIR)`` reads such a checkpoint written by ``save_pretrained``, and ``transformers``
loads this module's checkpoints (the tests check both where it is installed). A checkpoint
with full-attention layers or mixture-of-experts MLPs (a real Qwen3-Next) is refused.

Layer ``l`` (``d = hidden_size``; ``Hk, Hv`` key and value heads, ``r = Hv / Hk``; ``dk, dv``
their dims; ``K = linear_conv_kernel_dim``; names under ``model.layers.l``):

    h       = RMSNorm(u) * (1 + input_layernorm.weight)               zero-centred weight
    qkvz    = in_proj_qkvz(h)   per key head j: q_j [dk] | k_j [dk] | v, z of its r value heads
    ba      = in_proj_ba(h)     per key head j: b, a of its r value heads
    q, k, v = silu(causal depthwise conv1d_K(q | k | v))                  linear_attn.conv1d
    q       = l2norm(q) / sqrt(dk),  k = l2norm(k)   (l2norm(x) = x / sqrt(|x|^2 + 1e-6)),
              each key head's q, k serving its r value heads
    beta    = sigmoid(b),  g = -exp(A_log) softplus(a + dt_bias)            log-decay, a = e^g
    S_t     = e^g S_{t-1} (I - beta k k^T) + beta v k^T,  y = S_t q      (lowprec.gdn, [dv, dk])
    u      += out_proj(RMSNorm_dv(y) * norm.weight * silu(z))              per value head
    x       = RMSNorm(u) * (1 + post_attention_layernorm.weight)
    u      += down_proj(silu(gate_proj(x)) * up_proj(x))                        mlp

then ``logits = lm_head(RMSNorm(u) (1 + model.norm.weight))``. Checkpoints are
``model.safetensors`` + ``config.json``, through ``experiments.lm_checkpoint``.

The decode (``Decoder``) advances a batch of sequences one token at a time; each layer's conv
window lives in the decoder and its recurrence is a callable
``gdn_step(layer, q [b, Hv, dk], k [b, Hv, dk], v [b, Hv, dv], g [b, Hv], beta [b, Hv])
-> y [b, Hv, dv]`` (``lowprec.gdn.gdn_step``'s arguments, q already scaled) that keeps the
state however it likes (``ExactGDN``: ``lowprec.gdn.gdn_step`` in the decoder's dtype;
``experiments.model_drift_gdn``: one cache per precision policy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from experiments.lm_checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_checkpoint, save_checkpoint
from lowprec import gdn as ref_gdn

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "GDNConfig",
    "GDNLM",
    "Decoder",
    "ExactGDN",
    "gdn_chunked",
    "save",
    "load",
]

L2_EPS = 1e-6  # l2norm's epsilon inside the square root, as Qwen3-Next's
DEFAULT_CHUNK = 64  # tokens per chunk of the training scan (a property of the forward only)


@dataclass
class GDNConfig:
    """The keys of ``transformers.Qwen3NextConfig`` a model of Gated DeltaNet layers and dense
    MLPs uses (same names, same meaning)."""

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # other keys of a loaded config.json, kept

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.{name}: expected a positive int, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config.linear_num_value_heads: expected a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}, got "
                             f"{self.linear_num_value_heads}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"config.hidden_act: expected 'silu', got {self.hidden_act!r}")

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def to_dict(self) -> dict:
        out = {**self.extra}
        out.update({k: v for k, v in asdict(self).items() if k != "extra"})
        n = self.num_hidden_layers
        out["layer_types"] = ["linear_attention"] * n
        out["mlp_only_layers"] = list(range(n))
        out["num_experts"] = 0
        out["model_type"] = "qwen3_next"
        out["architectures"] = ["Qwen3NextForCausalLM"]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> GDNConfig:
        """A config from a config.json's object (Qwen3NextConfig keys); other keys are kept in
        ``extra``. ValueError for a model that is not Gated DeltaNet layers and dense MLPs."""
        if not isinstance(data, dict):
            raise ValueError(f"config: expected a JSON object, got {type(data).__name__}")
        if data.get("model_type") != "qwen3_next":
            raise ValueError(f"config.model_type: expected 'qwen3_next', got "
                             f"{data.get('model_type')!r}")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "linear_num_key_heads",
                               "linear_num_value_heads", "linear_key_head_dim",
                               "linear_value_head_dim", "vocab_size", "intermediate_size")
                   if k not in data]
        if missing:
            raise ValueError(f"config: expected the Qwen3NextConfig keys {missing}, got none")
        n = data["num_hidden_layers"]
        types = data.get("layer_types") or []
        other = [i for i, t in enumerate(types) if t != "linear_attention"]
        if len(types) != n or other:
            raise ValueError(f"config.layer_types: expected 'linear_attention' for all {n} "
                             f"layers (a Gated DeltaNet model), got {types!r}")
        dense = set(data.get("mlp_only_layers") or [])
        step = data.get("decoder_sparse_step", 1) or 1
        moe = [i for i in range(n) if i not in dense and data.get("num_experts", 0) > 0
               and (i + 1) % step == 0]
        if moe:
            raise ValueError(f"config: expected dense MLPs (mlp_only_layers or num_experts 0), "
                             f"got mixture-of-experts layers {moe[:4]}")
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)


# --------------------------------------------------------------------------------------------
# layers


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (fp64 stays fp64): the recurrence's precision."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class RMSNorm(nn.Module):
    """Qwen3-Next's zero-centred norm: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, x.shape[-1:], eps=self.eps) * (1 + self.weight)


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) * weight * silu(gate)`` over the last dim (the norm before the gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps) * F.silu(gate)


def l2norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * x / sqrt(|x|^2 + L2_EPS)`` over the last dim, as one RMS norm:
    ``rms_norm(x, eps / n) = sqrt(n) x / sqrt(|x|^2 + eps)``."""
    n = x.shape[-1]
    return F.rms_norm(x, (n,), eps=L2_EPS / n) * (scale / math.sqrt(n))


class Mixer(nn.Module):
    """One Gated DeltaNet mixer; parameter names as in transformers' ``Qwen3NextGatedDeltaNet``."""

    def __init__(self, c: GDNConfig):
        super().__init__()
        self.c = c
        hv = c.linear_num_value_heads
        self.in_proj_qkvz = nn.Linear(c.hidden_size, 2 * c.key_dim + 2 * c.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(c.hidden_size, 2 * hv, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim,
                                groups=c.conv_dim, padding=c.linear_conv_kernel_dim - 1,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    def split_proj(self, qkvz, ba):
        """The projections, grouped by key head (module docstring), as ``(qkv [..., conv_dim]
        in the conv's order q | k | v, z [..., Hv, dv], b [..., Hv], a [..., Hv])``."""
        c = self.c
        hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim)
        r = hv // hk
        lead = qkvz.shape[:-1]
        q, k, v, z = torch.split(qkvz.reshape(*lead, hk, 2 * dk + 2 * r * dv),
                                 [dk, dk, r * dv, r * dv], dim=-1)
        qkv = torch.cat([q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)], -1)
        return (qkv, z.reshape(*lead, hv, dv), *self.split_ba(ba))

    def split_ba(self, ba):
        """``(b, a)`` each ``[..., Hv]`` from ``in_proj_ba``'s output, grouped by key head."""
        hk, hv = self.c.linear_num_key_heads, self.c.linear_num_value_heads
        lead = ba.shape[:-1]
        b, a = torch.split(ba.reshape(*lead, hk, 2 * hv // hk), hv // hk, dim=-1)
        return b.reshape(*lead, hv), a.reshape(*lead, hv)

    def process_dt(self, a):
        """``softplus(a + dt_bias)``: the step whose product with ``-exp(A_log)`` is ``g``."""
        return F.softplus(_wide(a) + self.dt_bias)

    def recurrence_inputs(self, qkv, b, a):
        """``(q, k [..., Hv, dk], v [..., Hv, dv], g, beta [..., Hv])`` of ``lowprec.gdn`` from
        the conv's activated output and the projections (module docstring); q, k, g and beta
        in at least fp32, v in the activations' dtype."""
        c = self.c
        hk, hv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
        q, k, v = torch.split(qkv, [c.key_dim, c.key_dim, c.value_dim], dim=-1)
        lead = qkv.shape[:-1]
        q = l2norm(_wide(q).reshape(*lead, hk, dk), 1 / math.sqrt(dk))
        k = l2norm(_wide(k).reshape(*lead, hk, dk))
        if hv != hk:
            q, k = (t.repeat_interleave(hv // hk, dim=-2) for t in (q, k))
        g = -torch.exp(self.A_log) * self.process_dt(a)
        return q, k, v.reshape(*lead, hv, c.linear_value_head_dim), g, torch.sigmoid(_wide(b))

    def forward(self, h, chunk: int = DEFAULT_CHUNK):
        """Parallel form: ``h [b, T, d] -> [b, T, d]``."""
        T = h.shape[1]
        qkv, z, b, a = self.split_proj(self.in_proj_qkvz(h), self.in_proj_ba(h))
        qkv = F.silu(self.conv1d(qkv.transpose(1, 2))[..., :T].transpose(1, 2))
        q, k, v, g, beta = self.recurrence_inputs(qkv, b, a)
        y, _ = gdn_chunked(q, k, v, g, beta, chunk)
        y = self.norm(y.to(z.dtype), z)
        return self.out_proj(y.reshape(*y.shape[:2], -1))


class MLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, transformers' ``Qwen3NextMLP``."""

    def __init__(self, c: GDNConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: GDNConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.linear_attn = Mixer(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class Backbone(nn.Module):
    def __init__(self, c: GDNConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def gdn_chunked(q, k, v, g, beta, chunk: int, state=None):
    """The Gated DeltaNet recurrence of a whole sequence, chunk by chunk, in at least fp32
    (autocast off).

    ``q, k [b, T, H, dk]``, ``v [b, T, H, dv]``, ``g, beta [b, T, H]``, ``state [b, H, dv, dk]``
    (default zero); returns ``(y [b, T, H, dv], S_T [b, H, dv, dk])`` of ``lowprec.gdn``'s
    ``S_t = e^{g_t} S_{t-1} + u_t k_t^T``, ``u_t = beta_t (v_t - e^{g_t} S_{t-1} k_t)``,
    ``y_t = S_t q_t``. Inside a chunk with ``c_i = sum_{l<=i} g_l`` and ``G_ij = e^{c_i - c_j}``:

        S_{i-1} e^{g_i} = e^{c_i} S_in + sum_{j<i} G_ij u_j k_j^T, so the chunk's u solve the
        unit lower-triangular system  (I + diag(beta) A) U = diag(beta) (V - diag(e^c) K S_in^T),
        A_ij = G_ij k_i . k_j (j < i):  U = Uv - W S_in^T  with  Uv, W = (I + diag(beta) A)^-1
        [diag(beta) V, diag(beta e^c) K]  (independent of S_in, one solve for every chunk);
        y_i = e^{c_i} S_in q_i + sum_{j<=i} G_ij (q_i . k_j) u_j;
        S_out = e^{c_Q} S_in + sum_j e^{c_Q - c_j} u_j k_j^T,

    and the chunks are chained in a loop over the ``T / Q`` chunks. Padding tokens get
    ``g = beta = 0``, which leaves the state unchanged.
    """
    dtype = torch.promote_types(v.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
        b, T, H, dk = k.shape
        dv = v.shape[-1]
        pad = (-T) % chunk
        if pad:
            q, k, v, g, beta = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
                                for t in (q, k, v, g, beta))
        n = q.shape[1] // chunk

        def chunks(t):  # [b, n Q, H, ...] -> [n, b, H, Q, ...], a chunk contiguous
            t = t.reshape(b, n, chunk, H, *t.shape[3:])
            return t.movedim(3, 2).movedim(1, 0).contiguous()

        q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
        cum = torch.cumsum(g, dim=-1)  # [n, b, H, Q]
        seg = cum[..., :, None] - cum[..., None, :]  # [n, b, H, Qi, Qj]
        ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
        # masked before exp: above the diagonal c_i - c_j > 0 could overflow
        decay = torch.exp(seg.masked_fill(~ones.tril(), -math.inf))
        A = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
        system = A.masked_fill(~ones.tril(-1), 0.0) + torch.eye(chunk, dtype=dtype,
                                                                device=q.device)
        rhs = torch.cat([v * beta[..., None], k * (beta * torch.exp(cum))[..., None]], dim=-1)
        Uv, W = torch.linalg.solve_triangular(system, rhs, upper=False,
                                              unitriangular=True).split([dv, dk], dim=-1)
        B = b * H  # (batch, head) rows, one batch dim for the fused products below
        qk = (q @ k.transpose(-1, -2)) * decay  # [n, b, H, Qi, Qj], zero above the diagonal
        # W and the queries read the entering state in one product: [n, B, 2Q, dk]
        wq = torch.cat([W, q * torch.exp(cum)[..., None]], dim=-2).reshape(n, B, 2 * chunk, dk)
        k_out = (k * torch.exp(cum[..., -1:] - cum)[..., None]).transpose(-1, -2)  # [.., dk, Q]
        chunk_decay = torch.exp(cum[..., -1]).reshape(n, B, 1, 1)
        St = (torch.zeros(B, dk, dv, dtype=dtype, device=q.device) if state is None
              else state.to(dtype).reshape(B, dv, dk).transpose(-1, -2))  # S^T [B, dk, dv]
        ys = []
        # unbound once: indexing a chunk in the loop would cost a full-size gradient each
        for wq_i, uv_i, qk_i, k_i, d_i in zip(
                wq.unbind(0), Uv.reshape(n, B, chunk, dv).unbind(0),
                qk.reshape(n, B, chunk, chunk).unbind(0), k_out.reshape(n, B, dk, chunk).unbind(0),
                chunk_decay.unbind(0), strict=True):
            X = wq_i @ St  # [B, 2Q, dv]: W S_in^T and e^c Q S_in^T
            U = uv_i - X[:, :chunk]
            ys.append(torch.baddbmm(X[:, chunk:], qk_i, U))
            St = torch.baddbmm(St * d_i, k_i, U)
        y = torch.stack(ys).reshape(n, b, H, chunk, dv)
        S = St.transpose(-1, -2).reshape(b, H, dv, dk)
        y = y.movedim(0, 1).movedim(2, 3).reshape(b, n * chunk, H, dv)[:, :T]
    return y, S


class GDNLM(nn.Module):
    """``Qwen3NextForCausalLM``'s parameters and forward for Gated DeltaNet layers and dense
    MLPs; ``forward(ids [b, T]) -> logits``."""

    def __init__(self, config: GDNConfig):
        super().__init__()
        if not isinstance(config, GDNConfig):
            raise TypeError(f"config: expected a GDNConfig, got {type(config).__name__}")
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def mixers(self) -> list[Mixer]:
        return [layer.linear_attn for layer in self.model.layers]

    def init_weights(self, seed: int, dt_min: float = 0.001, dt_max: float = 0.1,
                     dt_floor: float = 1e-4) -> GDNLM:
        """Weights drawn from a generator seeded with ``seed``: the decay as mamba_ssm's (``A``
        in [1, 16], ``softplus(dt_bias)`` log-uniform in [dt_min, dt_max], floor dt_floor, so
        the heads start with time constants from about 1 to 1,000 tokens), linear and conv
        layers uniform with bound 1/sqrt(fan_in), embeddings N(0, 0.02), norms the identity."""
        c = self.config
        gen = torch.Generator().manual_seed(seed)

        def uniform(t, bound):
            t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 * bound - bound)

        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(
                torch.randn(self.model.embed_tokens.weight.shape, generator=gen) * 0.02)
            for layer in self.model.layers:
                m = layer.linear_attn
                for lin in (m.in_proj_qkvz, m.in_proj_ba, m.out_proj, layer.mlp.gate_proj,
                            layer.mlp.up_proj, layer.mlp.down_proj):
                    uniform(lin.weight, 1 / math.sqrt(lin.in_features))
                uniform(m.conv1d.weight, 1 / math.sqrt(c.linear_conv_kernel_dim))
                lo, hi = math.log(dt_min), math.log(dt_max)
                dt = torch.exp(torch.rand(c.linear_num_value_heads, generator=gen) * (hi - lo)
                               + lo).clamp(min=dt_floor)
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
                m.A_log.copy_(torch.log(torch.rand(c.linear_num_value_heads, generator=gen) * 15
                                        + 1))
                m.norm.weight.fill_(1.0)
                layer.input_layernorm.weight.zero_()
                layer.post_attention_layernorm.weight.zero_()
            self.model.norm.weight.zero_()
            if not c.tie_word_embeddings:
                uniform(self.lm_head.weight, 1 / math.sqrt(c.hidden_size))
        return self

    def forward(self, input_ids, chunk: int = DEFAULT_CHUNK):
        u = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            u = u + layer.linear_attn(layer.input_layernorm(u), chunk)
            u = u + layer.mlp(layer.post_attention_layernorm(u))
        return self.lm_head(self.model.norm(u))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


# --------------------------------------------------------------------------------------------
# token-by-token decode


class ExactGDN:
    """The recurrent state of every layer kept exactly in the decoder's dtype:
    ``lowprec.gdn.gdn_step``."""

    def __init__(self, model: GDNLM, batch: int, dtype, device=None):
        c = model.config
        self.states = [torch.zeros(batch, c.linear_num_value_heads, c.linear_value_head_dim,
                                   c.linear_key_head_dim, dtype=dtype, device=device)
                       for _ in range(c.num_hidden_layers)]

    def __call__(self, layer, q, k, v, g, beta):
        y, self.states[layer] = ref_gdn.gdn_step(self.states[layer], q, k, v, g, beta)
        return y


class Decoder:
    """Token-by-token decode of ``batch`` sequences; the model's parameters are used in their
    own dtype and device (``model.to(torch.float64)`` for an fp64 decode). ``step(ids [b])``
    returns the logits ``[b, vocab]`` after that token; ``gdn_step`` keeps the states.

    The parallel forward's arithmetic with fewer launches a token (a token is one CUDA graph
    node per launch): the decoder holds, per layer, the two input projections as one matrix,
    ``gate_proj`` and ``up_proj`` as one, the norms' ``1 + weight``, ``-exp(A_log)`` and the
    l2 norms' scales as RMS-norm weights, taken from the model when the decoder is made (a
    later change to the model's parameters is not seen)."""

    def __init__(self, model: GDNLM, batch: int, gdn_step):
        if not isinstance(model, GDNLM):
            raise TypeError(f"model: expected a GDNLM, got {type(model).__name__}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        if not callable(gdn_step):
            raise TypeError(f"gdn_step: expected a callable, got {type(gdn_step).__name__}")
        c = model.config
        p = model.lm_head.weight
        self.model = model
        self.gdn_step = gdn_step
        self.conv = [torch.zeros(batch, c.conv_dim, c.linear_conv_kernel_dim, dtype=p.dtype,
                                 device=p.device) for _ in range(c.num_hidden_layers)]
        dk = c.linear_key_head_dim
        with torch.no_grad():
            self.layers = [dict(
                norm_in=1 + layer.input_layernorm.weight,
                proj=torch.cat([layer.linear_attn.in_proj_qkvz.weight,
                                layer.linear_attn.in_proj_ba.weight]),
                conv=layer.linear_attn.conv1d.weight[:, 0],
                A=-torch.exp(layer.linear_attn.A_log),
                # l2norm(x) scale = rms_norm(x, eps / dk) scale / sqrt(dk); q's scale 1/sqrt(dk)
                q_scale=torch.full((dk,), 1 / dk, dtype=p.dtype, device=p.device),
                k_scale=torch.full((dk,), 1 / math.sqrt(dk), dtype=p.dtype, device=p.device),
                norm_post=1 + layer.post_attention_layernorm.weight,
                gate_up=torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
            ) for layer in model.model.layers]
            self.norm_f = 1 + model.model.norm.weight

    @torch.no_grad()
    def step(self, ids):
        model, c = self.model, self.model.config
        d, eps = c.hidden_size, c.rms_norm_eps
        hk, hv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
        u = model.model.embed_tokens(ids)  # [b, d]
        for i, (layer, w) in enumerate(zip(model.model.layers, self.layers, strict=True)):
            m = layer.linear_attn
            proj = F.linear(F.rms_norm(u, (d,), w["norm_in"], eps), w["proj"])
            qkv, z, b, a = m.split_proj(*proj.split([proj.shape[-1] - 2 * hv, 2 * hv], -1))
            window = self.conv[i]  # updated in place: a CUDA graph may hold its address
            window.copy_(torch.cat([window[..., 1:], qkv[..., None]], dim=-1))
            q, k, v = F.silu((window * w["conv"]).sum(-1)).split(
                [c.key_dim, c.key_dim, c.value_dim], -1)
            q = F.rms_norm(_wide(q).reshape(-1, hk, dk), (dk,), w["q_scale"], L2_EPS / dk)
            k = F.rms_norm(_wide(k).reshape(-1, hk, dk), (dk,), w["k_scale"], L2_EPS / dk)
            if hv != hk:
                q, k = (t.repeat_interleave(hv // hk, dim=-2) for t in (q, k))
            y = self.gdn_step(i, q, k, v.reshape(-1, hv, c.linear_value_head_dim),
                              w["A"] * m.process_dt(a), torch.sigmoid(_wide(b)))  # [b, Hv, dv]
            u = u + m.out_proj(m.norm(y.to(z.dtype), z).reshape(y.shape[0], -1))
            gate, up = F.linear(F.rms_norm(u, (d,), w["norm_post"], eps), w["gate_up"]).chunk(2, -1)
            u = u + layer.mlp.down_proj(F.silu(gate) * up)
        return model.lm_head(F.rms_norm(u, (d,), self.norm_f, eps))


# --------------------------------------------------------------------------------------------
# checkpoints

# the per-head parameters and norms stay fp32 in a half-precision checkpoint (they are tiny,
# and A_log / dt_bias set the decay time constants the experiments study)
_KEEP_FP32 = ("A_log", "dt_bias", "norm")


def save(model: GDNLM, folder, dtype=torch.float16, metadata: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``folder``: matrices in ``dtype``,
    per-head parameters and norm weights in fp32. Returns the folder."""
    if not isinstance(model, GDNLM):
        raise TypeError(f"model: expected a GDNLM, got {type(model).__name__}")
    return save_checkpoint(model, folder, _KEEP_FP32, dtype, metadata)


def load(folder, dtype=torch.float32, device=None) -> GDNLM:
    """A ``GDNLM`` from a folder holding ``config.json`` and ``model.safetensors`` in the
    layout of ``transformers``' ``Qwen3NextForCausalLM`` with Gated DeltaNet layers and dense
    MLPs (a checkpoint of this module or of ``save_pretrained``); parameters in ``dtype``."""
    return load_checkpoint(
        folder, GDNLM, GDNConfig, tied_from="model.embed_tokens.weight",
        expected_what="the Qwen3NextForCausalLM tensors of Gated DeltaNet layers and dense MLPs",
        # multi-token-prediction heads of a Qwen3-Next checkpoint are not this model's
        ignored_prefixes=("mtp.",), dtype=dtype, device=device)
