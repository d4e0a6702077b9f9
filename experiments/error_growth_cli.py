"""The command line of `experiments.error_growth`: presets, flags, and the Config they give."""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments._common import (
    OneLineParser,
    file_problem,
    is_folder,
    meta_path,
    output_problem,
    runs_folder,
)
from experiments.error_growth_config import (
    BACKENDS,
    MAX_STEPS,
    RECURRENCES,
    SOURCE,
    Config,
    _split,
    parse_arms,
    parse_memory,
)
from experiments.error_growth_table import SCHEMA
from experiments.sharding import HELP as SHARDING_HELP
from experiments.sharding import add_arguments as add_sharding_arguments
from lowprec import formats, philox

# Values as the command line would give them; explicit flags override a preset's.
BASE_DEFAULTS = {
    "recurrence": "mamba2",
    "dv": 8,
    "dk": 32,
    "heads": 1,
    "seeds": 4,
    "seed0": 0,
    "steps": 4096,
    "window": "16",
    "memory": ["long", "short"],
    "arms": "every_step,shared,separate_exact,separate_fp16sr",
    "formats": "fp8_e4m3_row",
    "rounding": "sr",
    "log_grid": 0,
    "device": "cpu",
    "threads": 1,
    "backend": "reference",
    "sr_bits": str(philox.DEFAULT_SR_BITS),
    "philox_rounds": str(philox.DEFAULT_PHILOX_ROUNDS),
}

PRESETS = {
    "toy": {
        "recurrence": "mamba2",
        "dv": 8,
        "dk": 32,
        "heads": 1,
        "seeds": 8,
        "steps": 4096,
        "window": "16",
        "memory": ["long", "short"],
        "arms": "every_step:fp8_e4m3_row:rn,every_step:fp8_e4m3_row:sr,shared,separate_exact",
        "formats": "fp8_e4m3_row",
        "rounding": "sr",
        "log_grid": 1,  # whole windows at the start and at the summary steps: a 0.35 MB CSV
    },
    "default": {
        "recurrence": "mamba2",
        "dv": 64,
        "dk": 128,
        # 2 heads x 2 seeds keeps the 16,384 steps within a few minutes on a 2-core CPU: the
        # every-token arms quantise every state at every step, and SR there would need 2.6e10
        # Philox words (about 1.5 h measured), so the conventional arm is RN here (as serving
        # stacks store FP16 states) and the toy preset is where RN and SR are compared.
        "heads": 2,
        "seeds": 2,
        "steps": 16384,
        "window": "16",
        "memory": ["long", "short"],
        "arms": "every_step:fp16:rn,every_step:fp8_e4m3:rn,every_step:nvfp4:rn,"
        "every_step:mxfp4:rn,shared,separate_exact,separate_fp16sr",
        "formats": "fp16,fp8_e4m3,nvfp4,mxfp4",
        "rounding": "sr",
        "log_grid": 3,  # whole windows at 3 geometric points and at the summary steps: 0.5 MB
    },
    # the SR ablation: the recurrence copy and a conventional SR state at each setting
    "sr-toy": {
        "recurrence": "mamba2",
        "dv": 8,
        "dk": 32,
        "heads": 1,
        "seeds": 8,
        "steps": 4096,
        "window": "16",
        "memory": ["long", "short"],
        "arms": "separate:fp16:sr:nvfp4,every_step:fp16:sr",
        "formats": "nvfp4",
        "rounding": "sr",
        # the windows holding steps 16, 64, 1024 and 4096; 8 bits (13 and 16 lie between) and
        # 4 rounds: four settings keep the CSV near 0.6 MB
        "log_grid": 1,
        "sr_bits": "32,8",
        "philox_rounds": "10,4",
    },
}
# GDN and KDA at a head of their models (INPUTS_TEXT says how the inputs are drawn)
_DELTA_ARMS = ("every_step:fp16:rn,every_step:bf16:rn,every_step:nvfp4:rn,shared:nvfp4:rn,"
               "shared:fp16:rn,separate_exact:nvfp4,separate_fp16sr:nvfp4")
