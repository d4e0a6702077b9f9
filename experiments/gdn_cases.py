"""The Gated DeltaNet cases of the kernel benchmark (`experiments.cases` comes here for a shape
of kind 'gdn'): the CuTe GDN kernels' buffers, the bytes every GDN kernel must move, and the
fp64 check against `lowprec.gdn`.

**Kernels**, named as their Mamba-2 twins (the shape decides the recurrence):

    cute:nonflush:nvfp4       cute_kernels.gdn_replay_decode.gdn_replay_output on a
                              GDNReplayCache (fp16 SR + nvfp4): the non-flush step
    cute:flush:fp16sr+nvfp4   gdn_replay_flush on the same cache: the flush
    cute:nonflush:fp32        gdn_replay_output, cache (fp32, rn, none): the single-copy FP32
    cute:flush:fp32           gdn_replay_flush, the same cache          ReplaySSM baseline
    cute:update:fp32 | bf16   gdn_state_update on a GDNStateCache: the conventional step
    vllm:update:fp32 | bf16   vLLM's decode for Qwen3-Next (`experiments.peers`)
    fla:update:fp32 | bf16    FLA's fused_recurrent_gated_delta_rule (`experiments.peers`)

`gdn_replay_output` and `gdn_replay_flush` launch their kernel and the one-thread-a-slot
counter kernel; both are timed, as a decoder calls them.

**Inputs** as the layer produces them: q and k of unit L2 norm (the kit's kernels take them
normalised; the peers normalise in their kernel, `use_qk_l2norm_in_kernel=True`, as vLLM
serves Qwen3-Next, so they get randn), v randn, beta = sigmoid(randn), g = -exp(randn / 2) /
tau with tau log-uniform in [1, 1000] (short and long memory side by side); the ring's records
alike, u randn. The kit's kernels take q and k per value head (a model with fewer key heads
repeats them); the peers per key head (`ngroups`), as they serve.

**Bytes** per (slot, head), `a` bytes an activation (bf16: 2); the CuTe kernels' own counts
(`traffic_bytes` of gdn_replay_output, gdn_replay_flush, gdn_state_update; the tests hold the
two equal):

    state      each copy read and each copy written, in its format with its scales
               (`lowprec.traffic.state_bytes`)
    ring       non-flush: `cursor` records of u (fp32), k (a), g (fp32) read,
               4 d_v + a d_k + 4 each; one record u, v, k, g, beta appended,
               4 d_v + (d_v + d_k) a + 8
               flush: `cursor` records of v, k (a), g, beta (fp32) read and one appended,
               (d_v + d_k) a + 8 each
    token      q and k, d_k a each, per value head (the kit) or per key head (the peers); v read
               and y written, d_v a each; g and beta fp32 (the kit, FLA: 8) or vLLM's raw
               gates a and b (2 a)

Not counted: A_log and dt_bias (per head, shared by all slots), the cursor and flush counters,
vLLM's slot indices.

**Check** (`check_kernel`): one launch on 3 slots (non-flush: cursors 0, (L - 2) / 2 and L - 2;
flush: L - 1) against `lowprec.gdn` in fp64, on the values the kernel read (the NVFP4 read copy
dequantised exactly, bf16 states as stored, the peers' q and k normalised as their kernels do).
Checked: y; the record's u (non-flush); the new state (update; flush: the recurrence copy) and
the written read copy. Pass: every value within `2^-7 (|ref| + rms)`, `rms` the reference's
root mean square over its (slot, head). This admits bf16 outputs and bf16 state stores (2^-9
relative), fp16 SR (below 2^-10) and fp32 arithmetic, and rejects a wrong record, decay, gate
or key head (an error of a fraction of the head's scale). The head's rms stands where Mamba-2
takes the reference on absolute values: the delta rule's terms cancel (I - beta k k^T has norm
at most 1), while on absolute values each step multiplies by up to 1 + beta, so that magnitude
grows as (1 + beta)^L over a window and would admit anything. The written read copy: within a
quarter of its block amax (`cases.lo_ratio`, as for Mamba-2). The value returned is the
largest error over its bound (pass: <= 1).
"""

from __future__ import annotations

import torch

from experiments.cases import (
    ACT_BYTES,
    SEED,
    BenchShape,
    Case,
    KernelSpec,
    bound_ratio,
    build_case,
    check_cursors,
    counter,
    cute,
    dequantize,
    lo_buffers,
    lo_ratio,
    state_dtype,
)
from experiments.harness import Buffers
from lowprec import gdn, traffic

