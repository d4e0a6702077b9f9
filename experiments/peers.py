"""The peers' decode kernels, each given its inputs in its own layout: vLLM's and FLA's Triton
kernels and FlashInfer's CUDA kernels, imported from `--peers-dir` (default `.peers/`, built
by `scripts/peers/prepare.sh`). The shape decides the recurrence (`cases.BenchShape.kind`).

Mamba-2:

    vllm:update:<fmt>         vLLM 0.33.0 `selective_state_update`, fp32 / fp16 state
    vllm:nonflush|flush:<fmt> vLLM `selective_state_update_replayssm_output_only` (one checkpoint)
    flashinfer:update:<fmt>   FlashInfer 0.7.2.post1 `selective_state_update`
    flashinfer:nonflush|flush FlashInfer `checkpointing_ssu` (one checkpoint, ring of L + 1)

Inputs: bf16 `x, B, C` and raw `dt` (their serving dtype; FlashInfer's `selective_state_update`
takes fp32 dt, as its D/dt_bias dtype must equal dt's), A, D and dt_bias per head broadcast
with stride 0.

Gated DeltaNet (one token a sequence, q and k per key head, L2-normalised in the kernel with
scale d_k^-1/2, as Qwen3-Next is served):

    vllm:update:fp32|bf16     vLLM 0.33.0 `fused_recurrent_gated_delta_rule_packed_decode` (its
                              vendored FLA ops, `vllm/third_party/flash_linear_attention`): what
                              Qwen3-Next's layer calls for a batch of decode tokens
                              (VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE, on by default); the
                              state updated in place in its dtype
    fla:update:fp32|bf16      fla-core 0.6.0 `fused_recurrent_gated_delta_rule`, T = 1, state in
                              its default [dk, dv] layout; the final state comes back in fp32

A peer that cannot be imported raises `cases.Unavailable` with its reason, which the benchmark
records in its CSV instead of dropping the kernel.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tarfile
from pathlib import Path

import torch

from experiments.cases import (
    ACT,
    BenchShape,
    Case,
    KernelSpec,
    Unavailable,
    counter,
    ring_buffers,
    state_dtype,
    token_buffers,
)
from experiments.harness import Buffers

__all__ = ["build", "load", "normalised_qk", "FLASHINFER_UNPACK"]

_MODULES: dict[str, object] = {}
FLASHINFER_UNPACK = Path(os.environ.get("LOWPREC_PEERS_TMP", "/tmp/lowprec-peers")) / "flashinfer"


def _site(peers_dir: Path, peer: str) -> Path:
    """`<peers_dir>/<peer>/site`, first on sys.path when it is there."""
    site = Path(peers_dir) / peer / "site"
    if site.is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return site


def _not_importable(what: str, error: Exception, peer: str, path: Path, present: bool):
    """`Unavailable` for a peer whose import raised ``error``, pointing to prepare.sh when the
    ``path`` it is installed from is not ``present``."""
    reason = f"{what} not importable ({type(error).__name__}: {error})"
    if not present:
        reason += f"; {path} is missing: run scripts/peers/prepare.sh {peer}"
    return Unavailable(reason)


def _import_vllm(peers_dir: Path):
    """vLLM's Mamba decode kernels (from `<peers_dir>/vllm/site` when present)."""
    site = _site(peers_dir, "vllm")
    try:
        from vllm.model_executor.layers.mamba.ops import mamba_ssm
        from vllm.model_executor.layers.mamba.ops import (
            selective_state_update_replayssm_output_only as replay,
        )
    except Exception as error:
        return _not_importable("vllm kernels", error, "vllm", site, site.is_dir())
    return (mamba_ssm.selective_state_update,
            replay.selective_state_update_replayssm_output_only)


def _import_vllm_gdn(peers_dir: Path):
    """vLLM's GDN decode kernel (from `<peers_dir>/vllm/site` when present)."""
    site = _site(peers_dir, "vllm")
    try:
        from vllm.third_party.flash_linear_attention.ops.fused_recurrent import (
            fused_recurrent_gated_delta_rule_packed_decode,
        )
    except Exception as error:
        return _not_importable("vllm GDN kernel", error, "vllm", site, site.is_dir())
    return fused_recurrent_gated_delta_rule_packed_decode


def _import_fla(peers_dir: Path):
    """FLA's step-by-step GDN kernel (from `<peers_dir>/fla/site` when present)."""
    site = _site(peers_dir, "fla")
    try:
        from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
    except Exception as error:
        return _not_importable("fla", error, "fla", site, site.is_dir())
    return fused_recurrent_gated_delta_rule