# at the layer's shape through the emulation on a GPU, the arms the claim needs; each rank of
# `torchrun --nproc-per-node 3` (sharing the GPU) runs the exact run and one arm, whole input
# chunks as CUDA graphs, bound by drawing the inputs on the host (scripts/gpu.sh error-growth)
_GPU_ARMS = "separate_fp16sr:nvfp4,every_step:bf16:rn,shared:fp16:rn"
for _name, _recurrence in (("gdn", "gdn"), ("kda", "kda")):
    PRESETS[_name] = {  # Qwen3-Next's GDN head, Kimi Linear's KDA head: d_k = d_v = 128
        "recurrence": _recurrence, "dv": 128, "dk": 128, "heads": 1, "seeds": 2,
        "steps": 8192, "window": "16", "memory": ["long", "short"], "arms": _DELTA_ARMS,
        "formats": "nvfp4", "rounding": "rn", "log_grid": 4,
    }
    PRESETS[f"{_name}-tiny"] = {  # the emulation interpreted on a CPU, in seconds
        "recurrence": _recurrence, "dv": 8, "dk": 16, "heads": 1, "seeds": 1, "steps": 48,
        "window": "8", "memory": ["long", "short"],
        "arms": "separate_fp16sr:nvfp4,every_step:fp16:rn,shared:fp16:rn", "formats": "nvfp4",
        "rounding": "rn", "log_grid": 0, "backend": "emulation",
    }
    PRESETS[f"{_name}-gpu"] = {  # the whole layer: 32 heads of 128 x 128 (both models)
        "recurrence": _recurrence, "dv": 128, "dk": 128, "heads": 32, "seeds": 1,
        "steps": 131072, "window": "16", "memory": ["long", "short"], "arms": _GPU_ARMS,
        "formats": "nvfp4", "rounding": "rn", "log_grid": 20, "backend": "emulation",
        "device": "cuda",
    }
PRESETS["emulation-gpu"] = {  # the Nemotron-3-Super Mamba-2 layer: 128 heads of 64 x 128
    "recurrence": "mamba2", "dv": 64, "dk": 128, "heads": 128, "seeds": 2, "steps": 131072,
    "window": "16", "memory": ["long"], "arms": "separate_fp16sr:nvfp4,every_step:fp16:rn",
    "formats": "nvfp4", "rounding": "rn", "log_grid": 48, "backend": "emulation",
    "device": "cuda",
}

# the SR ablation at Nemotron-3-Super's Mamba-2 head (64 x 128) through the emulation on a
# GPU, 131,072 steps: the recurrence copy and a conventional SR state at 32 and 16 bits, 10 and
# 7 rounds; 8 seeds (sequences) of 4 heads each, so the SR table has a paired interval over
# seeds, and 32 states a memory keep its 8 ranks near 3 minutes on an H100
PRESETS["sr-gpu"] = {
    **PRESETS["emulation-gpu"], "heads": 4, "seeds": 8, "memory": ["long", "short"],
    "arms": "separate:fp16:sr:nvfp4,every_step:fp16:sr", "rounding": "sr", "log_grid": 20,
    "sr_bits": "32,16", "philox_rounds": "10,7",
}

INPUTS_TEXT = """inputs (a fresh draw every step, per sequence and head; --memory sets the decay):
  v ~ N(0, I)   k, q ~ N(0, I) (Mamba-2's B and C)   a ~ U[LO, HI) per head (KDA: per head
  and channel of d_k) from --memory: long = [0.9995, 0.99999) (time constants 2,000 to 100,000
  tokens), short = [0.9, 0.95) (10 to 20 tokens), as the log-decays g = log a of trained
  layers span both; GDN and KDA as Qwen3-Next and Kimi Linear draw theirs: k and q
  L2-normalised per head, beta = sigmoid(N(0, 1)) (the models' beta is a sigmoid of a
  projection)"""

