"""Train the kit's byte-level language models on the King James Bible: a Mamba-2 LM
(``--arch mamba2``, the default, ``experiments.mamba2_lm``) or a Gated DeltaNet LM
(``--arch gdn``, ``experiments.gdn_lm``).

    python -m experiments.train_lm prepare-data --out runs/kjv    # the text, from apt (once)
    python -m experiments.train_lm --data runs/kjv                 # default preset, on a GPU
    python -m experiments.train_lm --arch gdn --data runs/kjv      # the GDN LM, on a GPU
    python -m experiments.train_lm --preset toy                    # tiny, CPU, for the tests

The Mamba-2 default preset trains a 1.35M-parameter model (5 layers, d_model 192, 6 heads of
64 x 64 per layer, 30 heads in all); the GDN default preset a 3.0M-parameter model (4 layers,
d_model 256, 4 heads of d_k = d_v = 64 per layer, 16 heads in all, SwiGLU MLPs of 512). Both
run 3,000 steps of 16 x 2,048 bytes with AdamW (peak lr 3e-3, 100 warm-up steps, cosine to
10 %), bf16 autocast on CUDA (the GDN recurrence itself in fp32), fp32 on the CPU. Batches are
drawn from a generator seeded with ``--seed`` and the weights are initialised from it, so a run
is repeatable on one machine and software stack (``torch.use_deterministic_algorithms``).
``--time-limit-s`` stops early, keeping what was trained (the meta file says so).

Outputs in ``--out`` (default ``results/model_drift`` for the Mamba-2 default preset,
``results/model_drift/gdn`` for the GDN one, ``runs/`` for others), CSVs first, each figure
drawn from its CSV only:

    model/config.json, model/model.safetensors   the checkpoint (matrices fp16, the per-head
                                                 parameters and norms fp32), Mamba2ForCausalLM
                                                 or Qwen3NextForCausalLM layout; evaluated as
                                                 saved
    train_loss.csv (+ .meta.json), train_loss.png   loss per step, bits per byte
    heldout_bpb.csv                              held-out bits per byte of the saved model
    decay_spectrum.csv, decay_spectrum.png       per-head decay time constants

**Decay time constants.** A head's state decays by ``exp(A dt_t)`` per token, so its memory is
``tau = -1 / (A dt)`` tokens. ``dt_t = softplus(dt_raw_t + dt_bias)`` depends on the input;
its typical value is measured on held-out text: the decoded ``dt`` of every position of the
first ``spectrum_bytes`` held-out bytes (windows of ``eval_len``), per head, its median (and
10th / 90th percentiles, whose ``tau`` bound the typical range). A head with ``tau >= 1000``
tokens is counted as long memory (also reported: ``>= 100`` and ``>= 10,000``). A GDN head's
log-decay ``g = -exp(A_log) softplus(a + dt_bias)`` has the same form, ``A = -exp(A_log)``
and ``dt = softplus(a_t + dt_bias)``, so its columns are the same; its delta rule also
overwrites what a key's direction held (``beta k k^T``), so its ``tau`` bounds the memory
from above.

Held-out bits per byte: the saved model, fp32, over the held-out blocks cut into windows of
``eval_len`` bytes, each from a zero state (``kjv_corpus`` has the split).
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.train_lm")

import csv
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments import gdn_lm, kjv_corpus
from experiments import mamba2_lm as lm
from experiments._common import OneLineParser, atomic_file, save_small_png, write_meta

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "model_drift"
ARCHS = ("mamba2", "gdn")
# the default preset's outputs; the other presets write under runs/
RESULTS_OF = {"mamba2": RESULTS, "gdn": RESULTS / "gdn"}
TITLES = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet"}
LONG_MEMORY = (100, 1000, 10_000)  # tokens; 1000 is the headline count
LOSS_COLUMNS = ("step", "tokens", "loss", "bpb", "lr")
SPECTRUM_COLUMNS = ("layer", "head", "A", "dt_p10", "dt_median", "dt_p90", "tau_p90", "tau",
                    "tau_p10")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (``out`` and ``progress`` change no number).

    The shape fields name Mamba-2's quantities; for ``arch='gdn'`` ``num_heads`` is the key
    and the value heads, ``head_dim`` d_v, ``state_size`` d_k (a head's state is
    ``[head_dim, state_size]`` in both), ``intermediate_size`` the MLP's width (0 for Mamba-2,
    which has no MLP) and ``chunk_size`` the training scan's chunk."""

    preset: str = "default"
    arch: str = "mamba2"
    hidden_size: int = 192
    num_hidden_layers: int = 5
    num_heads: int = 6
    head_dim: int = 64
    state_size: int = 64
    intermediate_size: int = 0
    chunk_size: int = 64
    seq_len: int = 2048
    batch: int = 16
    steps: int = 3000
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_len: int = 8192
    spectrum_bytes: int = 65_536
    data: str = ""  # folder of prepare-data; '' = the committed held-out slice (toy)
    device: str = "cpu"
    time_limit_s: float = 0.0  # 0 = none
    save_dtype: str = "float16"
    out: str = ""
    progress: bool = True

    def model_config(self) -> lm.Mamba2Config | gdn_lm.GDNConfig:
        if self.arch == "gdn":
            return gdn_lm.GDNConfig(
                hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                num_hidden_layers=self.num_hidden_layers, linear_num_key_heads=self.num_heads,
                linear_num_value_heads=self.num_heads, linear_key_head_dim=self.state_size,
                linear_value_head_dim=self.head_dim)
        return lm.Mamba2Config(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_heads=self.num_heads, head_dim=self.head_dim, state_size=self.state_size,
            chunk_size=self.chunk_size, expand=self.num_heads * self.head_dim // self.hidden_size,
        )