def _import_flashinfer(peers_dir: Path):
    """FlashInfer's Mamba entry points; unpacks `<peers_dir>/flashinfer/flashinfer-peer.tar.xz`
    to /tmp (once) when flashinfer is not importable as installed."""
    archive = Path(peers_dir) / "flashinfer" / "flashinfer-peer.tar.xz"
    site = FLASHINFER_UNPACK / "site"
    try:
        if archive.is_file() and not (site / "flashinfer").is_dir():
            FLASHINFER_UNPACK.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archive) as tar:
                tar.extractall(FLASHINFER_UNPACK, filter="data")
        if (site / "flashinfer").is_dir():
            if str(site) not in sys.path:
                sys.path.insert(0, str(site))
            os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(FLASHINFER_UNPACK / "ws"))
        if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
            # an older torch: tvm-ffi would JIT-build its DLPack addon at import (minutes on
            # the GPU machine); its fallback converts tensors in Python, on torch's current stream
            os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
        # The prebuilt modules were linked against a stub libcuda without symbols, so they do
        # not name libcuda as a dependency; their driver calls (cuTensorMapEncodeTiled) resolve
        # only if the driver library is already loaded globally ("undefined symbol:
        # cuTensorMapEncodeTiled" otherwise).
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        from flashinfer.mamba.checkpointing_ssu import (
            allocate_checkpointing_ssu_scratch,
            checkpointing_ssu,
        )
        from flashinfer.mamba.selective_state_update import selective_state_update
    except Exception as error:
        return _not_importable("flashinfer", error, "flashinfer", archive, archive.is_file())
    return selective_state_update, checkpointing_ssu, allocate_checkpointing_ssu_scratch


_LOADERS = {"vllm": _import_vllm, "flashinfer": _import_flashinfer,
            "vllm-gdn": _import_vllm_gdn, "fla": _import_fla}


def load(name: str, peers_dir: Path):
    """The entry points of `name` (vllm, flashinfer: Mamba-2; vllm-gdn, fla: Gated DeltaNet),
    imported once a process, or raise `Unavailable`."""
    if name not in _LOADERS:
        raise ValueError(f"name: expected one of {list(_LOADERS)}, got {name!r}")
    if name not in _MODULES:
        _MODULES[name] = _LOADERS[name](peers_dir)
    loaded = _MODULES[name]
    if isinstance(loaded, Unavailable):
        raise loaded
    return loaded


def tied(params: dict, shape: BenchShape) -> dict:
    """A, D, dt_bias broadcast per head with stride 0, the layout both peers take
    (`A [nheads, headdim, dstate]`, `D, dt_bias [nheads, headdim]`)."""
    P, N = shape.headdim, shape.dstate
    return dict(
        A=params["A"][:, None, None].expand(-1, P, N),
        D=params["D"][:, None].expand(-1, P),
        dt_bias=params["dt_bias"][:, None].expand(-1, P),
    )


def _vllm(spec, shape, batch, window, cursor, b: Buffers, params, peers_dir) -> Case:
    """vLLM: `selective_state_update(state, x, dt, A, B, C, D, dt_bias, z, dt_softplus, out=)`
    with dt `[b, h, p]` stride 0 over p; the ReplaySSM output-only kernel with its ring
    (`x_cache [b, h, L, p]`, `dt_cache [b, h, L]` processed dt, `B_cache [b, g, L, n]`),
    `write_pos` = records before the step, `is_flush`, `bc_pre` fp32 scratch `[b, g, L]`."""
    ssu, replay_output_only = load("vllm", peers_dir)
    S, H, P, N, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    token_buffers(b, shape, batch)
    b.add("state", (S, H, P, N), state_dtype(spec.variant), "randn")
    per_head = tied(params, shape)
    if spec.step == "update":

        def launch(t):
            ssu(t["state"], t["x"], t["dt"][..., None].expand(-1, -1, P), per_head["A"],
                t["B"], t["C"], per_head["D"], per_head["dt_bias"], None, True, out=t["out"])

        return Case(spec, shape, batch, window, b, params, launch)

    ring_buffers(b, shape, batch, window)
    counter(b, "cursors", batch, cursor)
    b.add("is_flush", (S,), torch.bool, "const", spec.step == "flush")
    b.add("bc_pre", (S, G, window), torch.float32, "empty")

    def launch(t):
        replay_output_only(
            t["state"], t["x"], t["dt"][..., None].expand(-1, -1, P), per_head["A"], t["B"],
            t["C"], per_head["D"], per_head["dt_bias"], None, True, x_cache=t["ring_x"],
            dt_cache=t["ring_dt"], B_cache=t["ring_B"], bc_pre=t["bc_pre"],
            write_pos=t["cursors"], is_flush=t["is_flush"], max_cache_len=window, out=t["out"],
        )

    return Case(spec, shape, batch, window, b, params, launch)