__all__ = ["GATE_BYTES", "kernel_bytes", "build_cute", "check_kernel", "replay_formats",
           "rms_ratio"]

# bytes of a value head's gate inputs: g and beta in fp32 (the kit, FLA), vLLM's raw a and b
GATE_BYTES = {"cute": 8, "fla": 8, "vllm": 2 * ACT_BYTES}
RING = ("ring_u", "ring_v", "ring_k", "ring_g", "ring_beta")


def kernel_bytes(spec: KernelSpec, shape: BenchShape, batch: int, cursor: int) -> int:
    """Bytes one call of a GDN kernel must move for `batch` slots at `cursor` (module
    docstring, **Bytes**)."""
    if spec.impl not in GATE_BYTES:
        raise ValueError(f"spec: expected a kernel of {list(GATE_BYTES)}, got {spec.name!r}")
    H, V, K, a = shape.nheads, shape.headdim, shape.dstate, ACT_BYTES
    per_slot = sum(traffic.state_bytes(shape.ssm, fmt) for fmt in spec.reads + spec.writes)
    if spec.step == "nonflush":
        per_slot += H * (cursor * (4 * V + a * K + 4)
                         + spec.records_written * (4 * V + (V + K) * a + 8))
    elif spec.step == "flush":
        per_slot += H * (cursor + spec.records_written) * ((V + K) * a + 8)
    key_heads = H if spec.impl == "cute" else shape.ngroups
    per_slot += 2 * key_heads * K * a + H * (2 * V * a + GATE_BYTES[spec.impl])
    return batch * per_slot


# --------------------------------------------------------------------------------------------
# The CuTe GDN kernels' buffers


def replay_formats(spec: KernelSpec) -> tuple[str, str, str]:
    """(hi_format, hi_rounding, lo_format) of a GDN replay kernel's cache: the two-precision
    pairing, or the single FP32 copy (variant fp32)."""
    return ("fp32", "rn", "none") if spec.variant == "fp32" else ("fp16", "sr", "nvfp4")


def token_buffers(b: Buffers, shape: BenchShape, batch: int) -> None:
    """q, k (unit norm) [slots, nheads, dk], v and the output y [slots, nheads, dv] in the
    activation dtype, g and beta [slots, nheads] fp32."""
    S, H, V, K = batch, shape.nheads, shape.headdim, shape.dstate
    b.add("q", (S, H, K), b.act, "unit", K)
    b.add("k", (S, H, K), b.act, "unit", K)
    b.add("v", (S, H, V), b.act, "randn")
    b.add("g", (S, H), torch.float32, "log_decay")
    b.add("beta", (S, H), torch.float32, "sigmoid")
    b.add("out", (S, H, V), b.act, "empty")


def ring_buffers(b: Buffers, shape: BenchShape, batch: int, length: int) -> None:
    """The record ring of `length` positions, in GDNReplayCache's layout."""
    S, H, V, K, L = batch, shape.nheads, shape.headdim, shape.dstate, length
    b.add("ring_u", (S, H, L, V), torch.float32, "randn")
    b.add("ring_v", (S, H, L, V), b.act, "randn")
    b.add("ring_k", (S, H, L, K), b.act, "unit", K)
    b.add("ring_g", (S, H, L), torch.float32, "log_decay")
    b.add("ring_beta", (S, H, L), torch.float32, "sigmoid")


