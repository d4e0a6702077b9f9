"""A byte-level Mamba-2 language model in plain PyTorch, in the layout of ``transformers``'
``Mamba2ForCausalLM``, with a parallel (chunked SSD) forward for training and a token-by-token
decode whose SSM state is kept by a pluggable stepper.

Layer ``l`` (``d = hidden_size``, ``E = num_heads * head_dim = expand * d``, ``g = n_groups``,
``N = state_size``, ``H = num_heads``, ``K = conv_kernel``):

    h      = RMSNorm(u) * norm.weight                                     backbone.layers.l.norm
    zxbcdt = in_proj(h)            split as  z [E] | xBC [E + 2 g N] | dt [H]
    xBC    = silu(causal depthwise conv1d_K(xBC) + conv1d.bias)           mixer.conv1d
    x, B, C = split(xBC, [E, g N, g N])                                   heads of x: [H, head_dim]
    dt     = softplus(dt + dt_bias), clamped to time_step_limit;  A = -exp(A_log)
    S_t    = exp(dt A) S_{t-1} + dt x B^T;   y = S_t C + D x              (lowprec.mamba2)
    y      = GroupRMSNorm_g(y * silu(z)) * norm.weight                    mixer.norm (gate first)
    u     += out_proj(y)                                                  mixer.out_proj

then ``logits = lm_head(RMSNorm(u) * norm_f.weight)``. Parameter names are those of
``Mamba2ForCausalLM`` (``backbone.embeddings``, ``backbone.layers.N.mixer.{in_proj, conv1d,
dt_bias, A_log, D, norm, out_proj}``, ``backbone.layers.N.norm``, ``backbone.norm_f``,
``lm_head``) and ``config.json`` uses its keys, so ``load(DIR)`` reads a real mamba2-130m
checkpoint saved by ``transformers`` (the gated norm is per group of ``E / g`` channels, as in
``mamba_ssm``; for ``g = 1`` every implementation agrees).

Checkpoints are ``model.safetensors`` + ``config.json``, through ``experiments.lm_checkpoint``
(``save_safetensors`` and ``load_safetensors`` are its reader and writer, exported here too).

The decode (``Decoder``) advances a batch of sequences one token at a time; each layer's conv
window lives in the decoder and its SSM step is a callable
``ssm_step(layer, x [b, H, P], dt [b, H] (raw), B [b, g, N], C [b, g, N]) -> y [b, H, P]``
that returns ``S C + D x`` and keeps the state however it likes (``ExactSSM``: the
``lowprec.mamba2.mamba2_step`` recurrence in the decoder's dtype; ``experiments.model_drift``:
one cache per precision policy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from experiments.lm_checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_checkpoint,
    load_safetensors,
    save_checkpoint,
    save_safetensors,
)
from lowprec import mamba2 as ref_mamba2

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "Mamba2Config",
    "Mamba2LM",
    "Decoder",
    "ExactSSM",
    "ssd_chunked",
    "save",
    "load",
    "save_safetensors",
    "load_safetensors",
]

# transformers' default time_step_limit: dt is not clamped
_TIME_STEP_LIMIT_DEFAULT = (0.0, float("inf"))


@dataclass
class Mamba2Config:
    """The keys of ``transformers.Mamba2Config`` this model uses (same names, same meaning)."""

    vocab_size: int = 256
    hidden_size: int = 192
    num_hidden_layers: int = 5
    num_heads: int = 6
    head_dim: int = 64
    state_size: int = 64
    n_groups: int = 1
    expand: int = 2
    conv_kernel: int = 4
    chunk_size: int = 64
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    rms_norm: bool = True
    tie_word_embeddings: bool = False
    time_step_limit: tuple = _TIME_STEP_LIMIT_DEFAULT
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)  # other keys of a loaded config.json, kept

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim",
                     "state_size", "n_groups", "expand", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.{name}: expected a positive int, got {value!r}")
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"config.num_heads * head_dim: expected expand * hidden_size = "
                f"{self.intermediate_size}, got {self.num_heads} * {self.head_dim}"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(f"config.n_groups: expected a divisor of num_heads="
                             f"{self.num_heads}, got {self.n_groups}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"config.hidden_act: expected 'silu', got {self.hidden_act!r}")
        if not self.rms_norm:
            raise ValueError("config.rms_norm: expected true (the gated RMSNorm), got false")
        limit = tuple(float(v) for v in self.time_step_limit)
        if len(limit) != 2 or not limit[0] <= limit[1]:
            raise ValueError(f"config.time_step_limit: expected [low, high], got "
                             f"{self.time_step_limit!r}")
        self.time_step_limit = limit

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def to_dict(self) -> dict:
        out = {**self.extra}
        out.update({k: v for k, v in asdict(self).items() if k != "extra"})
        limit = self.time_step_limit
        # JSON has no infinity; transformers writes this default as [0.0, Infinity] via
        # Python's json, which this module also reads
        out["time_step_limit"] = [limit[0], limit[1]]
        out["intermediate_size"] = self.intermediate_size
        out["model_type"] = "mamba2"
        out["architectures"] = ["Mamba2ForCausalLM"]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Mamba2Config:
        """A config from a config.json's object (transformers' Mamba2Config keys); other keys
        are kept in ``extra``."""
        if not isinstance(data, dict):
            raise ValueError(f"config: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim",
                               "state_size", "vocab_size") if k not in data]
        if missing:
            raise ValueError(f"config: expected the Mamba2Config keys {missing}, got none")
        if data.get("model_type", "mamba2") != "mamba2":
            raise ValueError(f"config.model_type: expected 'mamba2', got "
                             f"{data.get('model_type')!r}")
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        if "time_step_limit" in kwargs and kwargs["time_step_limit"] is not None:
            kwargs["time_step_limit"] = tuple(_json_float(v) for v in kwargs["time_step_limit"])
        elif "time_step_limit" in kwargs:
            kwargs["time_step_limit"] = _TIME_STEP_LIMIT_DEFAULT
        config = cls(**kwargs, extra=extra)
        if "intermediate_size" in extra and extra["intermediate_size"] != config.intermediate_size:
            raise ValueError(f"config.intermediate_size: expected expand * hidden_size = "
                             f"{config.intermediate_size}, got {extra['intermediate_size']}")
        return config


def _json_float(value):
    """A number of a config.json: transformers writes infinity as ``{"__float__": "Infinity"}``
    (JSON has no literal for it)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    return value