_HELP = {
    "recurrence": "state recurrence: mamba2 (S = a S + v k^T), gdn (delta rule), kda (delta rule, "
    "per-channel decay)",
    "dv": "rows of the state per head (d_v, Mamba-2's headdim)",
    "dk": "columns of the state per head (d_k, Mamba-2's dstate); a multiple of the block "
    "formats' block (16 for nvfp4, 32 for mxfp4)",
    "heads": "heads per sequence; rel_err is one norm over all heads and d_v",
    "seeds": "number of sequences with independent inputs: seeds seed0 .. seed0+seeds-1",
    "seed0": "first input seed; also the Philox key of the SR words (all 64 bits); the inputs "
    "depend on a seed modulo 2^32 only (torch's CPU generator): --seed0 2^32 draws the inputs "
    "of --seed0 0",
    "steps": f"decode steps (tokens), 1 .. {MAX_STEPS}",
    "window": "L: tokens per window, or a comma-separated list of them (one run, a window "
    "column); step t is a flush step when t %% L == 0",
    "memory": "one or more decay ranges, a ~ U[LO, HI): long (0.9995,0.99999), "
    "short (0.9,0.95) or LO,HI with 0 < LO <= HI < 1; e.g. --memory long 0.99,0.999",
    "arms": "comma-separated arms: every_step[:FORMAT[:ROUNDING]], shared[:FORMAT[:ROUNDING]], "
    "separate:HI_FORMAT[:ROUNDING][:READ_FORMAT] (the recurrence copy in HI_FORMAT with "
    "ROUNDING, default rn; the read copy RN), and the aliases separate_exact[:READ_FORMAT] "
    "(= separate:fp64:rn:READ_FORMAT) and separate_fp16sr[:READ_FORMAT] (= "
    "separate:fp16:sr:READ_FORMAT); a missing FORMAT or READ_FORMAT expands over --formats, a "
    "missing ROUNDING of every_step and shared over --rounding",
    "formats": "comma-separated formats for arms given without one: " + ", ".join(formats.names()),
    "rounding": "comma-separated roundings (rn, sr) of every_step and shared arms given without "
    "one; e.g. rn,sr runs both",
    "log_grid": "0 records every step; G > 0 records whole windows at ~G geometrically spaced "
    "places plus those holding steps 64, 1024, 4096 and the last",
    "device": "torch device of the simulation: cpu or cuda[:N] (the last bits of the fp64 "
    "sums, hence the CSV's bytes, depend on the device)",
    "threads": "torch CPU threads during the run (restored after); one is fastest for these "
    "small per-step operations and keeps the sums' order fixed",
    "backend": "reference (lowprec.policies in FP64) or emulation (the Triton kernels of "
    "emulation/ with fp32 containers); both run every recurrence; the emulation needs CUDA for "
    "real sizes and runs interpreted on a CPU",
    "sr_bits": "random bits per element of the SR copies, or a comma-separated list of them "
    f"({', '.join(map(str, philox.SR_BITS))}); one cell per setting of each arm with an SR "
    "copy, a CSV column sr_bits (an arm without SR runs once, at the default)",
    "philox_rounds": "rounds of the Philox generator behind the SR words (1-10), or a "
    "comma-separated list; with --sr-bits, every pair of values; a CSV column philox_rounds",
}