def _flashinfer(spec, shape, batch, window, cursor, b: Buffers, params, peers_dir) -> Case:
    """FlashInfer: `selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
    out=)` (dt fp32 `[b, h, p]` stride 0 over p); `checkpointing_ssu(state, x_cache, B_cache,
    dt_cache, ring_start, prev_num_accepted, x, dt, A, B, C, out, D, z, dt_bias, dt_softplus,
    ...)` with T = 1 token per step (`x [b, 1, h, p]`), a ring of L + 1 rows (its window is the
    ring length minus T), ring_start 0, the host-owned `prev_num_accepted` = records before the
    step, and the two-kernel scratch allocated as its docstring asks (algorithm 'auto')."""
    ssu, checkpointing_ssu, scratch = load("flashinfer", peers_dir)
    _prebuild_failure(spec, shape, window, peers_dir)
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    per_head = tied(params, shape)
    b.add("state", (S, H, P, N), state_dtype(spec.variant), "randn")
    if spec.step == "update":
        token_buffers(b, shape, batch, dt_dtype=torch.float32)

        def launch(t):
            ssu(t["state"], t["x"], t["dt"][..., None].expand(-1, -1, P), per_head["A"],
                t["B"], t["C"], per_head["D"], None, per_head["dt_bias"], True, out=t["out"])

        return Case(spec, shape, batch, window, b, params, launch)

    token_buffers(b, shape, batch)
    ring_buffers(b, shape, batch, window + spec.ring_extra)
    counter(b, "ring_start", batch, 0)
    counter(b, "cursors", batch, cursor)
    scratch_sets = [scratch(S, H, 1, window, b.act, b.device) for _ in range(b.sets)]

    def launch(t):
        cb_scaled, cum_adt, cb_old = scratch_sets[t["set"]]
        checkpointing_ssu(
            t["state"], t["ring_x"], t["ring_B"], t["ring_dt"], t["ring_start"], t["cursors"],
            t["x"][:, None], t["dt"][:, None, :, None].expand(-1, 1, -1, P), per_head["A"],
            t["B"][:, None], t["C"][:, None], t["out"][:, None], per_head["D"], None,
            per_head["dt_bias"], True, cb_scaled=cb_scaled, cumAdt_vec=cum_adt, cb_old=cb_old,
        )

    return Case(spec, shape, batch, window, b, params, launch)


def _prebuild_failure(spec: KernelSpec, shape: BenchShape, window: int, peers_dir: Path) -> None:
    """Raise `Unavailable` when scripts/peers/prepare.sh could not compile the FlashInfer module
    this kernel needs (its report is `<peers_dir>/flashinfer/prebuild-report.tsv`): the same
    build on the GPU machine would fail too, after minutes of compiling."""
    report = Path(peers_dir) / "flashinfer" / "prebuild-report.tsv"
    if not report.is_file():
        return
    from flashinfer.jit.mamba.checkpointing_ssu import get_checkpointing_ssu_uri
    from flashinfer.jit.mamba.selective_state_update import get_selective_state_update_uri

    state = state_dtype(spec.variant)
    f32, i32 = torch.float32, torch.int32
    if spec.step == "update":
        uri = get_selective_state_update_uri(state, ACT, f32, f32, i32, None, shape.headdim,
                                             shape.dstate, 1, i32, torch.int64, 0) + "_sm90"
    else:
        uri = get_checkpointing_ssu_uri(state, ACT, ACT, f32, f32, i32, None, shape.headdim,
                                        shape.dstate, 1, window, shape.nheads // shape.ngroups,
                                        shape.ngroups, 0, False)
    for line in report.read_text().splitlines():
        name, _, status = line.partition("\t")
        if name == uri and status.startswith("failed"):
            raise Unavailable(f"FlashInfer module {uri} did not compile for sm_90a ({status})")


# --------------------------------------------------------------------------------------------
# Gated DeltaNet


def normalised_qk(q: torch.Tensor, k: torch.Tensor, shape: BenchShape) -> tuple:
    """q and k [slots, key heads, dk] as the peers' kernels use them, in fp64 and per value
    head: L2-normalised (`x / sqrt(sum x^2 + 1e-6)`), q times dk^-1/2, each key head repeated
    for its value heads (value head h reads key head h // (nheads / ngroups))."""
    def unit(x):
        x = x.double()
        return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)

    repeat = shape.nheads // shape.ngroups
    return ((unit(q) * shape.dstate**-0.5).repeat_interleave(repeat, dim=1),
            unit(k).repeat_interleave(repeat, dim=1))