# --------------------------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in groups of ``dim / groups``
    channels; with ``gate``, ``x`` is first multiplied by ``silu(gate)`` (mamba_ssm's
    ``norm_before_gate=False``)."""

    def __init__(self, dim: int, eps: float, groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.groups = groups

    def forward(self, x, gate=None):
        if gate is not None:
            x = x * F.silu(gate)
        shape = x.shape
        x = x.reshape(*shape[:-1], self.groups, shape[-1] // self.groups)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.reshape(shape) * self.weight


class Mixer(nn.Module):
    """One Mamba-2 mixer; parameter names as in transformers' ``Mamba2Mixer``."""

    def __init__(self, c: Mamba2Config):
        super().__init__()
        self.c = c
        e, h = c.intermediate_size, c.num_heads
        self.in_proj = nn.Linear(c.hidden_size, e + c.conv_dim + h, bias=c.use_bias)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim,
                                padding=c.conv_kernel - 1, bias=c.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = RMSNorm(e, c.layer_norm_epsilon, c.n_groups)
        self.out_proj = nn.Linear(e, c.hidden_size, bias=c.use_bias)

    def split_proj(self, zxbcdt):
        c = self.c
        return torch.split(zxbcdt, [c.intermediate_size, c.conv_dim, c.num_heads], dim=-1)

    def split_xbc(self, xbc):
        c = self.c
        gn = c.n_groups * c.state_size
        x, B, C = torch.split(xbc, [c.intermediate_size, gn, gn], dim=-1)
        lead = x.shape[:-1]
        return (x.reshape(*lead, c.num_heads, c.head_dim),
                B.reshape(*lead, c.n_groups, c.state_size),
                C.reshape(*lead, c.n_groups, c.state_size))

    def process_dt(self, dt):
        dt = F.softplus(dt + self.dt_bias)
        low, high = self.c.time_step_limit
        if (low, high) != _TIME_STEP_LIMIT_DEFAULT:
            dt = dt.clamp(low, high)
        return dt

    def forward(self, h):
        """Parallel form: ``h [b, T, d] -> [b, T, d]``."""
        T = h.shape[1]
        z, xbc, dt = self.split_proj(self.in_proj(h))
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :T].transpose(1, 2))
        x, B, C = self.split_xbc(xbc)
        A = -torch.exp(self.A_log.to(x.dtype))
        y, _ = ssd_chunked(x, self.process_dt(dt), A, B, C, self.c.chunk_size)
        y = y + self.D[:, None] * x
        y = y.reshape(*y.shape[:2], -1)
        return self.out_proj(self.norm(y, z))


class Block(nn.Module):
    def __init__(self, c: Mamba2Config):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon)
        self.mixer = Mixer(c)


class Backbone(nn.Module):
    def __init__(self, c: Mamba2Config):
        super().__init__()
        self.embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm_f = RMSNorm(c.hidden_size, c.layer_norm_epsilon)