def build_parser() -> argparse.ArgumentParser:
    epilog = "\n\n".join([OUTPUT_RULE, SHARDING_HELP, INPUTS_TEXT, ""]) + (
        "presets (explicit flags override them):\n") + "\n".join(
        f"  {name}: " + " ".join(f"--{k.replace('_', '-')} {_show(v)}" for k, v in values.items())
        for name, values in PRESETS.items()
    )
    parser = OneLineParser(
        prog="python -m experiments.error_growth",
        description="Output error against decode length for each precision policy of the SSM "
        "state (see the module docstring). Writes a CSV, its .meta.json, a PNG, and prints a "
        "summary table.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="start from a preset; the preset alone (no setting flag) writes "
        "results/error_growth_<preset>.*, its regenerate command",
    )
    kinds = {
        "dv": int,
        "dk": int,
        "heads": int,
        "seeds": int,
        "seed0": int,
        "steps": int,
        "log_grid": int,
        "threads": int,
    }
    for name, text in _HELP.items():
        flag = "--" + name.replace("_", "-")
        kwargs = {"type": kinds.get(name, str), "default": None}
        if name == "recurrence":
            kwargs["choices"] = RECURRENCES
        if name == "backend":
            kwargs["choices"] = BACKENDS
        if name == "memory":
            kwargs["nargs"] = "+"
        parser.add_argument(flag, help=f"{text} (default: {_show(BASE_DEFAULTS[name])})", **kwargs)
    parser.add_argument(
        "--out",
        default=None,
        help="CSV path; its <stem>.meta.json and (unless --plot says otherwise) <stem>.png go "
        "beside it, whatever the current folder (default: see 'where outputs go' below)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG path, or 'none' for no plot (default: the CSV path with .png)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace output files that are not this experiment's own (another CSV header, "
        "meta.json or PNG); without it such a file is an error",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="do not simulate: read --out and redraw the plot and the summary from it (the "
        "CSV holds its run's settings: --steps, --arms and the like are refused)",
    )
    parser.add_argument(
        "--at",
        metavar="STEPS",
        default=None,
        help="comma-separated steps: the summary's columns are the windows holding these "
        "steps instead of 64, 1024, 4096 and the last (with --replot, read from the CSV; "
        "'-' where the log grid did not record the window)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_sharding_arguments(parser)
    return parser


def _distinct_ints(name: str, text: str, expected: str, minimum: int = 0,
                   noun: str = "") -> list[int]:
    """A comma-separated list of integers >= ``minimum``, each once, in the order given; a
    ValueError naming ``name`` otherwise."""
    values = []
    for part in _split(name, text):
        if not part.isdigit() or int(part) < minimum:
            raise ValueError(f"{name}: expected {expected}, got {part!r}")
        if int(part) in values:
            raise ValueError(f"{name}: {noun}{part} given twice")
        values.append(int(part))
    return values


def _parse_windows(text: str) -> list[int]:
    """--window's list: positive integers, each once."""
    return _distinct_ints("window", text, "integers >= 1", minimum=1)


def _parse_list(name: str, text) -> list[int]:
    """--sr-bits' and --philox-rounds' lists: integers, each once (range checks: Config)."""
    if isinstance(text, int):
        return [text]
    return _distinct_ints(name, str(text), "integers")


def parse_steps(text: str) -> list[int]:
    """--at's steps: positive integers, each once, in the order given."""
    return _distinct_ints("at", text, "steps >= 1", minimum=1, noun="step ")


def _show(value) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def _check_plot_path(path: str) -> None:
    """The plot's path must name a file of a type matplotlib writes (checked before the run,
    not after it)."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if is_folder(path):
        raise ValueError(f"plot: expected an image path or 'none', got the folder {path!r}")
    if Path(path).suffix.lower().lstrip(".") not in kinds:
        raise ValueError(
            f"plot: expected a path ending in .png (or another of {', '.join(sorted(kinds))}) "
            f"or 'none', got {path!r}"
        )


OUTPUT_RULE = """where outputs go (paths relative to the current folder):
  --preset NAME alone   results/error_growth_NAME.{csv,meta.json,png}: the preset's
                        regenerate command, the only run that replaces committed results
  --out PATH.csv        PATH.csv, PATH.meta.json and PATH.png (--plot: elsewhere or none)
  anything else         runs/error_growth_<preset or custom>_<flags given>/error_growth.*
                        (git-ignored); the output line says where
  a file there that is not this experiment's output is replaced only with --force; a run
  stopped by Ctrl-C or SIGTERM writes <stem>.partial.csv and exits with status 130"""


def default_out(args: argparse.Namespace, argv_settings: list[str]) -> str:
    """The CSV path of a run without --out: results/ for a preset alone, else a runs/ folder
    named by the preset and the setting flags given (``argv_settings``, as typed)."""
    if args.preset and not argv_settings:
        return f"results/error_growth_{args.preset.replace('-', '_')}.csv"
    folder = runs_folder("error_growth", [args.preset or "custom", *argv_settings])
    return str(folder / "error_growth.csv")


def _setting_words(argv: list[str]) -> list[str]:
    """The setting flags of ``argv`` and their values as words (``--window 8,16`` ->
    ``window-8,16``), the preset and output flags left out."""
    skip = {"--preset", "--out", "--plot", "--at"}
    flags = {"--replot", "--force", "--no-progress", "--keep-cells"}
    words, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, _, value = arg.partition("=")
        if name in flags:
            i += 1
            continue
        values = [value] if value else []
        i += 1
        while not value and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if name not in skip and name.startswith("--"):
            words.append(name[2:] + "-" + "+".join(values))
    return words


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> Config:
    """Base defaults, then the preset's values, then the flags given; raises ValueError.
    ``argv`` (the command line as typed) names the runs/ folder of a custom run."""
    given = [k for k, v in vars(args).items() if k in BASE_DEFAULTS and v is not None]
    if args.replot and given:  # the CSV holds its run: --steps 100 would draw all 4,096
        raise ValueError(f"--replot: --{given[0].replace('_', '-')} sets up a run; a replot "
                         "draws the CSV as it was run (--out, --plot, --at and --preset only)")
    values = dict(BASE_DEFAULTS)
    if args.preset:
        values.update(PRESETS[args.preset])
    values.update({k: v for k, v in vars(args).items() if k in BASE_DEFAULTS and v is not None})
    for name in ("out", "plot"):  # an unset shell variable: not the default path, silently
        if getattr(args, name) is not None and not getattr(args, name).strip():
            raise ValueError(f"--{name}: expected a path, got {getattr(args, name)!r}")
    if argv is None:  # from Python: the settings given, in a fixed order
        argv = [w for k in given for w in (f"--{k.replace('_', '-')}", _show(vars(args)[k]))]
    out = args.out or default_out(args, _setting_words(argv) if given else [])
    plot_path = args.plot or str(Path(out).with_suffix(".png"))
    if is_folder(out):
        raise ValueError(f"out: expected a CSV path, got the folder {out!r}")
    if plot_path.lower() != "none":
        _check_plot_path(plot_path)
        if Path(plot_path).resolve() in (Path(out).resolve(), meta_path(out).resolve()):
            raise ValueError(f"plot: {plot_path!r} is the CSV's own path (or its .meta.json): "
                             "give --out a .csv path or --plot another file")
    if Path(out).suffix.lower() != ".csv":
        raise ValueError(f"out: expected a path ending in .csv, got {out!r}")
    # writable outputs, checked before the run (a bad path would be a traceback after it)
    if not args.replot and (problem := file_problem(out)):
        raise ValueError(f"--out: cannot write {out}: {problem}")
    if plot_path.lower() != "none" and (problem := file_problem(plot_path)):
        raise ValueError(f"--plot: cannot write {plot_path}: {problem}")
    if not args.force:
        written = [] if args.replot else [(out, SCHEMA.header), (str(meta_path(out)), None)]
        if plot_path.lower() != "none":
            written.append((plot_path, None))
        for path, header in written:
            if problem := output_problem(path, SOURCE, header):
                raise ValueError(f"--out: {problem}")
    windows = values["window"]
    if isinstance(windows, str):
        windows = tuple(_parse_windows(windows))
    sr_bits = tuple(_parse_list("sr_bits", values["sr_bits"]))
    philox_rounds = tuple(_parse_list("philox_rounds", values["philox_rounds"]))
    return Config(
        sr_bits=sr_bits,
        philox_rounds=philox_rounds,
        recurrence=values["recurrence"],
        dv=values["dv"],
        dk=values["dk"],
        heads=values["heads"],
        seeds=values["seeds"],
        seed0=values["seed0"],
        steps=values["steps"],
        window=windows,
        memory=tuple(parse_memory(m) for m in values["memory"]),
        arms=parse_arms(values["arms"], values["formats"], values["rounding"]),
        log_grid=values["log_grid"],
        out=out,
        plot=None if plot_path.lower() == "none" else plot_path,
        progress=not args.no_progress,
        device=values["device"],
        threads=values["threads"],
        backend=values["backend"],
    )
