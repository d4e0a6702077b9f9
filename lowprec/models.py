"""Model shapes as data: what the memory-traffic model (`lowprec.traffic`) is evaluated at.

A `ModelShape` names a model's recurrent layers (`SSMLayerShape`: Mamba-2, Gated DeltaNet or
Kimi Delta Attention) and its attention layers (`AttentionShape`), with the number of each and
the storage formats of the state, the KV cache and the activations. Only shapes are kept: no
weights, no code. Format names are those of `lowprec.formats` (`"fp32"`, `"bf16"`, ...).

Registered shapes (`names()`):

    name             ssm layers                              attention layers
    nemotron3-super  40 x Mamba-2: 128 heads, d_v 64,        8 x (2 KV heads x 128), fp8_e4m3 KV
                     d_k 128, 8 groups, fp32 state
    qwen3-next-80b   36 x Gated DeltaNet: 32 value heads,     12 x (2 KV heads x 256), bf16 KV
                     16 key heads, d_v 128, d_k 128,
                     fp32 state
    mamba2-2.7b      64 x Mamba-2: 80 heads, d_v 64,          none (`attention` is None)
                     d_k 128, 1 group, fp32 state
    kimi-linear-48b  20 x Kimi Delta Attention: 32 heads,     7 x MLA (one latent of 576 a
                     d_v 128, d_k 128, one key a head,        token), bf16 KV
                     fp32 state

All use bf16 activations. `source` on each shape says where its numbers come from. The kernel
benchmarks (`experiments.kernel_bench`, `cute_kernels.bench_read`) time the Mamba-2 layers of
nemotron3-super and mamba2-2.7b and take their numbers from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowprec import formats

__all__ = ["SSMLayerShape", "AttentionShape", "ModelShape", "get", "names"]

SSM_KINDS = ("mamba2", "gdn", "kda")


def _check_element_format(name: str, value) -> None:
    """A KV cache or activations are stored element by element, with no scale: a plain format
    of `lowprec.formats` (the names `lowprec.traffic.element_bytes` prices). Checked when the
    shape is made, not when it is first priced, for the reason `SSMLayerShape` gives."""
    plain = [n for n in formats.names() if formats.get(n).scale is None]
    if not isinstance(value, str) or value not in plain:
        raise ValueError(f"{name}: expected one of {plain} (unscaled formats), got {value!r}")


@dataclass(frozen=True)
class SSMLayerShape:
    """One recurrent layer, per sequence.

    kind: "mamba2", "gdn" or "kda" (decides which quantities a ReplaySSM record holds; KDA is
        GDN with a decay per channel of d_k).
    nheads: state heads (Mamba-2 heads; GDN/KDA value heads); the state is
        `[nheads, d_v, d_k]`.
    d_v, d_k: state rows and columns (Mamba-2 headdim and dstate; GDN/KDA value and key head
        dims).
    ngroups: heads sharing one `B` (Mamba-2 groups) or one `k` (GDN/KDA key heads).
    state_format: the format the model's own decode keeps the state in: a name of
        `lowprec.formats` (the names `lowprec.traffic.state_bytes` prices), whose block, if
        it has one, divides d_k.
    """

    kind: str
    nheads: int
    d_v: int
    d_k: int
    ngroups: int
    state_format: str = "fp32"

    def __post_init__(self):
        if self.kind not in SSM_KINDS:
            raise ValueError(f"kind: expected one of {SSM_KINDS}, got {self.kind!r}")
        for name in ("nheads", "d_v", "d_k", "ngroups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.nheads % self.ngroups:
            raise ValueError(
                f"ngroups: expected a divisor of nheads={self.nheads}, got {self.ngroups}"
            )
        # checked here, not when the state is first priced: a misspelt name or a block that
        # does not divide d_k made a shape that every traffic sweep then failed on
        if not isinstance(self.state_format, str) or self.state_format not in formats.names():
            raise ValueError(
                f"state_format: expected one of {formats.names()}, got {self.state_format!r}"
            )
        block = formats.get(self.state_format).block
        if block not in (None, formats.ROW) and self.d_k % block:
            raise ValueError(
                f"state_format: expected a format whose block divides d_k={self.d_k}, got "
                f"{self.state_format!r} (blocks of {block})"
            )

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """`(nheads, d_v, d_k)`: one sequence's state in one layer."""
        return (self.nheads, self.d_v, self.d_k)

    @property
    def state_elements(self) -> int:
        return self.nheads * self.d_v * self.d_k


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's KV cache: per token, `kv_tensors` vectors of `head_dim` for each of
    `n_kv_heads` heads: 2 (a key and a value) for multi-head or grouped-query attention, 1 for
    multi-head latent attention (MLA), whose one cached latent serves keys and values."""

    n_kv_heads: int
    head_dim: int
    kv_format: str = "bf16"
    kv_tensors: int = 2

    def __post_init__(self):
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        _check_element_format("kv_format", self.kv_format)
        if self.kv_tensors not in (1, 2) or isinstance(self.kv_tensors, bool):
            raise ValueError(f"kv_tensors: expected 1 (MLA) or 2 (a key and a value), "
                             f"got {self.kv_tensors!r}")


@dataclass(frozen=True)
class ModelShape:
    """A hybrid model: `n_ssm_layers` recurrent layers and `n_attention_layers` attention ones.
    `attention` is None exactly when there are none (a pure SSM model keeps no KV cache)."""

    name: str
    source: str
    n_ssm_layers: int
    ssm: SSMLayerShape
    n_attention_layers: int
    attention: AttentionShape | None
    act_format: str = "bf16"

    def __post_init__(self):
        if not isinstance(self.n_ssm_layers, int) or self.n_ssm_layers < 1:
            raise ValueError(
                f"n_ssm_layers: expected a positive integer, got {self.n_ssm_layers!r}"
            )
        if not isinstance(self.n_attention_layers, int) or self.n_attention_layers < 0:
            raise ValueError(
                f"n_attention_layers: expected a non-negative integer, "
                f"got {self.n_attention_layers!r}"
            )
        _check_element_format("act_format", self.act_format)
        # a KV shape beside 0 attention layers would be priced nowhere, and None beside some
        # would fail in the first KV count: both are a mistake in the entry
        if self.n_attention_layers and not isinstance(self.attention, AttentionShape):
            raise ValueError(
                f"attention: expected an AttentionShape for n_attention_layers="
                f"{self.n_attention_layers}, got {self.attention!r}"
            )
        if not self.n_attention_layers and self.attention is not None:
            raise ValueError(
                f"attention: expected None for n_attention_layers=0, got {self.attention!r}"
            )


NEMOTRON3_SUPER = ModelShape(
    name="nemotron3-super",
    source=(
        "Nemotron-3-Super as specified in the kit's design (DESIGN.md's traffic model): "
        "Mamba-2 nheads 128, headdim 64, dstate 128, ngroups 8, 40 layers, fp32 state; "
        "8 attention layers with 2 KV heads of 128 and an fp8 KV cache; bf16 activations"
    ),
    n_ssm_layers=40,
    ssm=SSMLayerShape(kind="mamba2", nheads=128, d_v=64, d_k=128, ngroups=8),
    n_attention_layers=8,
    attention=AttentionShape(n_kv_heads=2, head_dim=128, kv_format="fp8_e4m3"),
)

QWEN3_NEXT_80B = ModelShape(
    name="qwen3-next-80b",
    source=(
        "Qwen3-Next-80B-A3B as we read its public config.json: num_hidden_layers 48, "
        "full_attention_interval 4 (36 Gated DeltaNet + 12 full-attention layers), "
        "linear_num_value_heads 32, linear_num_key_heads 16, linear_value_head_dim 128, "
        "linear_key_head_dim 128, num_key_value_heads 2, head_dim 256, bf16. The state is "
        "priced in fp32 (the kit's reference arm) and the KV cache in bf16 (no fp8 KV assumed)"
    ),
    n_ssm_layers=36,
    ssm=SSMLayerShape(kind="gdn", nheads=32, d_v=128, d_k=128, ngroups=16),
    n_attention_layers=12,
    attention=AttentionShape(n_kv_heads=2, head_dim=256, kv_format="bf16"),
)

MAMBA2_2_7B = ModelShape(
    name="mamba2-2.7b",
    source=(
        "state-spaces/mamba2-2.7b: d_model 2560, expand 2, headdim 64 (80 heads), d_state 128, "
        "ngroups 1 (the Mamba2 layer defaults); 64 layers, all Mamba-2, no attention "
        "(its config.json's n_layer 64 and empty attn_layer_idx, from memory: this machine "
        "cannot fetch the file to check). The state is priced in fp32 (the kit's reference "
        "arm) and the activations in bf16"
    ),
    n_ssm_layers=64,
    ssm=SSMLayerShape(kind="mamba2", nheads=80, d_v=64, d_k=128, ngroups=1),
    n_attention_layers=0,
    attention=None,
)

KIMI_LINEAR_48B = ModelShape(
    name="kimi-linear-48b",
    source=(
        "Kimi-Linear-48B-A3B as we read its public config.json: num_hidden_layers 27, "
        "linear_attn_config full_attn_layers [4, 8, 12, 16, 20, 24, 27] (20 KDA + 7 MLA "
        "layers: KDA:MLA 3:1, the last layer MLA too), num_heads 32, head_dim 128 (d_k = d_v "
        "= 128, one key a head); MLA kv_lora_rank 512 + qk_rope_head_dim 64, cached as one "
        "576-wide latent a token, bf16. The state is priced in fp32 (the kit's reference arm)"
    ),
    n_ssm_layers=20,
    ssm=SSMLayerShape(kind="kda", nheads=32, d_v=128, d_k=128, ngroups=32),
    n_attention_layers=7,
    attention=AttentionShape(n_kv_heads=1, head_dim=576, kv_format="bf16", kv_tensors=1),
)

_MODELS = {m.name: m for m in (NEMOTRON3_SUPER, QWEN3_NEXT_80B, MAMBA2_2_7B, KIMI_LINEAR_48B)}


def names() -> list[str]:
    """Names accepted by `get`, in a fixed order."""
    return list(_MODELS)


def get(name: str | ModelShape) -> ModelShape:
    """The model shape called `name` (a `ModelShape` passes through)."""
    if isinstance(name, ModelShape):
        return name
    if name not in _MODELS:
        raise ValueError(f"model: expected one of {names()}, got {name!r}")
    return _MODELS[name]