def ssd_chunked(x, dt, A, B, C, chunk: int):
    """The Mamba-2 recurrence of a whole sequence from a zero state, chunk by chunk.

    ``x [b, T, H, P]``, ``dt [b, T, H]`` (processed), ``A [H]``, ``B, C [b, T, g, N]``; returns
    ``(y [b, T, H, P], S_T [b, H, P, N])`` with ``y_t = S_t C_t`` (no ``D x``). Inside a chunk
    of ``Q`` tokens with ``c_i = sum_{l<=i} dt_l A`` (cumulative within the chunk):

        y_i = sum_{j<=i} exp(c_i - c_j) dt_j (C_i . B_j) x_j  +  exp(c_i) S_in C_i
        S_out = exp(c_Q) S_in + sum_j exp(c_Q - c_j) dt_j x_j B_j^T

    and the chunk states are chained in a loop over the ``T / Q`` chunks. Padding tokens get
    ``dt = 0``, which leaves the state unchanged.
    """
    b, T, H, P = x.shape
    g, N = B.shape[2], B.shape[3]
    r = H // g
    pad = (-T) % chunk
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    n = x.shape[1] // chunk
    x = x.reshape(b, n, chunk, g, r, P)
    dt = dt.reshape(b, n, chunk, g, r)
    B = B.reshape(b, n, chunk, g, N)
    C = C.reshape(b, n, chunk, g, N)
    cum = torch.cumsum(dt * A.reshape(g, r), dim=2)  # [b, n, Q, g, r]
    seg = cum[:, :, :, None] - cum[:, :, None, :]  # [b, n, Qi, Qj, g, r]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    # masked before exp: above the diagonal c_i - c_j > 0 could overflow
    decay = torch.exp(seg.masked_fill(~causal[:, :, None, None], -math.inf))
    cb = torch.einsum("bnigk,bnjgk->bnijg", C, B)  # [b, n, Qi, Qj, g]
    w = decay * cb[..., None] * dt[:, :, None]  # [b, n, Qi, Qj, g, r]
    y = torch.einsum("bnijgr,bnjgrp->bnigrp", w, x)
    to_end = torch.exp(cum[:, :, -1:] - cum) * dt  # [b, n, Q, g, r]
    states = torch.einsum("bnjgr,bnjgrp,bnjgk->bngrpk", to_end, x, B)
    chunk_decay = torch.exp(cum[:, :, -1])  # [b, n, g, r]
    S = torch.zeros(b, g, r, P, N, dtype=states.dtype, device=x.device)
    entering = []
    for i in range(n):
        entering.append(S)
        S = chunk_decay[:, i, :, :, None, None] * S + states[:, i]
    s_in = torch.stack(entering, dim=1)  # [b, n, g, r, P, N]
    y = y + torch.einsum("bnigk,bngrpk->bnigrp", C, s_in) * torch.exp(cum)[..., None]
    y = y.reshape(b, n * chunk, H, P)[:, :T]
    return y, S.reshape(b, H, P, N)


class Mamba2LM(nn.Module):
    """``Mamba2ForCausalLM``'s parameters and forward; ``forward(ids [b, T]) -> logits``."""

    def __init__(self, config: Mamba2Config):
        super().__init__()
        if not isinstance(config, Mamba2Config):
            raise TypeError(f"config: expected a Mamba2Config, got {type(config).__name__}")
        self.config = config
        self.backbone = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def init_weights(self, seed: int) -> Mamba2LM:
        """mamba_ssm's initialisation, drawn from a generator seeded with ``seed``: ``A`` in
        [1, 16], ``dt`` log-uniform in [time_step_min, time_step_max] (floor time_step_floor)
        through ``dt_bias = softplus^-1(dt)``, ``D = 1``, linear and conv layers uniform with
        bound 1/sqrt(fan_in), embeddings N(0, 0.02)."""
        c = self.config
        gen = torch.Generator().manual_seed(seed)

        def uniform(t, bound):
            with torch.no_grad():
                t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 * bound
                        - bound)

        with torch.no_grad():
            self.backbone.embeddings.weight.copy_(
                torch.randn(self.backbone.embeddings.weight.shape, generator=gen) * 0.02)
            for block in self.backbone.layers:
                m = block.mixer
                for lin in (m.in_proj, m.out_proj):
                    uniform(lin.weight, 1 / math.sqrt(lin.in_features))
                    if lin.bias is not None:
                        lin.bias.zero_()
                uniform(m.conv1d.weight, 1 / math.sqrt(c.conv_kernel))
                if m.conv1d.bias is not None:
                    uniform(m.conv1d.bias, 1 / math.sqrt(c.conv_kernel))
                lo, hi = math.log(c.time_step_min), math.log(c.time_step_max)
                dt = torch.exp(torch.rand(c.num_heads, generator=gen) * (hi - lo) + lo)
                dt = dt.clamp(min=c.time_step_floor)
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
                m.A_log.copy_(torch.log(torch.rand(c.num_heads, generator=gen) * 15 + 1))
                m.D.fill_(1.0)
                m.norm.weight.fill_(1.0)
                block.norm.weight.fill_(1.0)
            self.backbone.norm_f.weight.fill_(1.0)
            if not c.tie_word_embeddings:
                uniform(self.lm_head.weight, 1 / math.sqrt(c.hidden_size))
        return self

    def forward(self, input_ids):
        u = self.backbone.embeddings(input_ids)
        for block in self.backbone.layers:
            u = u + block.mixer(block.norm(u))
        return self.lm_head(self.backbone.norm_f(u))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