def _fla(spec, shape, batch, window, b: Buffers, params, peers_dir) -> Case:
    """FLA: `fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=,
    output_final_state=True, use_qk_l2norm_in_kernel=True)` with T = 1: q, k [b, 1, key heads,
    dk], v [b, 1, h, dv], g (the log-decay) and beta [b, 1, h] fp32, the state [b, h, dk, dv]
    (FLA's default layout) in fp32 or bf16. It returns (o, final state in fp32): each set's
    pair is kept in its tensors, so no two sets' outputs share memory."""
    fused = load("fla", peers_dir)
    S, H, V, K, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    b.add("q", (S, 1, G, K), b.act, "randn")
    b.add("k", (S, 1, G, K), b.act, "randn")
    b.add("v", (S, 1, H, V), b.act, "randn")
    b.add("g", (S, 1, H), torch.float32, "log_decay")
    b.add("beta", (S, 1, H), torch.float32, "sigmoid")
    b.add("state", (S, H, K, V), state_dtype(spec.variant), "randn")

    def launch(t):
        t["y"], t["new_state"] = fused(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"],
                                       initial_state=t["state"], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)

    def reference(t):
        q, k = normalised_qk(t["q"][:, 0], t["k"][:, 0], shape)
        return (t["state"].double().transpose(-1, -2), q, k, t["v"][:, 0].double(),
                t["g"][:, 0].double(), t["beta"][:, 0].double())

    return Case(spec, shape, batch, window, b, params, launch, reference=reference,
                written=lambda t: (t["y"][:, 0], t["new_state"].transpose(-1, -2)))


def _vllm_gdn(spec, shape, batch, window, b: Buffers, params, peers_dir) -> Case:
    """vLLM: `fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias,
    scale, initial_state, out, ssm_state_indices, use_qk_l2norm_in_kernel=True)`: mixed_qkv
    [b, 2 key heads dk + h dv] (q, k, v packed, as the convolution leaves them), the raw gates
    a and b [b, h] (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), in the kernel),
    the state pool [slots + 1, h, dv, dk] updated in place at ssm_state_indices 1..b (row 0 is
    vLLM's null block, which the kernel skips), out [b, 1, h, dv]."""
    packed = load("vllm-gdn", peers_dir)
    S, H, V, K, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    b.add("mixed_qkv", (S, 2 * G * K + H * V), b.act, "randn")
    b.add("gate_a", (S, H), b.act, "dt_raw")
    b.add("gate_b", (S, H), b.act, "randn")
    b.add("state", (S + 1, H, V, K), state_dtype(spec.variant), "randn")
    counter(b, "indices", batch, list(range(1, S + 1)))
    b.add("out", (S, 1, H, V), b.act, "empty")

    def launch(t):
        packed(mixed_qkv=t["mixed_qkv"], a=t["gate_a"], b=t["gate_b"], A_log=params["A_log"],
               dt_bias=params["dt_bias"], scale=K**-0.5, initial_state=t["state"],
               out=t["out"], ssm_state_indices=t["indices"], use_qk_l2norm_in_kernel=True)

    def reference(t):
        mixed = t["mixed_qkv"].double()
        q, k = normalised_qk(mixed[:, :G * K].unflatten(1, (G, K)),
                             mixed[:, G * K:2 * G * K].unflatten(1, (G, K)), shape)
        v = mixed[:, 2 * G * K:].unflatten(1, (H, V))
        # softplus's threshold 20 is the kernel's
        g = -torch.exp(params["A_log"].double()) * torch.nn.functional.softplus(
            t["gate_a"].double() + params["dt_bias"].double())
        return t["state"][1:].double(), q, k, v, g, torch.sigmoid(t["gate_b"].double())

    return Case(spec, shape, batch, window, b, params, launch, reference=reference,
                written=lambda t: (t["out"][:, 0], t["state"][1:]))


def build(spec: KernelSpec, shape: BenchShape, batch: int, window: int, cursor, b: Buffers,
          params: dict, peers_dir: Path) -> Case:
    """A peer kernel's case (`cases.build_case` calls this for the peers' kernels)."""
    spec.check_shape(shape)
    if shape.kind == "gdn" and spec.impl == "vllm":
        return _vllm_gdn(spec, shape, batch, window, b, params, peers_dir)
    if spec.impl == "fla":
        return _fla(spec, shape, batch, window, b, params, peers_dir)
    if spec.impl == "vllm":
        return _vllm(spec, shape, batch, window, cursor, b, params, peers_dir)
    if spec.impl == "flashinfer":
        return _flashinfer(spec, shape, batch, window, cursor, b, params, peers_dir)
    raise ValueError(f"spec: expected a vllm, flashinfer or fla kernel, got {spec.name!r}")