def build_cute(spec: KernelSpec, shape: BenchShape, batch: int, window: int, cursor,
               b: Buffers, p: dict) -> Case:
    """A CuTe GDN kernel's case: its cache over each set's tensors and a launch of its public
    function (module docstring, **Kernels**)."""
    S, H, V, K = batch, shape.nheads, shape.headdim, shape.dstate
    cache_mod = cute("gdn_cache")
    token_buffers(b, shape, batch)
    if spec.step == "update":
        su = cute("gdn_state_update")
        b.add("state", (S, H, V, K), state_dtype(spec.variant), "randn")
        caches = [cache_mod.GDNStateCache(state, spec.variant) for state in b["state"]]

        def launch(t):
            su.gdn_state_update(caches[t["set"]], t["q"], t["k"], t["v"], t["g"], t["beta"],
                                out=t["out"])

        return Case(spec, shape, batch, window, b, p, launch, reference=_cute_reference,
                    written=lambda t: (t["out"], t["state"]))

    decode = cute("gdn_replay_decode")
    hi_format, hi_rounding, lo_format = replay_formats(spec)
    # the two-precision non-flush step reads the read copy alone: hi left unfilled
    reads_hi = spec.step == "flush" or lo_format == "none"
    b.add("hi", (S, H, V, K), state_dtype(hi_format), "randn" if reads_hi else "empty")
    if lo_format != "none":
        lo_buffers(b, shape, batch, lo_format)
    ring_buffers(b, shape, batch, window)
    counter(b, "cursors", batch, cursor)
    counter(b, "flushes", batch, 0)
    caches = []
    for i in range(b.sets):
        t = b.at(i)
        caches.append(cache_mod.GDNReplayCache(
            hi=t["hi"], lo=t.get("lo"), lo_scales=t.get("lo_scales"),
            lo_global=t.get("lo_global"), **{name: t[name] for name in RING},
            cursors=t["cursors"], flushes=t["flushes"], hi_format=hi_format,
            hi_rounding=hi_rounding, lo_format=lo_format, window=window, seed=SEED))
    fn = decode.gdn_replay_output if spec.step == "nonflush" else decode.gdn_replay_flush

    def launch(t):
        fn(caches[t["set"]], t["q"], t["k"], t["v"], t["g"], t["beta"], out=t["out"])

    start = b.bases["cursors"].clone()
    return Case(spec, shape, batch, window, b, p, launch,
                reset=lambda: b.bases["cursors"].copy_(start))


def _cute_reference(t: dict) -> tuple:
    return tuple(t[name].double() for name in ("state", "q", "k", "v", "g", "beta"))


# --------------------------------------------------------------------------------------------
# Check


def rms_ratio(x: torch.Tensor, ref: torch.Tensor, dims: int) -> float:
    """The largest |x - ref| over `2^-7 (|ref| + rms)`, rms over the last `dims` dimensions
    (a head's values: module docstring, **Check**)."""
    ref = ref.double()
    rms = ref.square().mean(dim=tuple(range(-dims, 0)), keepdim=True).sqrt()
    return bound_ratio((x.double() - ref).abs(), 2.0**-7 * (ref.abs() + rms) + 1e-30)


def check_kernel(spec: KernelSpec, shape: BenchShape, window: int, device, peers_dir, seed: int,
                 act: torch.dtype) -> float:
    """Run a GDN kernel once on 3 slots and return the largest error over its bound (module
    docstring, **Check**); raises `cases.Unavailable` if it cannot run."""
    cursors = check_cursors(spec, window)
    case = build_case(spec, shape, 3, window, cursors, 1, device, seed, peers_dir, act)
    t = case.bufs.at(0)
    t["set"] = 0
    before = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor)}
    if "out" in t:
        t["out"].fill_(float("nan"))  # an element the kernel does not write fails
    case.launch(t)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    if spec.step == "update":
        y, new = gdn.gdn_step(*case.reference(before))
        out, state = case.written(t)
        return max(rms_ratio(out, y, 1), rms_ratio(state, new, 2))
    return _replay_ratio(spec, t, before, cursors)


def _replay_ratio(spec: KernelSpec, t: dict, before: dict, cursors: list[int]) -> float:
    """A CuTe GDN replay step against lowprec.gdn: the current record placed in the ring at
    each slot's cursor, then u and y (non-flush) or the folded state and y (flush)."""
    f64 = {k: v.double() for k, v in before.items() if v.is_floating_point()}
    count = torch.tensor(cursors, device=f64["q"].device)
    rows = torch.arange(len(cursors), device=count.device)
    ring = {name: f64[name].clone() for name in RING}
    for name in ("v", "k", "g", "beta"):
        ring[f"ring_{name}"][rows, :, count] = f64[name]
    _, _, lo_format = replay_formats(spec)
    if spec.step == "nonflush":
        state = f64["hi"] if lo_format == "none" else dequantize(before, lo_format)
        u = gdn.gdn_replay_u(state, *(ring[name] for name in RING), count + 1)
        ring["ring_u"][rows, :, count] = u
        y = gdn.gdn_replay_output(state, ring["ring_u"], ring["ring_k"], ring["ring_g"],
                                  count + 1, f64["q"])
        return max(rms_ratio(t["out"], y, 1), rms_ratio(t["ring_u"][rows, :, count], u, 1))
    new = gdn.gdn_replay_flush(f64["hi"], *(ring[name] for name in RING[1:]), count + 1)
    y = torch.einsum("bhvk,bhk->bhv", new, f64["q"])
    ratios = [rms_ratio(t["out"], y, 1), rms_ratio(t["hi"], new, 2)]
    if lo_format != "none":
        ratios.append(lo_ratio(t, lo_format, new))
    return max(ratios)