PRESETS = {
    "default": TrainConfig(),
    # tiny: 2 layers of 2 heads of 16 x 32, 40 steps on the committed 64 KiB slice, on the CPU
    "toy": TrainConfig(preset="toy", hidden_size=16, num_hidden_layers=2, num_heads=2,
                       head_dim=16, state_size=32, chunk_size=16, seq_len=128, batch=4,
                       steps=40, lr=1e-2, warmup=5, eval_len=1024, spectrum_bytes=2048),
}
GDN_PRESETS = {
    "default": replace(PRESETS["default"], arch="gdn", hidden_size=256, num_hidden_layers=4,
                       num_heads=4, head_dim=64, state_size=64, intermediate_size=512),
    # tiny: 2 layers of 2 heads of d_v 16 x d_k 32 (nvfp4 and mxfp4 blocks fit), MLP 32
    "toy": replace(PRESETS["toy"], arch="gdn", intermediate_size=32),
}
PRESETS_OF = {"mamba2": PRESETS, "gdn": GDN_PRESETS}
TOY_TRAIN_BYTES = 57_344  # toy: the slice's first 56 KiB train, the last 8 KiB are held out


def module_of(arch: str):
    """The model module of ``arch``: ``experiments.mamba2_lm`` or ``experiments.gdn_lm``."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {list(ARCHS)}, got {arch!r}")
    return gdn_lm if arch == "gdn" else lm


# --------------------------------------------------------------------------------------------
# data


def load_text(c: TrainConfig) -> tuple[bytes, list[bytes]]:
    """``(train, held_out_blocks)`` of the run's data."""
    if c.data:
        return kjv_corpus.split(kjv_corpus.load(c.data))
    text = kjv_corpus.heldout_slice()
    return text[:TOY_TRAIN_BYTES], [text[TOY_TRAIN_BYTES:]]


