"""Does a language model's next-token distribution drift when its SSM state is kept in a low
precision format, and after how many tokens?

Teacher-forced decode of ``segments`` text segments of ``tokens`` bytes each, token by token,
with every layer's SSM state kept by each precision policy, against the same decode with an
exact state. The model is a checkpoint folder (``--model``) of a Mamba-2 LM
(``experiments.mamba2_lm``, ``Mamba2ForCausalLM``'s layout) or a Gated DeltaNet LM
(``experiments.gdn_lm``, ``Qwen3NextForCausalLM``'s); its recurrence (the CSV's
``recurrence`` column, ``mamba2`` or ``gdn``) is read from its ``config.json``. Per recorded
position ``t`` (tokens consumed; a log grid of ``--per-octave``
points per doubling, plus the last) and segment:

    kl          KL(exact || policy) of the next-byte distributions, in nats (fp64 from the logits)
    dlogp       log p_policy(true next byte) - log p_exact(true next byte)
    top1_agree  1 if the policy's argmax (first index on ties) is a maximum of the exact logits:
                a tie in the exact logits counts as agreement

Policies (``lowprec.policies``; ``--policies`` takes ``ARM:FORMAT[:ROUNDING]`` items; FORMAT
fp64 is an exact control on the reference backend, whose KL is 0 exactly):

    every_step       conventional: the state stored in FORMAT every token (RN or SR)
    shared           one checkpoint in FORMAT, written once per window of L tokens
    separate_exact   recurrence copy exact, read copy FORMAT (RN)
    separate_fp16sr  recurrence copy FP16 with SR, read copy FORMAT (RN): the kit's scheme

Backends. ``reference`` (CPU): the model in fp64, one ``lowprec.policies.Simulator`` per policy
and layer, the exact arm ``Policy('exact')`` (fp64). ``emulation`` (GPU; CPU under Triton's
interpreter for tiny runs): the model in fp32, every layer of every policy one emulation cache
(``emulation.state_update.StateCache`` for every_step and for the exact arm, an fp32 state;
``emulation.replay_decode.ReplayCache`` for the windowed arms: separate_exact keeps an fp32
recurrence copy, shared keeps hi = lo = FORMAT, so only element formats with RN), all
segments as the slots of one batch; on CUDA each chunk of ``--graph-tokens`` tokens is one
CUDA graph replay (a token is some 300 small launches). A GDN model's states are kept the same
way by ``experiments.model_drift_gdn`` (``Simulator('gdn')``; ``emulation.gdn_state_update``
and ``emulation.gdn_replay_decode``).

Cells. A policy is one cell of `experiments.sharding.run_sweep`: its own decode of the
segments (batch ``S``), compared with the exact arm's logits, which each process decodes once
(batch ``S``, the same shapes as a policy's) and keeps at the grid positions. A policy's rows
therefore do not depend on the other policies or on the process that ran it, and a policy
whose rounding is the identity gives exactly the exact arm's logits (KL 0). The price against
one batched decode of every arm: P + 1 decodes of S rows per process instead of one of
(P + 1) S rows, the same arithmetic but P + 1 times the launches per token on the GPU, and
each extra rank decodes the exact arm once more. ``torchrun --nproc-per-node N -m
experiments.model_drift ...`` splits the policies over N ranks (``cuda:LOCAL_RANK`` each, or
gloo on the CPU) and writes the same CSV bytes; a rerun with the same ``--out`` skips the
policies finished (``<out>.cells/``). ``--time-limit-s`` bounds each decode: the exact arm's,
then each policy's up to the tokens the exact arm reached.

Text: ``--data DIR`` (``experiments.train_lm prepare-data``): segment ``s`` starts at held-out
block ``s`` of ``experiments.kjv_corpus`` (at most 4 segments of at most 131,072 tokens; the
last target byte is the byte after the block). Without ``--data``: consecutive pieces of the
committed 64 KiB held-out slice.

Outputs: the CSV (columns ``CSV_COLUMNS``, floats ``%.6e``, written atomically) with a
``.meta.json`` (the config, the positions reached, the sharding record), then the figure
from the CSV: KL against position, log-log, the median over segments with a band from the
smallest to the largest, one panel per arm (RN and SR apart for every_step). ``--pareto``
redraws "which format should I use" from two committed CSVs: for each policy the KL over
the last octave of positions (mean over those grid positions and the segments) against the
per-token decode time ``kernel_bench`` measured (``PARETO_KERNELS``).

    python -m experiments.model_drift --preset toy        # CPU reference, about a minute
    python -m experiments.model_drift --preset gdn-toy    # the same for a toy GDN LM
    bash scripts/model_drift_gpu.sh                       # the 131,072-token GPU run
    bash scripts/model_drift_gpu.sh gdn                   # the same for the GDN LM
    python -m experiments.model_drift --pareto            # redraw the Pareto figure
    torchrun --nproc-per-node 4 -m experiments.model_drift --preset gpu   # policies on 4 GPUs
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.model_drift")

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments import gdn_lm, kjv_corpus
from experiments import mamba2_lm as lm
from experiments._common import (
    Column,
    OneLineParser,
    Schema,
    atomic_file,
    file_sha256,
    read_table,
    save_small_png,
    write_meta,
)
from experiments._interrupt import ctrl_c_as_keyboard_interrupt, report_interrupt
from experiments.model_drift_gdn import HI_COPY
from experiments.sharding import HELP as SHARDING_HELP
from experiments.sharding import add_arguments as add_sharding_arguments
from lowprec import formats
from lowprec.policies import Policy, Simulator, make_policy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "model_drift"
# the toy preset's model: train_lm's toy preset on the committed held-out slice, trained here on
# first use (seconds on a CPU) rather than committed; the GPU model goes to RESULTS / "model"
TOY_MODEL = ROOT / "runs" / "model_drift_toy_model"
GDN_TOY_MODEL = ROOT / "runs" / "model_drift_gdn_toy_model"
GDN_RESULTS = RESULTS / "gdn"
# config.json's model_type -> the recurrence (the CSV's column) and the model's module
RECURRENCES = {"mamba2": ("mamba2", lm), "qwen3_next": ("gdn", gdn_lm)}
SOURCE = "experiments.model_drift"
CSV_COLUMNS = ("model", "recurrence", "arm", "format", "rounding", "window", "segment",
               "position", "kl", "dlogp", "top1_agree")
ARMS = ("every_step", "shared", "separate_exact", "separate_fp16sr")
ELEMENT_FORMATS = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
KL_FLOOR = 1e-12  # the figure's floor on the log axis (KL 0 would vanish)

# kernel_bench rows for each policy's per-token decode time (batch 256, window L, status ok,
# median over runs). "derived": two-precision token time plus (L-1)/L of the difference of
# the non-flush step between the read-copy format and nvfp4 (mean over the timed cursors);
# the flush is taken as the fp16sr+nvfp4 flush. Policies absent here have no kernel.
#
#   policy                          kernel_bench kernel                      how
#   every_step fp16 rn              cute:token:conventional-fp16             measured
#   every_step fp16 sr              cute:token:conventional-fp16sr           measured
#   separate_fp16sr nvfp4           cute:token:two-precision                 measured
#   separate_fp16sr fp8_e4m3        cute:nonflush:fp8_e4m3 vs :nvfp4         derived
#   separate_fp16sr fp16            cute:nonflush:fp16 vs :nvfp4             derived
#   (exact fp32 state, KL 0)        cute:token:conventional-fp32             vertical line
PARETO_KERNELS = {
    ("every_step", "fp16", "rn"): ("cute:token:conventional-fp16", None),
    ("every_step", "fp16", "sr"): ("cute:token:conventional-fp16sr", None),
    ("separate_fp16sr", "nvfp4", "rn"): ("cute:token:two-precision", None),
    ("separate_fp16sr", "fp8_e4m3", "rn"): ("cute:token:two-precision", "cute:nonflush:fp8_e4m3"),
    ("separate_fp16sr", "fp16", "rn"): ("cute:token:two-precision", "cute:nonflush:fp16"),
}
PARETO_EXACT_KERNEL = "cute:token:conventional-fp32"


@dataclass(frozen=True)
class PolicySpec:
    arm: str
    fmt: str
    rounding: str = "rn"

    @property
    def label(self) -> str:
        return f"{self.arm} {self.fmt} {self.rounding.upper()}"


def parse_policies(text: str) -> tuple[PolicySpec, ...]:
    """``ARM:FORMAT[:ROUNDING],...`` (rounding default rn) -> specs; ValueError on a bad item."""
    specs = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"--policies: expected ARM:FORMAT[:ROUNDING], got {item!r}")
        arm, fmt, rounding = (*parts, "rn") if len(parts) == 2 else parts
        if arm not in ARMS:
            raise ValueError(f"--policies: expected an arm in {list(ARMS)}, got {arm!r} in "
                             f"{item!r}")
        if fmt not in formats.names():
            raise ValueError(f"--policies: expected a format in {formats.names()}, got {fmt!r} "
                             f"in {item!r}")
        if rounding not in ("rn", "sr"):
            raise ValueError(f"--policies: expected rounding rn or sr, got {rounding!r}")
        if arm.startswith("separate") and rounding != "rn":
            raise ValueError(f"--policies: expected rn for {arm}'s read copy, got {item!r}")
        specs.append(PolicySpec(arm, fmt, rounding))
    if not specs:
        raise ValueError("--policies: expected at least one ARM:FORMAT, got none")
    if len(set(specs)) != len(specs):
        raise ValueError(f"--policies: expected distinct policies, got {text!r}")
    return tuple(specs)


# the toy's three: a conventional bf16 state, a shared and a two-precision NVFP4 checkpoint
# (a conventional state is rounded every token, the reference's costliest step)
REFERENCE_POLICIES = "every_step:bf16:rn,shared:nvfp4:rn,separate_fp16sr:nvfp4"
GPU_POLICIES = (
    "every_step:fp16:rn,every_step:fp16:sr,every_step:bf16:rn,every_step:bf16:sr,"
    "every_step:fp8_e4m3:rn,every_step:fp8_e4m3:sr,every_step:nvfp4:rn,every_step:nvfp4:sr,"
    "shared:fp16:rn,shared:bf16:rn,shared:fp8_e4m3:rn,separate_exact:nvfp4,"
    "separate_fp16sr:nvfp4,separate_fp16sr:mxfp4,separate_fp16sr:fp8_e4m3,separate_fp16sr:fp16"
)


@dataclass(frozen=True)
class Config:
    """Everything a run depends on (``out``, ``plot`` and ``progress`` change no number)."""

    model: str = str(TOY_MODEL / "model")
    data: str = ""
    backend: str = "reference"
    device: str = "cpu"
    tokens: int = 2048
    segments: int = 1
    window: int = 16
    seed: int = 0
    per_octave: int = 8
    policies: str = REFERENCE_POLICIES
    graph_tokens: int = 32
    time_limit_s: float = 0.0  # 0: none; else each decode stops there, keeping what it recorded
    out: str = str(RESULTS / "model_drift_toy.csv")
    plot: str = ""
    progress: bool = True


# the GDN GPU run's four policies (with the exact arm, five decodes of 131,072 tokens fit
# one ~9-minute job beside the training): the two-precision scheme's NVFP4 and fp8 read
# copies against a shared fp8 checkpoint and a conventional bf16 state
GDN_GPU_POLICIES = ("every_step:bf16:rn,shared:fp8_e4m3:rn,separate_fp16sr:nvfp4,"
                    "separate_fp16sr:fp8_e4m3")

PRESETS = {
    "toy": Config(),
    "gpu": Config(model=str(RESULTS / "model"), data=str(ROOT / "runs" / "kjv"),
                  backend="emulation", device="cuda",
                  tokens=131_072, segments=4,
                  policies=GPU_POLICIES, out=str(RESULTS / "model_drift_gpu.csv")),
    "gdn-toy": Config(model=str(GDN_TOY_MODEL / "model"),
                      out=str(GDN_RESULTS / "model_drift_toy.csv")),
    "gdn-gpu": Config(model=str(GDN_RESULTS / "model"), data=str(ROOT / "runs" / "kjv"),
                      backend="emulation", device="cuda", tokens=131_072, segments=4,
                      policies=GDN_GPU_POLICIES, out=str(GDN_RESULTS / "model_drift_gpu.csv")),
}
# the toy presets' models: train_lm's toy preset of the arch, trained on first use
TOY_MODELS = {str(TOY_MODEL / "model"): ("mamba2", TOY_MODEL),
              str(GDN_TOY_MODEL / "model"): ("gdn", GDN_TOY_MODEL)}


# --------------------------------------------------------------------------------------------
# text and grid


def log_grid(tokens: int, per_octave: int) -> list[int]:
    """Positions ``round(2^(k / per_octave))`` for k >= 0 up to ``tokens``, and ``tokens``."""
    points = {round(2 ** (k / per_octave)) for k in range(int(per_octave * math.log2(tokens)) + 1)}
    return sorted(p for p in points | {tokens} if 1 <= p <= tokens)


def load_segments(c: Config) -> torch.Tensor:
    """``[segments, tokens + 1]`` byte ids (module docstring)."""
    n = c.tokens + 1
    if c.data:
        text = kjv_corpus.load(c.data)
        starts = [i * kjv_corpus.BLOCK for i in range(len(text) // kjv_corpus.BLOCK)
                  if i % kjv_corpus.EVERY == kjv_corpus.EVERY - 1]
        if c.segments > len(starts) or c.tokens > kjv_corpus.BLOCK:
            raise ValueError(f"--segments/--tokens: expected at most {len(starts)} segments of at "
                             f"most {kjv_corpus.BLOCK} tokens, got {c.segments} of {c.tokens}")
        pieces = [text[s:s + n] for s in starts[:c.segments]]
    else:
        text = kjv_corpus.heldout_slice()
        if c.segments * n > len(text):
            raise ValueError(f"--segments * (--tokens + 1): expected at most {len(text)} bytes of "
                             f"the committed slice (or pass --data), got {c.segments} * {n}")
        pieces = [text[i * n:(i + 1) * n] for i in range(c.segments)]
    return torch.tensor([list(p) for p in pieces], dtype=torch.int64)


def token_metrics(exact: torch.Tensor, policy: torch.Tensor, target: torch.Tensor):
    """``(kl, dlogp, agree)`` each ``[P, S]`` from ``exact [S, V]``, ``policy [P, S, V]`` logits
    and ``target [S]``, in fp64 (module docstring)."""
    le = F.log_softmax(exact.double(), dim=-1)
    lp = F.log_softmax(policy.double(), dim=-1)
    kl = (le.exp() * (le - lp)).sum(-1)
    t = target[None, :, None].expand(lp.shape[0], -1, 1)
    dlogp = (lp.gather(-1, t) - le[None].expand_as(lp).gather(-1, t))[..., 0]
    top = policy.argmax(-1, keepdim=True)  # [P, S, 1]
    best = exact.max(-1, keepdim=True).values  # [S, 1]
    agree = exact[None].expand_as(policy).gather(-1, top)[..., 0] == best[None, :, 0]
    return kl, dlogp, agree


# --------------------------------------------------------------------------------------------
# SSM steppers


def _arm_policy(spec: PolicySpec, c: Config) -> Policy:
    return make_policy(spec.arm, spec.fmt, spec.rounding, window=c.window, seed=c.seed)


class ReferenceSSM:
    """The SSM states of ``arms`` (a `PolicySpec` each, None for the exact state) by
    ``lowprec.policies.Simulator`` (fp64), one per arm and layer; rows ``arm * S + segment``."""

    def __init__(self, model: lm.Mamba2LM, arms, c: Config):
        mc = model.config
        self.model, self.S = model, c.segments
        policies = [Policy("exact", window=c.window) if s is None else _arm_policy(s, c)
                    for s in arms]
        self.sims = [[Simulator("mamba2", p, c.segments, mc.num_heads, mc.head_dim,
                                mc.state_size, dtype=torch.float64)
                      for _ in range(mc.num_hidden_layers)] for p in policies]

    def __call__(self, layer, x, dt, B, C):
        m = self.model.backbone.layers[layer].mixer
        dt = m.process_dt(dt)
        A = -torch.exp(m.A_log)
        a = torch.exp(dt * A)
        v = dt[..., None] * x
        r = m.c.num_heads // m.c.n_groups
        k = B.repeat_interleave(r, dim=1)
        q = C.repeat_interleave(r, dim=1)
        S = self.S
        ys = [sims[layer].step(a[i * S:(i + 1) * S], v[i * S:(i + 1) * S],
                               k[i * S:(i + 1) * S], q[i * S:(i + 1) * S])
              for i, sims in enumerate(self.sims)]
        return torch.cat(ys) + m.D[:, None] * x


class EmulationSSM:
    """The SSM states of ``arms`` (None for the exact state) in emulation caches (module
    docstring), one per arm and layer; rows ``arm * S + segment``."""

    def __init__(self, model: lm.Mamba2LM, arms, c: Config):
        from emulation.replay_decode import ReplayCache
        from emulation.state_update import StateCache

        mc = model.config
        self.model, self.S = model, c.segments
        self.check = c.device == "cpu"  # on CUDA no per-call counter read (a stream sync)
        shape = (c.segments, mc.num_heads, mc.head_dim, mc.state_size)
        self.caches = []
        for spec in arms:
            layers = []
            for _ in range(mc.num_hidden_layers):
                if spec is None or spec.arm == "every_step":
                    fmt, rnd = ("fp32", "rn") if spec is None else (spec.fmt, spec.rounding)
                    layers.append(StateCache.empty(*shape, format=fmt, rounding=rnd, seed=c.seed,
                                                   device=c.device))
                    continue
                hi = HI_COPY.get(spec.arm, (spec.fmt, spec.rounding))
                layers.append(ReplayCache.empty(
                    *shape, ngroups=mc.n_groups, window=c.window, hi_format=hi[0],
                    hi_rounding=hi[1], lo_format=spec.fmt, seed=c.seed,
                    act_dtype=torch.float32, device=c.device))
            self.caches.append(layers)

    def __call__(self, layer, x, dt, B, C):
        from emulation.replay_decode import ReplayCache, mamba2_replay_decode
        from emulation.state_update import mamba2_state_update

        m = self.model.backbone.layers[layer].mixer
        A = -torch.exp(m.A_log)
        S = self.S
        # one copy each: a row block of a contiguous tensor is contiguous, as the kernels need
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
        ys = []
        for i, layers in enumerate(self.caches):
            cache = layers[layer]
            rows = slice(i * S, (i + 1) * S)
            args = (cache, x[rows], dt[rows], A, B[rows], C[rows], m.D, None, m.dt_bias)
            if isinstance(cache, ReplayCache):
                ys.append(mamba2_replay_decode(*args, check_counters=self.check))
            else:
                ys.append(mamba2_state_update(*args, output_from="stored",
                                              check_counters=self.check))
        return torch.cat(ys)


def check_backend(c: Config, specs) -> None:
    recurrence = recurrence_of(c.model)
    if c.backend == "emulation":
        for s in specs:
            if s.fmt == "fp64":
                raise ValueError(f"--policies: fp64 is the reference's exact control, not a "
                                 f"kernel format, got {s.label}")
            if s.arm == "shared" and (s.fmt not in ELEMENT_FORMATS or s.rounding != "rn"):
                raise ValueError(f"--policies: the emulation keeps shared only with rn and an "
                                 f"element format {list(ELEMENT_FORMATS)}, got {s.label}")
        if recurrence == "mamba2" and lm.Mamba2Config.from_dict(
                _read_config(c.model)).time_step_limit != (0.0, float("inf")):
            raise ValueError("--model: the emulation applies no time_step_limit; expected the "
                             "default (0, inf)")


def _read_config(folder) -> dict:
    import json

    path = Path(folder) / lm.CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"--model: expected {path} (train it with `python -m "
                         f"experiments.train_lm`), it does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: expected JSON, got {err}") from None


def _model_type(folder) -> str:
    kind = _read_config(folder).get("model_type", "mamba2")
    if kind not in RECURRENCES:
        raise ValueError(f"--model: expected a model_type in {sorted(RECURRENCES)} in "
                         f"{Path(folder) / lm.CONFIG_NAME}, got {kind!r}")
    return kind


def recurrence_of(folder) -> str:
    """The recurrence of the checkpoint at ``folder`` from its config.json: ``mamba2``
    (model_type mamba2) or ``gdn`` (qwen3_next)."""
    return RECURRENCES[_model_type(folder)][0]


def load_model(folder, dtype, device):
    """The checkpoint's model (``mamba2_lm.Mamba2LM`` or ``gdn_lm.GDNLM``)."""
    return RECURRENCES[_model_type(folder)][1].load(folder, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------
# run


def model_name(folder: Path) -> str:
    data = _read_config(folder)
    return str(data.get("name") or data.get("_name_or_path") or Path(folder).resolve().name)


def validate(c: Config) -> tuple[PolicySpec, ...]:
    """The config's policies, after the checks that need no decode (policies, backend, model
    folder, text); ValueError in one line."""
    specs = parse_policies(c.policies)
    check_backend(c, specs)
    _read_config(c.model)
    load_segments(c)
    return specs


def _decode(c: Config, keeper, model, ids: torch.Tensor, tokens: int, on_logits,
            desc: str) -> int:
    """Teacher-forced decode of the rows of ``ids`` (``[rows, >= tokens]``) for ``tokens``
    tokens, ``on_logits(position, logits [rows, V])`` after each (position = tokens consumed);
    on CUDA chunks of ``c.graph_tokens`` tokens are CUDA graph replays. Returns the tokens
    decoded: ``tokens``, or fewer when ``c.time_limit_s`` stopped it."""
    from tqdm import tqdm

    device = ids.device
    family = gdn_lm if isinstance(model, gdn_lm.GDNLM) else lm
    decoder = family.Decoder(model, ids.shape[0], keeper)
    bar = tqdm(total=tokens, desc=desc, unit="tok", disable=not c.progress, file=sys.stderr,
               dynamic_ncols=True, smoothing=0.05)
    use_graph = device.type == "cuda" and c.graph_tokens > 0
    G = c.graph_tokens
    t = 0
    start = time.time()

    def over_time():
        return bool(c.time_limit_s) and time.time() - start > c.time_limit_s

    with torch.no_grad():
        warm = min(tokens, G) if use_graph else tokens
        stream = torch.cuda.Stream(device) if use_graph else None
        if use_graph:  # the caches were zeroed on the current stream: the warm-up reads them
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if use_graph else _null():
            for _ in range(warm):  # also compiles the kernels before a graph captures them
                on_logits(t + 1, decoder.step(ids[:, t]))
                t += 1
                bar.update(1)
        if use_graph:
            torch.cuda.current_stream(device).wait_stream(stream)
            static_ids = torch.empty(G, ids.shape[0], dtype=torch.int64, device=device)
            static_logits = torch.empty(G, ids.shape[0], model.config.vocab_size,
                                        dtype=model.lm_head.weight.dtype, device=device)
            graph = torch.cuda.CUDAGraph()
            captured = t + G <= tokens
            if captured:
                static_ids.copy_(ids[:, t:t + G].T)
                with torch.cuda.graph(graph):  # capturing runs nothing: tokens t..t+G-1 below
                    for g in range(G):
                        static_logits[g].copy_(decoder.step(static_ids[g]))
            while captured and t + G <= tokens and not over_time():
                static_ids.copy_(ids[:, t:t + G].T)
                graph.replay()
                for g in range(G):
                    on_logits(t + g + 1, static_logits[g])
                t += G
                bar.update(G)
        while t < tokens and not (t % 64 == 0 and over_time()):
            on_logits(t + 1, decoder.step(ids[:, t]))
            t += 1
            bar.update(1)
    bar.close()
    if t < tokens:
        print(f"{desc}: time limit {c.time_limit_s:g} s: stopped after {t} of {tokens} tokens",
              file=sys.stderr)
    return t


# one entry per process: the model, the text and the exact arm's logits at the grid positions
_EXACT_CACHE: dict = {}


def _keeper(c: Config, model, arms):
    if isinstance(model, gdn_lm.GDNLM):
        from experiments.model_drift_gdn import EmulationGDN, ReferenceGDN

        return (ReferenceGDN if c.backend == "reference" else EmulationGDN)(model, arms, c)
    return (ReferenceSSM if c.backend == "reference" else EmulationSSM)(model, arms, c)


def exact_state_logits(c: Config):
    """``(model, ids [S, tokens + 1], reached, {position: exact logits [S, V]})`` for the
    config, the exact arm decoded once per process (every policy cell of the process reuses
    it); ``reached`` is the tokens it decoded (fewer than ``tokens`` under a time limit)."""
    key = replace(c, policies="", out="", plot="", progress=False)
    if key in _EXACT_CACHE:
        return _EXACT_CACHE[key]
    device = torch.device(c.device)
    dtype = torch.float64 if c.backend == "reference" else torch.float32
    if c.backend == "reference":  # small ops: threads only wait on each other
        torch.set_num_threads(1)
    model = load_model(c.model, dtype, device)
    ids = load_segments(c).to(device)
    grid = set(log_grid(c.tokens, c.per_octave))
    found = {}

    def keep(position, logits):
        if position in grid:
            found[position] = logits.clone()

    with torch.cuda.device(device) if device.type == "cuda" else _null():
        reached = _decode(c, _keeper(c, model, [None]), model, ids, c.tokens, keep,
                          f"decode the exact state x {c.segments} segments")
    _EXACT_CACHE.clear()
    _EXACT_CACHE[key] = (model, ids, reached, found)
    return _EXACT_CACHE[key]


def run_cell(c: Config, spec: PolicySpec) -> list[tuple]:
    """The CSV rows of one policy (a cell): its own decode of the ``S`` segments against the
    process's exact arm (`exact_state_logits`), so a policy's rows do not depend on which
    other policies run, or where: segment-major, positions increasing."""
    model, ids, reached, exact = exact_state_logits(c)
    device = ids.device
    found = []  # (position, kl [1, S], dlogp, agree) on the device until the end

    def record(position, logits):
        if position in exact:
            found.append((position, *token_metrics(exact[position], logits[None],
                                                   ids[:, position])))

    with torch.cuda.device(device) if device.type == "cuda" else _null():
        _decode(c, _keeper(c, model, [spec]), model, ids, reached, record,
                f"decode {spec.label} x {c.segments} segments")
    name = model_name(Path(c.model))
    recurrence = "gdn" if isinstance(model, gdn_lm.GDNLM) else "mamba2"
    return [(name, recurrence, spec.arm, spec.fmt, spec.rounding, c.window, s, position,
             f"{kl[0, s].item():.6e}", f"{dlogp[0, s].item():.6e}", int(agree[0, s].item()))
            for s in range(c.segments) for position, kl, dlogp, agree in found]


def run(c: Config) -> list[tuple]:
    """Every policy's rows in this process, in ``--policies`` order (module docstring)."""
    specs = validate(c)
    return [row for spec in specs for row in run_cell(c, spec)]


def cell_key(spec: PolicySpec) -> str:
    return f"{spec.arm}:{spec.fmt}:{spec.rounding}"


def sweep_arguments(c: Config) -> dict:
    """What determines the rows, for the cell store's fingerprint: the config without its
    output paths and progress, the device's kind only (``cuda:LOCAL_RANK`` differs per rank),
    and the checkpoint's and text's bytes (a retrained model at the same path is new)."""
    settings = {k: v for k, v in asdict(c).items() if k not in ("out", "plot", "progress")}
    settings["device"] = torch.device(c.device).type
    weights = Path(c.model) / lm.WEIGHTS_NAME
    settings["model_sha256"] = file_sha256(weights) if weights.is_file() else None
    settings["config_sha256"] = file_sha256(Path(c.model) / lm.CONFIG_NAME)
    return settings


def sweep(c: Config, command: str, *, keep_cells: bool = False):
    """Every policy cell through `experiments.sharding.run_sweep` (this process, or split
    over the ranks under ``torchrun``): the CSV at ``c.out`` in ``--policies`` order, then its
    meta.json with the sharding record. Returns the `Sweep` (its ``frame`` None on ranks
    other than 0)."""
    import pandas as pd

    from experiments.sharding import run_sweep

    specs = validate(c)
    arguments = sweep_arguments(c)

    def one_cell(spec: PolicySpec):
        return pd.DataFrame(run_cell(c, spec), columns=list(CSV_COLUMNS))

    def meta(out: Path, seconds: float, record: dict) -> None:
        config = {k: v for k, v in arguments.items() if not k.endswith("sha256")}
        frame = read_csv(out)
        write_meta(out, command, seconds, config, device=c.device,
                   extra={"experiment": SOURCE, "model_sha256": arguments["model_sha256"],
                          "positions_reached": int(frame["position"].max()),
                          "sharding": record})

    return run_sweep(specs, one_cell, out=c.out, arguments=arguments, key=cell_key,
                     write_csv=lambda frame, path: write_csv(
                         path, frame.itertuples(index=False, name=None)),
                     write_meta=meta, keep_cells=keep_cells,
                     progress=10.0 if c.progress else None)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def write_csv(path, rows) -> None:
    """The CSV, atomically (a temporary name in the same folder, then a rename)."""
    import csv

    with atomic_file(path) as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        writer.writerows(rows)


CSV_SCHEMA = Schema(
    (*(Column(n) for n in CSV_COLUMNS[:5]), Column("window", int, minimum=1),
     Column("segment", int, minimum=0), Column("position", int, minimum=1),
     Column("kl", float, nonfinite=True), Column("dlogp", float, nonfinite=True),
     Column("top1_agree", int, minimum=0, maximum=1)),
    keys=CSV_COLUMNS[:8])


def read_csv(path):
    """A drift CSV as a DataFrame, checked (`_common.read_table` against `CSV_SCHEMA`);
    ValueError in one line naming the file for a missing file, one cut short, other columns,
    no rows, a value of the wrong type or a point twice."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"csv: expected a model_drift CSV at {path}, found none")
    return read_table(path, CSV_SCHEMA, what="model_drift CSV")


# --------------------------------------------------------------------------------------------
# figures


def _panel_key(arm: str, rounding: str) -> str:
    if arm == "every_step":
        return f"every_step, {rounding.upper()}"
    return "separate (read copy RN)" if arm.startswith("separate") else f"{arm}, {rounding.upper()}"


def plot(csv_path, png) -> None:
    """KL against position from the CSV: median over segments, band min..max (module
    docstring); at most 6 series a panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = read_csv(csv_path)
    series = {}
    for key, group in frame.groupby(["arm", "format", "rounding"], sort=False):
        series.setdefault(_panel_key(key[0], key[2]), []).append((key, group))
    panels = []
    for title, items in series.items():
        for i in range(0, len(items), 6):
            panels.append((title, items[i:i + 6]))
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 3.6 * nrows), squeeze=False,
                             sharex=True, sharey=True)
    colors = plt.get_cmap("tab10")
    for ax, (title, items) in zip(axes.flat, panels, strict=False):
        for i, ((arm, fmt, rnd), group) in enumerate(items):
            stats = group.groupby("position")["kl"].agg(["median", "min", "max"])
            x = stats.index.to_numpy()
            color = colors(i)
            ax.plot(x, stats["median"].clip(lower=KL_FLOOR), color=color, lw=1.3,
                    label=f"{arm} {fmt} {rnd.upper()}")
            ax.fill_between(x, stats["min"].clip(lower=KL_FLOOR),
                            stats["max"].clip(lower=KL_FLOOR), color=color, alpha=0.18, lw=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("position (tokens decoded)")
    for ax in axes[:, 0]:
        ax.set_ylabel("KL(exact || policy) [nats]")
    model = frame["model"].iloc[0]
    fig.suptitle(f"next-byte drift against an exact state: {model}, "
                 f"{frame['segment'].nunique()} segments (line: median, band: min..max)",
                 fontsize=10)
    fig.tight_layout()
    save_small_png(fig, png, dpi=150, source=SOURCE)
    plt.close(fig)


def last_octave_kl(frame):
    """Per (arm, format, rounding): the mean KL over grid positions in the last octave
    (position > last / 2) and every segment."""
    last = frame["position"].max()
    tail = frame[frame["position"] > last / 2]
    return tail.groupby(["arm", "format", "rounding"])["kl"].mean()


def bench_times(bench_csv, shape: str, window: int, batch: int = 256) -> dict:
    """Per-token decode time [us] of each ``PARETO_KERNELS`` policy and of the exact state,
    from ``kernel_bench``'s CSV (table above ``PARETO_KERNELS``)."""
    import pandas as pd

    path = Path(bench_csv)
    if not path.is_file():
        raise ValueError(f"--bench: expected kernel_bench's CSV at {path}, found none")
    bench = pd.read_csv(path)
    need = {"kernel", "shape", "batch", "window", "cursor", "time_us", "status"}
    if not need <= set(bench.columns):
        raise ValueError(f"{path}: expected kernel_bench columns {sorted(need)}, got "
                         f"{list(bench.columns)}")
    rows = bench[(bench["batch"] == batch) & (bench["shape"] == shape) &
                 (bench["window"] == window) & (bench["status"] == "ok")]
    if rows.empty:
        raise ValueError(f"{path}: expected rows at batch {batch}, shape {shape}, window "
                         f"{window}, got none")

    def token(kernel):
        t = rows[rows["kernel"] == kernel]["time_us"]
        return float(t.median()) if len(t) else math.nan

    def nonflush(kernel):
        t = rows[rows["kernel"] == kernel].groupby("cursor")["time_us"].median()
        return float(t.mean()) if len(t) else math.nan

    out = {}
    for key, (kernel, read) in PARETO_KERNELS.items():
        value = token(kernel)
        if read is not None:
            value += (window - 1) / window * (nonflush(read) - nonflush("cute:nonflush:nvfp4"))
        if not math.isnan(value):
            out[key] = value
    out["exact"] = token(PARETO_EXACT_KERNEL)
    return out


def pareto(drift_csv, bench_csv, png, shape: str = "mamba2-2.7b") -> list[tuple]:
    """The Pareto figure from the two CSVs; returns ``(label, us, kl, on_front)`` rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = read_csv(drift_csv)
    window = int(frame["window"].iloc[0])
    kl = last_octave_kl(frame)
    times = bench_times(bench_csv, shape, window)
    points = [(f"{a} {f} {r.upper()}", times[(a, f, r)], float(v))
              for (a, f, r), v in kl.items() if (a, f, r) in times]
    if not points:
        raise ValueError(f"{drift_csv}: expected a policy with a kernel_bench time "
                         f"({[' '.join(k) for k in PARETO_KERNELS]}), got none")
    points.sort(key=lambda p: (p[1], p[2]))
    front, best = [], math.inf
    for _label, _us, value in points:
        front.append(value < best)
        best = min(best, value)
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    for (label, us, value), on in zip(points, front, strict=True):
        ax.plot(us, max(value, KL_FLOOR), "o", color="#d62728" if on else "#7f7f7f", ms=6)
        ax.annotate(label, (us, max(value, KL_FLOOR)), textcoords="offset points",
                    xytext=(5, 4), fontsize=7)
    fx = [p[1] for p, on in zip(points, front, strict=True) if on]
    fy = [max(p[2], KL_FLOOR) for p, on in zip(points, front, strict=True) if on]
    ax.step(fx, fy, where="post", color="#d62728", lw=1, alpha=0.7, label="Pareto front")
    if not math.isnan(times["exact"]):
        ax.axvline(times["exact"], color="k", ls="--", lw=0.8,
                   label=f"exact fp32 state: {times['exact']:.0f} us (KL 0)")
    ax.set_yscale("log")
    ax.set_xlabel(f"decode time per token [us], kernel_bench, {shape}, batch 256, L={window}")
    ax.set_ylabel("KL over the last octave [nats]")
    ax.set_title(f"which state format: drift at {int(frame['position'].max()):,} tokens vs time",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    save_small_png(fig, png, dpi=150, source=SOURCE)
    plt.close(fig)
    return [(p[0], p[1], p[2], on) for p, on in zip(points, front, strict=True)]


def summarize(csv_path) -> str:
    """A table: per policy the last-octave KL, its ratio to separate_fp16sr nvfp4, its ratio to
    the mean KL over positions 1,025-2,048 (``x 1k-2k``: growth with length; NaN for runs of
    4,096 positions or fewer), the top-1 agreement over all positions and the slope of log KL
    against log position over the last 4 octaves."""
    import numpy as np

    frame = read_csv(csv_path)
    kl = last_octave_kl(frame)
    ref = kl.get(("separate_fp16sr", "nvfp4", "rn"), math.nan)
    last = frame["position"].max()
    early = frame[(frame["position"] > 1024) & (frame["position"] <= 2048)]
    early_kl = early.groupby(["arm", "format", "rounding"])["kl"].mean() if last > 4096 else {}
    lines = [f"{'policy':34s} {'KL last octave':>15s} {'x two-prec':>10s} {'x 1k-2k':>8s} "
             f"{'top1':>6s} {'slope':>6s}"]
    for key, value in kl.items():
        group = frame[(frame["arm"] == key[0]) & (frame["format"] == key[1]) &
                      (frame["rounding"] == key[2])]
        growth = value / early_kl[key] if key in early_kl and early_kl[key] > 0 else math.nan
        agree = group["top1_agree"].mean()
        tail = group[group["position"] >= last / 16].groupby("position")["kl"].mean()
        tail = tail[tail > 0]
        slope = (np.polyfit(np.log(tail.index), np.log(tail.to_numpy()), 1)[0]
                 if len(tail) > 2 else math.nan)
        lines.append(f"{' '.join(key):34s} {value:15.3e} {value / ref:10.2f} {growth:8.2f} "
                     f"{agree:6.3f} {slope:6.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    parser = OneLineParser(
        prog="python -m experiments.model_drift",
        description="Teacher-forced drift of the next-byte distribution when the SSM state is "
                    "kept by a precision policy, against an exact state (module docstring). "
                    "--preset toy: CPU reference, a few thousand tokens, about a minute; "
                    "--preset gpu: Triton emulation, 131,072 tokens; gdn-toy and gdn-gpu: "
                    "the same for a Gated DeltaNet LM; --pareto: redraw the Pareto figure "
                    "from the committed CSVs.",
        epilog=SHARDING_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="toy",
                        help="toy (default) or gpu, a Mamba-2 LM; gdn-toy or gdn-gpu, a Gated "
                             "DeltaNet LM; flags below override it")
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (config.json + model.safetensors) in "
                             "Mamba2ForCausalLM's layout or in Qwen3NextForCausalLM's with "
                             "Gated DeltaNet layers only (the recurrence is read from "
                             "config.json); default: the preset's (toy, gdn-toy: trained into "
                             "runs/model_drift_[gdn_]toy_model on first use; gpu: "
                             "results/model_drift/model; gdn-gpu: results/model_drift/gdn/model)")
    parser.add_argument("--data", default=None,
                        help="text folder from `python -m experiments.train_lm prepare-data`; "
                             "default: the committed 64 KiB held-out slice")
    parser.add_argument("--backend", choices=("reference", "emulation"), default=None)
    parser.add_argument("--device", default=None, help="cpu or cuda")
    parser.add_argument("--tokens", type=int, default=None, help="tokens decoded per segment")
    parser.add_argument("--segments", type=int, default=None, help="text segments (batch slots)")
    parser.add_argument("--window", type=int, default=None, help="L, tokens per window (16)")
    parser.add_argument("--seed", type=int, default=None, help="Philox seed of SR (0)")
    parser.add_argument("--per-octave", type=int, default=None,
                        help="recorded positions per doubling (8)")
    parser.add_argument("--policies", default=None,
                        help="comma-separated ARM:FORMAT[:ROUNDING] (arms: every_step, shared, "
                             "separate_exact, separate_fp16sr)")
    parser.add_argument("--graph-tokens", type=int, default=None,
                        help="tokens per CUDA graph replay (32; 0: no graph)")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="stop each decode (the exact arm's, then each policy's) after "
                             "this many seconds, writing the positions reached (the stderr "
                             "and the meta's positions_reached say so)")
    parser.add_argument("--out", default=None,
                        help="CSV path (default: the preset's under results/model_drift for "
                             "its own command, runs/model_drift.csv otherwise)")
    parser.add_argument("--plot", default=None,
                        help="figure path (default: the CSV's, .png), or 'none' for no figure")
    parser.add_argument("--replot", action="store_true", help="redraw the figure from --out")
    parser.add_argument("--pareto", action="store_true",
                        help="redraw the Pareto figure from --drift-csv and --bench")
    parser.add_argument("--drift-csv", default=str(RESULTS / "model_drift_gpu.csv"),
                        help="--pareto: the drift CSV (default the committed GPU one)")
    parser.add_argument("--bench", default=str(ROOT / "results" / "kernel_bench.csv"),
                        help="--pareto: kernel_bench's CSV")
    parser.add_argument("--bench-shape", default="mamba2-2.7b",
                        help="--pareto: kernel_bench shape whose times are used")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sharding_arguments(parser)
    args = parser.parse_args(argv)
    c = PRESETS[args.preset]
    overrides = {}
    for name in ("model", "data", "backend", "device", "tokens", "segments", "window", "seed",
                 "per_octave", "policies", "graph_tokens", "time_limit_s"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    for name in ("tokens", "segments", "window", "per_octave"):
        if name in overrides and overrides[name] < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive int, got "
                         f"{overrides[name]}")
    for name in ("seed", "graph_tokens", "time_limit_s"):
        if name in overrides and overrides[name] < 0:
            parser.error(f"--{name.replace('_', '-')}: expected a non-negative int, got "
                         f"{overrides[name]}")
    if "backend" in overrides and "device" not in overrides:
        overrides["device"] = "cuda" if overrides["backend"] == "emulation" and \
            torch.cuda.is_available() else "cpu"
    c = replace(c, **overrides)
    if c.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device: expected cpu here (no CUDA), got {c.device}")
    if c.device != "cpu" and not c.device.startswith("cuda"):
        parser.error(f"--device: expected cpu or cuda, got {c.device}")
    if c.backend == "reference" and c.device != "cpu":
        parser.error(f"--device: expected cpu for the reference backend, got {c.device}")
    try:
        parse_policies(c.policies)
    except ValueError as err:
        parser.error(str(err))
    regenerate = not overrides
    out = args.out or (c.out if regenerate else str(ROOT / "runs" / "model_drift.csv"))
    c = replace(c, out=out, plot=args.plot or str(Path(out).with_suffix(".png")),
                progress=not args.no_progress)
    return args, c


def ensure_toy_model(c: Config) -> None:
    """Train a toy preset's model (train_lm's toy preset of its arch, deterministic, seconds on
    a CPU) when ``c`` asks for it and it is not there yet; under torchrun it must exist
    first."""
    if c.model not in TOY_MODELS or (Path(c.model) / lm.CONFIG_NAME).is_file():
        return
    arch, folder = TOY_MODELS[c.model]
    from experiments import train_lm
    from experiments.sharding import ranks_from_env

    if ranks_from_env().launched:
        raise ValueError(f"--model: {c.model} does not exist yet; run its toy preset once "
                         "without torchrun to train it")
    print(f"training the toy model into {folder} (train_lm --arch {arch} --preset toy, once)",
          file=sys.stderr)
    train_lm.train(replace(train_lm.PRESETS_OF[arch]["toy"], out=str(folder), progress=False),
                   folder)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, c = parse_args(argv)
    prog = "python -m experiments.model_drift"
    from experiments.sharding import SweepStopped, is_main_rank, local_device

    try:
        if args.pareto:
            if not is_main_rank():
                return 0
            if args.plot == "none":  # the one-line error below
                raise ValueError("--plot: expected a figure path with --pareto, got none")
            png = args.plot or str(RESULTS / "model_drift_pareto.png")
            for label, us, value, on in pareto(args.drift_csv, args.bench, png,
                                               args.bench_shape):
                print(f"{label:34s} {us:8.1f} us  KL {value:.3e}{'  front' if on else ''}")
            print(f"wrote {png}")
            return 0
        if not args.replot:
            ensure_toy_model(c)
            # under torchrun each rank on its own GPU (the CSV and meta record the kind only)
            c = replace(c, device=local_device(c.device))
            try:
                with ctrl_c_as_keyboard_interrupt():  # the sweep's own line on Ctrl-C
                    done = sweep(c, " ".join([prog, *argv]), keep_cells=args.keep_cells)
            except SweepStopped as stopped:  # its line is printed; the same command resumes
                return stopped.code
            except KeyboardInterrupt:  # outside the sweep's cells
                return report_interrupt(prog)
            if not done.is_writer:  # a rank other than 0: rank 0 writes, plots, summarises
                return 0
        if c.plot != "none":
            plot(c.out, c.plot)
        print(summarize(c.out))
    except ValueError as err:
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"wrote {c.out}" + ("" if c.plot == "none" else f" and {c.plot}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