# --------------------------------------------------------------------------------------------
# token-by-token decode


class ExactSSM:
    """The SSM state of every layer kept exactly in the decoder's dtype:
    ``lowprec.mamba2.mamba2_step`` (``S C + D x``, dt processed there)."""

    def __init__(self, model: Mamba2LM, batch: int, dtype, device=None):
        c = model.config
        self.model = model
        self.states = [torch.zeros(batch, c.num_heads, c.head_dim, c.state_size, dtype=dtype,
                                   device=device) for _ in range(c.num_hidden_layers)]

    def __call__(self, layer, x, dt, B, C):
        m = self.model.backbone.layers[layer].mixer
        A = -torch.exp(m.A_log)
        if m.c.time_step_limit != _TIME_STEP_LIMIT_DEFAULT:
            dt = m.process_dt(dt)
            y, self.states[layer] = ref_mamba2.mamba2_step(
                self.states[layer], x, dt, A, B, C, D=m.D, dt_softplus=False)
        else:
            y, self.states[layer] = ref_mamba2.mamba2_step(
                self.states[layer], x, dt, A, B, C, D=m.D, dt_bias=m.dt_bias)
        return y


class Decoder:
    """Token-by-token decode of ``batch`` sequences; the model's parameters are used in their
    own dtype and device (``model.to(torch.float64)`` for an fp64 decode). ``step(ids [b])``
    returns the logits ``[b, vocab]`` after that token; ``ssm_step`` keeps the SSM states."""

    def __init__(self, model: Mamba2LM, batch: int, ssm_step):
        if not isinstance(model, Mamba2LM):
            raise TypeError(f"model: expected a Mamba2LM, got {type(model).__name__}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        if not callable(ssm_step):
            raise TypeError(f"ssm_step: expected a callable, got {type(ssm_step).__name__}")
        c = model.config
        p = model.lm_head.weight
        self.model = model
        self.ssm_step = ssm_step
        self.conv = [torch.zeros(batch, c.conv_dim, c.conv_kernel, dtype=p.dtype,
                                 device=p.device) for _ in range(c.num_hidden_layers)]

    @torch.no_grad()
    def step(self, ids):
        model = self.model
        u = model.backbone.embeddings(ids)  # [b, d]
        for i, block in enumerate(model.backbone.layers):
            m = block.mixer
            z, xbc, dt = m.split_proj(m.in_proj(block.norm(u)))
            window = self.conv[i]  # updated in place: a CUDA graph may hold its address
            window.copy_(torch.cat([window[..., 1:], xbc[..., None]], dim=-1))
            xbc = (window * m.conv1d.weight[:, 0]).sum(-1)
            if m.conv1d.bias is not None:
                xbc = xbc + m.conv1d.bias
            x, B, C = m.split_xbc(F.silu(xbc))
            y = self.ssm_step(i, x, dt, B, C)  # S C + D x
            u = u + m.out_proj(m.norm(y.reshape(y.shape[0], -1), z))
        return model.lm_head(model.backbone.norm_f(u))


# --------------------------------------------------------------------------------------------
# checkpoints

# the per-head parameters and norms stay fp32 in a half-precision checkpoint (they are tiny,
# and A_log / dt_bias set the decay time constants the experiments study)
_KEEP_FP32 = ("A_log", "dt_bias", ".D", "norm")


def save(model: Mamba2LM, folder, dtype=torch.float16, metadata: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``folder``: matrices in ``dtype``,
    per-head parameters and norm weights in fp32. Returns the folder."""
    if not isinstance(model, Mamba2LM):
        raise TypeError(f"model: expected a Mamba2LM, got {type(model).__name__}")
    return save_checkpoint(model, folder, _KEEP_FP32, dtype, metadata)


def load(folder, dtype=torch.float32, device=None) -> Mamba2LM:
    """A ``Mamba2LM`` from a folder holding ``config.json`` and ``model.safetensors`` in the
    layout of ``transformers``' ``Mamba2ForCausalLM`` (a checkpoint of this module or of
    ``save_pretrained``); parameters converted to ``dtype``."""
    return load_checkpoint(folder, Mamba2LM, Mamba2Config,
                           tied_from="backbone.embeddings.weight",
                           expected_what="the Mamba2ForCausalLM tensors", dtype=dtype,
                           device=device)