def as_ids(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def eval_windows(blocks: list[bytes], length: int) -> torch.Tensor:
    """The held-out blocks cut into whole windows of ``length`` bytes: ``[n, length]``."""
    rows = [as_ids(b)[: len(b) // length * length].view(-1, length) for b in blocks]
    rows = torch.cat(rows)
    if not len(rows):
        raise ValueError(f"eval_len: expected at most the held-out block size "
                         f"{min(map(len, blocks))}, got {length}")
    return rows


# --------------------------------------------------------------------------------------------
# training


def _lr_at(c: TrainConfig, step: int) -> float:
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    frac = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _param_groups(model, weight_decay):
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and "embed" not in name else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def train(c: TrainConfig, out: Path) -> dict:
    """Train, save, evaluate and write every output of the module docstring; returns a
    summary dict. On the CPU one thread (restored after): at these sizes threads only wait on
    each other (the toy presets: 5x faster on 2 cores, the same bytes)."""
    threads = torch.get_num_threads()
    if c.device == "cpu":
        torch.set_num_threads(1)
    try:
        return _train(c, out)
    finally:
        torch.set_num_threads(threads)


def _train(c: TrainConfig, out: Path) -> dict:
    start = time.time()
    torch.manual_seed(c.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(c.device)
    train_text, held = load_text(c)
    train_ids = as_ids(train_text)
    if len(train_ids) <= c.seq_len + 1:
        raise ValueError(f"seq_len: expected less than the training text ({len(train_ids)} "
                         f"bytes), got {c.seq_len}")
    arch = module_of(c.arch)
    model = (gdn_lm.GDNLM if c.arch == "gdn" else lm.Mamba2LM)(c.model_config())
    model = model.init_weights(c.seed).to(device)
    # the GDN forward takes its scan's chunk; Mamba-2's is in its config
    chunk = {"chunk": c.chunk_size} if c.arch == "gdn" else {}
    opt = torch.optim.AdamW(_param_groups(model, c.weight_decay), lr=c.lr, betas=(0.9, 0.95),
                            eps=1e-8)
    gen = torch.Generator().manual_seed(c.seed)
    offsets = torch.arange(c.seq_len + 1)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    losses = torch.zeros(c.steps, device=device)
    from tqdm import tqdm

    bar = tqdm(total=c.steps, desc="train", unit="step", disable=not c.progress,
               file=sys.stderr, dynamic_ncols=True)
    done = 0
    stopped = False
    for step in range(c.steps):
        starts = torch.randint(0, len(train_ids) - c.seq_len - 1, (c.batch,), generator=gen)
        window = train_ids[starts[:, None] + offsets].to(device)
        for group in opt.param_groups:
            group["lr"] = _lr_at(c, step)
        with autocast:
            logits = model(window[:, :-1], **chunk)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        losses[step] = loss.detach()
        done = step + 1
        bar.update(1)
        if done % 50 == 0 or done == c.steps:
            bar.set_postfix(bpb=f"{losses[step].item() / math.log(2):.3f}")
            if c.time_limit_s and time.time() - start > c.time_limit_s:
                stopped = done < c.steps
                break
    bar.close()
    train_seconds = time.time() - start

    rows = []
    for step, value in enumerate(losses[:done].tolist()):
        rows.append((step + 1, (step + 1) * c.batch * c.seq_len, f"{value:.6f}",
                     f"{value / math.log(2):.6f}", f"{_lr_at(c, step):.6e}"))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "train_loss.csv", LOSS_COLUMNS, rows)

    model_dir = arch.save(model.cpu(), out / "model", dtype=getattr(torch, c.save_dtype),
                          metadata={"trained_steps": done, "seed": c.seed})
    saved = arch.load(model_dir, device=device)
    windows = eval_windows(held, min(c.eval_len, min(map(len, held))))
    bpb = heldout_bpb(saved, windows, device)
    write_csv(out / "heldout_bpb.csv", ("windows", "window_bytes", "predicted_bytes", "bpb"),
              [(len(windows), windows.shape[1], windows.numel() - len(windows), f"{bpb:.6f}")])
    spectrum = decay_spectrum(saved, windows[: max(1, c.spectrum_bytes // windows.shape[1])],
                              device)
    write_csv(out / "decay_spectrum.csv", SPECTRUM_COLUMNS, spectrum)
    counts = long_memory_counts(out / "decay_spectrum.csv")
    checkpoint_bytes = sum(f.stat().st_size for f in model_dir.iterdir())
    summary = {
        "parameters": saved.num_parameters(),
        "checkpoint_bytes": checkpoint_bytes,
        "steps_trained": done,
        "stopped_by_time_limit": stopped,
        "train_seconds": round(train_seconds, 1),
        "final_train_bpb": float(rows[-1][3]),
        "heldout_bpb": round(bpb, 4),
        "heads": len(spectrum),
        "heads_tau_at_least": {str(k): v for k, v in counts.items()},
    }
    config = {k: v for k, v in asdict(c).items() if k not in ("out", "progress")}
    write_meta(out / "train_loss.csv", " ".join(["python -m experiments.train_lm", *sys.argv[1:]]),
               time.time() - start, {**config, "summary": summary}, device=c.device)
    plot_loss(out / "train_loss.csv", out / "train_loss.png", TITLES[c.arch])
    plot_spectrum(out / "decay_spectrum.csv", out / "decay_spectrum.png")
    return summary


@torch.no_grad()
def heldout_bpb(model, windows: torch.Tensor, device, batch: int = 8) -> float:
    """Mean next-byte cross-entropy in bits over ``windows [n, L]`` (fp32, zero state each)."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch].to(device)
        logits = model(ids[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count / math.log(2)


def mixers(model) -> list:
    """The model's mixers (each has ``A_log`` and ``process_dt``), one a layer."""
    if isinstance(model, gdn_lm.GDNLM):
        return model.mixers()
    return [block.mixer for block in model.backbone.layers]


def _dt_of_projection(mixer, output):
    """The processed ``dt`` from the output of the projection that holds it."""
    if isinstance(mixer, gdn_lm.Mixer):
        return mixer.process_dt(mixer.split_ba(output)[1])
    return mixer.process_dt(mixer.split_proj(output)[2])


@torch.no_grad()
def head_dt(model, windows: torch.Tensor, device) -> list[torch.Tensor]:
    """Per layer, the processed ``dt [positions, heads]`` of every position of ``windows``."""
    layers = mixers(model)
    captured = [[] for _ in layers]
    hooks = []
    for i, mixer in enumerate(layers):

        def hook(_module, _inputs, output, i=i, mixer=mixer):
            dt = _dt_of_projection(mixer, output)
            captured[i].append(dt.reshape(-1, dt.shape[-1]).float().cpu())

        projection = mixer.in_proj_ba if isinstance(mixer, gdn_lm.Mixer) else mixer.in_proj
        hooks.append(projection.register_forward_hook(hook))
    try:
        for row in windows:
            model(row[None].to(device))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(parts) for parts in captured]


def decay_spectrum(model, windows, device) -> list[tuple]:
    """Rows of ``SPECTRUM_COLUMNS``: per layer and head ``A``, the 10th / 50th / 90th
    percentile of ``dt`` over held-out positions and ``tau = -1 / (A dt)`` at each."""
    rows = []
    for layer, dt in enumerate(head_dt(model, windows, device)):
        A = -torch.exp(mixers(model)[layer].A_log.detach().float().cpu())
        q = torch.quantile(dt.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), dim=0)
        for h in range(dt.shape[1]):
            p10, p50, p90 = q[:, h].tolist()
            a = A[h].item()
            rows.append((layer, h, f"{a:.6e}", f"{p10:.6e}", f"{p50:.6e}", f"{p90:.6e}",
                         f"{-1 / (a * p90):.6e}", f"{-1 / (a * p50):.6e}",
                         f"{-1 / (a * p10):.6e}"))
    return rows


# --------------------------------------------------------------------------------------------
# CSV and figures


def write_csv(path: Path, columns, rows) -> None:
    """Write a CSV atomically: a temporary name in the same folder, then a rename."""
    with atomic_file(path) as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)


def read_csv(path: Path, columns) -> list[dict]:
    """The rows of a CSV whose header is exactly ``columns``; ValueError in one line if not."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"csv: expected a file at {path}, found none")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != tuple(columns):
            raise ValueError(f"{path}: expected columns {','.join(columns)}, got "
                             f"{','.join(reader.fieldnames or ())}")
        return list(reader)


def long_memory_counts(spectrum_csv) -> dict:
    taus = [float(r["tau"]) for r in read_csv(spectrum_csv, SPECTRUM_COLUMNS)]
    return {k: sum(t >= k for t in taus) for k in LONG_MEMORY}


def plot_loss(csv_path, png, model: str = "Mamba-2") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(csv_path, LOSS_COLUMNS)
    step = [int(r["step"]) for r in rows]
    bpb = [float(r["bpb"]) for r in rows]
    held = Path(csv_path).with_name("heldout_bpb.csv")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(step, bpb, lw=0.6, color="#1f77b4", label="training batch")
    if held.is_file():
        value = float(read_csv(held, ("windows", "window_bytes", "predicted_bytes",
                                      "bpb"))[0]["bpb"])
        ax.axhline(value, color="#d62728", ls="--", lw=1, label=f"held out: {value:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(0, min(8.5, max(bpb) * 1.05))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title(f"byte-level {model} on the King James Bible")
    fig.tight_layout()
    save_small_png(fig, png, dpi=150, source="experiments.train_lm")
    plt.close(fig)


def plot_spectrum(csv_path, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(csv_path, SPECTRUM_COLUMNS)
    rows = sorted(rows, key=lambda r: float(r["tau"]))
    layers = sorted({int(r["layer"]) for r in rows})
    cmap = plt.get_cmap("viridis", max(2, len(layers)))
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for i, r in enumerate(rows):
        tau, lo, hi = float(r["tau"]), float(r["tau_p90"]), float(r["tau_p10"])
        color = cmap(int(r["layer"]))
        ax.plot([i, i], [lo, hi], color=color, lw=1.2, alpha=0.6)
        ax.plot(i, tau, "o", color=color, ms=4)
    for layer in layers:
        ax.plot([], [], "o", color=cmap(layer), label=f"layer {layer}")
    for k in LONG_MEMORY:
        n = sum(float(r["tau"]) >= k for r in rows)
        ax.axhline(k, color="grey", lw=0.6, ls=":")
        ax.text(0, k * 1.1, f"{n} heads >= {k:,} tokens", fontsize=7, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("head (sorted by tau)")
    ax.set_ylabel("tau = -1/(A dt)  [tokens]")
    ax.set_title("learned decay time constants on held-out text\n"
                 "(dot: tau at the median dt; bar: tau at the 90th..10th percentile of dt)",
                 fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    save_small_png(fig, png, dpi=150, source="experiments.train_lm")
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None) -> tuple[str, TrainConfig | Path]:
    parser = OneLineParser(
        prog="python -m experiments.train_lm",
        description="Train the byte-level Mamba-2 or Gated DeltaNet LM on the King James "
                    "Bible (module docstring), or prepare its text with `prepare-data --out "
                    "DIR`.",
    )
    parser.add_argument("command", nargs="?", default="train", choices=("train", "prepare-data"),
                        help="train (default) or prepare-data (download and print the text "
                             "with apt-get download bible-kjv bible-kjv-text)")
    parser.add_argument("--arch", choices=ARCHS, default="mamba2",
                        help="mamba2 (default) or gdn (Gated DeltaNet, Qwen3-Next's layer)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default",
                        help="default: the committed model (GPU, ~3 min); toy: tiny, CPU")
    parser.add_argument("--data", default=None,
                        help="folder made by prepare-data (required by the default preset; the "
                             "toy preset uses the committed 64 KiB held-out slice)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: results/model_drift for the default "
                             "preset (gdn: results/model_drift/gdn), runs/train_lm_<preset> "
                             "(gdn: runs/train_lm_gdn_<preset>) otherwise; prepare-data: "
                             "required)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (preset's)")
    parser.add_argument("--seed", type=int, default=None, help="weights and batches seed (0)")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="stop training after this many seconds, keeping what was trained")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "prepare-data":
        if not args.out:
            parser.error("prepare-data: expected --out DIR, got none")
        return "prepare-data", Path(args.out)
    c = PRESETS_OF[args.arch][args.preset]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device: expected cpu here (no CUDA), got {device}")
    if device != "cpu" and not device.startswith("cuda"):
        parser.error(f"--device: expected cpu or cuda, got {device}")
    data = args.data if args.data is not None else c.data
    if args.preset == "default" and not data:
        parser.error("--data: expected the folder made by `python -m experiments.train_lm "
                     "prepare-data --out DIR` for the default preset, got none")
    for name in ("steps", "seed"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "steps" else 0):
            parser.error(f"--{name}: expected a {'positive' if name == 'steps' else 'non-negative'}"
                         f" int, got {value}")
    if args.time_limit_s is not None and args.time_limit_s <= 0:
        parser.error(f"--time-limit-s: expected a positive number, got {args.time_limit_s}")
    regenerate = args.preset == "default" and args.steps is None and args.seed is None
    name = f"train_lm_{c.preset}" if c.arch == "mamba2" else f"train_lm_{c.arch}_{c.preset}"
    out = args.out or str(RESULTS_OF[c.arch] if regenerate else ROOT / "runs" / name)
    c = replace(
        c, data=data or "", device=device, out=out, progress=not args.no_progress,
        steps=args.steps if args.steps is not None else c.steps,
        seed=args.seed if args.seed is not None else c.seed,
        time_limit_s=args.time_limit_s if args.time_limit_s is not None else c.time_limit_s,
    )
    return "train", c


def main(argv=None) -> int:
    command, c = parse_args(argv)
    try:
        if command == "prepare-data":
            path = kjv_corpus.prepare(c)
            print(f"wrote {path} ({path.stat().st_size:,} bytes, SHA-256 verified)")
            return 0
        summary = train(c, Path(c.out))
    except (ValueError, RuntimeError) as err:
        print(f"python -m experiments.train_lm: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    print(f"wrote {c.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
