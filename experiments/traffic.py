"""Memory traffic and capacity of SSM decoding schemes: bytes per committed token (CPU only).

Evaluates the accounting rules of `lowprec.traffic` at one model shape of `lowprec.models` and
writes, under the output folder (see "Where outputs go"):

    traffic_window_<model>.csv/.png   bytes per token against the window L (T = 1), for
                                      conventional decoding, ReplaySSM with one shared
                                      checkpoint in each state format, and two precisions
    traffic_spec_<model>.csv/.png     bytes per committed token against T and acceptance:
                                      snapshots (vLLM-style) against ReplaySSM
    traffic_memory_<model>.csv/.png   requests that fit against memory
    traffic_summary_<model>.json      the `--summary` object

    traffic_<model>.meta.json         command, commit, device, config, and each CSV's rows
                                      and sha256

Every CSV row is one configuration (tidy); provenance lives in the meta.json only, so an
unchanged tree regenerates the CSVs byte for byte. `plot(csv)` reads only the CSV. All numbers
are per layer and per sequence unless a column says otherwise (`per_request_bytes` covers the
whole model); MiB = 2^20 bytes. Every file is written under a temporary name and renamed when
complete.

Where outputs go (paths relative to the current folder): a model whose results are committed
(``REGENERATE_MODELS``) at the default --window and --spec-verified writes ``results/`` (its
regenerate command); any other run writes ``runs/traffic_<model>_<flags>/``; ``--out DIR``
writes DIR. A file there that is not this experiment's output is replaced only with --force.
``--plot-only`` redraws the PNGs from the CSVs, refusing (one line naming the file and the
line) a CSV that is cut short, has other columns or values, a row twice, or bytes other than
its meta.json recorded.

    python -m experiments.traffic                          # nemotron3-super, CSVs and plots
    python -m experiments.traffic --model qwen3-next-80b   # Gated DeltaNet
    python -m experiments.traffic --model kimi-linear-48b  # KDA, into runs/ (not committed)
    python -m experiments.traffic --model mamba2-2.7b      # no attention: KV entries null
    python -m experiments.traffic --plot-only              # redraw from results/'s CSVs
    python -m experiments.traffic --summary                # one JSON object on stdout, no files
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.traffic")

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments._common import (
    BadFile,
    Column,
    OneLineParser,
    Schema,
    check_rows,
    file_sha256,
    folder_problem,
    is_file,
    output_problem,
    read_meta,
    read_table,
    runs_folder,
    save_small_png,
    write_csv,
    write_meta,
    write_text,
)
from lowprec import models
from lowprec import traffic as tr

SOURCE = "experiments.traffic"
PROG = "python -m " + SOURCE
GIB = 2**30
DEVICE = "cpu (arithmetic only)"
SWEEPS = ("window", "spec", "memory")
# models whose sweeps are committed under results/: their default run regenerates them
REGENERATE_MODELS = ("nemotron3-super", "qwen3-next-80b")
FLOAT_FORMAT = "%.10g"
NUMBER = r"-?(\d+(\.\d*)?|\.\d+)(e[+-]?\d+)?"  # what '%.10g' writes


def _schema(sweep: str) -> Schema:
    """The columns of a sweep's CSV, their types and ranges, and its key."""
    text = tuple(Column(n) for n in ("model", "scheme", "read_format", "recurrence_format",
                                     "record_layout"))
    head = (Column("sweep", choices=(sweep,)), *text, Column("window", int, minimum=0),
            Column("verified", int, minimum=1))
    flow = tuple(Column(n, float, pattern=NUMBER, minimum=0.0) for n in (
        "bytes_per_token", "mib_per_token", "state_read_per_token", "state_write_per_token",
        "record_read_per_token", "record_write_per_token", "steps_per_token"))
    names = ("scheme", "read_format", "recurrence_format", "record_layout")
    if sweep == "window":
        return Schema((*head, Column("committed", int, minimum=1), *flow,
                       Column("ratio_to_conventional", float, pattern=NUMBER, minimum=0.0)),
                      keys=(*names, "window"))
    if sweep == "spec":
        return Schema((*head, Column("committed", int, minimum=1),
                       Column("acceptance", float, pattern=NUMBER, minimum=0.0, maximum=1.0),
                       *flow), keys=(*names, "verified", "committed"))
    return Schema((*head, Column("context", int, minimum=0),
                   Column("per_layer_bytes", int, minimum=1),
                   Column("per_request_bytes", int, minimum=1),
                   Column("memory_gib", float, pattern=NUMBER, minimum=0.0),
                   Column("requests", int, minimum=0)),
                  keys=(*names, "verified", "context", "memory_gib"))


SCHEMAS = {sweep: _schema(sweep) for sweep in SWEEPS}


@dataclass(frozen=True)
class Config:
    """What to evaluate. Defaults reproduce the committed results."""

    model: str = "nemotron3-super"
    out_dir: Path = Path("results")
    windows: tuple[int, ...] = tuple(range(1, 65))
    # Formats of the one shared checkpoint / the conventional state.
    shared_formats: tuple[str, ...] = ("fp32", "fp16", "fp8_e4m3", "mxfp4", "nvfp4")
    # (recurrence copy, read copy) pairs of the two-precision scheme.
    two_precision: tuple[tuple[str, str], ...] = (
        ("fp32", "nvfp4"),
        ("fp16", "nvfp4"),
        ("fp16", "mxfp4"),
        ("fp16", "fp8_e4m3"),
    )
    verified: tuple[int, ...] = tuple(range(1, 9))
    window: int = 16
    default_pair: tuple[str, str] = ("fp16", "nvfp4")
    spec_verified: int = 4
    memory_gib: tuple[float, ...] = tuple(float(g) for g in range(2, 142, 2))
    contexts: tuple[int, ...] = (0, 32768)
    summary_only: bool = False
    make_plots: bool = True


# --------------------------------------------------------------------------------------------
# Sweeps: one tidy DataFrame each
# --------------------------------------------------------------------------------------------


def _traffic_row(traffic: tr.Traffic) -> dict:
    tokens = traffic.tokens
    return {
        "bytes_per_token": traffic.per_token,
        "mib_per_token": traffic.per_token / tr.MIB,
        "state_read_per_token": traffic.state_read / tokens,
        "state_write_per_token": traffic.state_write / tokens,
        "record_read_per_token": traffic.record_read / tokens,
        "record_write_per_token": traffic.record_write / tokens,
        "steps_per_token": traffic.steps / tokens,
    }


def window_sweep(config: Config) -> pd.DataFrame:
    """Standard decoding (T = 1): bytes per token against L for every scheme and format."""
    model = models.get(config.model)
    ssm = model.ssm
    reference = tr.conventional(tr.state_bytes(ssm, ssm.state_format)).per_token
    rows = []

    def add(scheme, read_format, recurrence_format, layout, window, traffic):
        rows.append(
            {
                "sweep": "window",
                "model": model.name,
                "scheme": scheme,
                "read_format": read_format,
                "recurrence_format": recurrence_format,
                "record_layout": layout,
                "window": window,
                "verified": 1,
                "committed": 1,
                **_traffic_row(traffic),
                "ratio_to_conventional": traffic.per_token / reference,
            }
        )

    for fmt in config.shared_formats:
        state = tr.state_bytes(ssm, fmt)
        for window in config.windows:
            add("conventional", fmt, fmt, "none", window, tr.conventional(state))
    for layout in tr.RECORD_LAYOUT_NAMES:
        record = tr.ring_record(ssm, layout, model.act_format)
        for fmt in config.shared_formats:
            state = tr.state_bytes(ssm, fmt)
            for window in config.windows:
                add("replay_shared", fmt, fmt, layout, window, tr.replay(window, record, state))
        for hi_format, lo_format in config.two_precision:
            hi, lo = tr.state_bytes(ssm, hi_format), tr.state_bytes(ssm, lo_format)
            for window in config.windows:
                add(
                    "two_precision",
                    lo_format,
                    hi_format,
                    layout,
                    window,
                    tr.replay(window, record, lo, hi),
                )
    return pd.DataFrame(rows)


def _spec_schemes(config: Config, model: models.ModelShape):
    """(scheme, read format, recurrence format, layout, traffic(T, c), memory(T)) per scheme."""
    ssm = model.ssm
    state = tr.state_bytes(ssm, ssm.state_format)
    record = tr.ring_record(ssm, "kernel", model.act_format)
    hi_format, lo_format = config.default_pair
    hi, lo = tr.state_bytes(ssm, hi_format), tr.state_bytes(ssm, lo_format)
    L = config.window
    fmt = ssm.state_format
    return (
        (
            "snapshot",
            fmt,
            fmt,
            "none",
            lambda T, c: tr.snapshot_spec(state, T, c),
            lambda T: tr.snapshot_memory(state, T),
        ),
        (
            "replay_shared",
            fmt,
            fmt,
            "kernel",
            lambda T, c: tr.replay_spec(L, T, c, record, state),
            lambda T: tr.replay_memory(L, T, record, state),
        ),
        (
            "two_precision",
            lo_format,
            hi_format,
            "kernel",
            lambda T, c: tr.replay_spec(L, T, c, record, lo, hi),
            lambda T: tr.replay_memory(L, T, record, lo, hi),
        ),
    )


SPEC_BAR_WINDOW = 8192  # from this L on the speculative sweep takes over a second


def spec_sweep(config: Config) -> pd.DataFrame:
    """Speculative decoding: bytes per committed token for every T and every c = 1..T."""
    model = models.get(config.model)
    points = [(scheme, T, c) for scheme in _spec_schemes(config, model)
              for T in config.verified for c in range(1, T + 1)]
    rows = []
    # each point traces its speculative cycle, in time linear in L (--window 65536 took 15 s
    # here, 2026-12-01), so long windows show a bar
    for (scheme, read_format, recurrence_format, layout, traffic_of, _), T, c in tqdm(
            points, desc="speculative cycles", unit="point", file=sys.stderr,
            disable=config.window < SPEC_BAR_WINDOW):
        rows.append(
            {
                "sweep": "spec",
                "model": model.name,
                "scheme": scheme,
                "read_format": read_format,
                "recurrence_format": recurrence_format,
                "record_layout": layout,
                "window": config.window if scheme != "snapshot" else 0,
                "verified": T,
                "committed": c,
                "acceptance": (c - 1) / (T - 1) if T > 1 else 1.0,
                **_traffic_row(traffic_of(T, c)),
            }
        )
    return pd.DataFrame(rows)


def memory_sweep(config: Config) -> pd.DataFrame:
    """Requests that fit in a memory budget, per scheme, T and context length."""
    model = models.get(config.model)
    rows = []
    for scheme, read_format, recurrence_format, layout, _, memory_of in _spec_schemes(
        config, model
    ):
        for T in sorted({1, config.spec_verified}):
            per_layer = memory_of(T)
            for context in config.contexts:
                per_request = tr.request_bytes(model, per_layer, context)
                for gib in config.memory_gib:
                    rows.append(
                        {
                            "sweep": "memory",
                            "model": model.name,
                            "scheme": "conventional" if scheme == "snapshot" and T == 1 else scheme,
                            "read_format": read_format,
                            "recurrence_format": recurrence_format,
                            "record_layout": layout,
                            "window": config.window if scheme != "snapshot" else 0,
                            "verified": T,
                            "context": context,
                            "per_layer_bytes": per_layer,
                            "per_request_bytes": per_request,
                            "memory_gib": gib,
                            "requests": tr.requests_fit(int(gib * GIB), per_request),
                        }
                    )
    return pd.DataFrame(rows)


def summary(config: Config) -> dict:
    """The headline numbers, per layer and per sequence (MiB = 2^20 bytes)."""
    model = models.get(config.model)
    ssm = model.ssm
    L, T = config.window, config.spec_verified
    state = tr.state_bytes(ssm, ssm.state_format)
    hi_format, lo_format = config.default_pair
    hi, lo = tr.state_bytes(ssm, hi_format), tr.state_bytes(ssm, lo_format)
    kernel = tr.ring_record(ssm, "kernel", model.act_format)
    conservative = tr.ring_record(ssm, "conservative", model.act_format)
    # a model without attention layers (mamba2-2.7b) has no KV to weigh against: null in JSON
    kv = tr.kv_bytes_per_token(model.attention) if model.n_attention_layers else None
    conventional = tr.conventional(state).per_token
    replay = tr.replay(L, kernel, state).per_token

    def mib(x: float) -> float:
        return round(x / tr.MIB, 6)

    return {
        "model": model.name,
        "units": "per layer and per sequence; MiB = 2^20 bytes; crossover for the whole model",
        "state_format": ssm.state_format,
        "state_mib": mib(state),
        "kv_kib_per_token": None if kv is None else kv / tr.KIB,
        "state_equiv_kv_tokens": None if kv is None else tr.state_equivalent_kv_tokens(state, kv),
        "crossover_context_tokens": (None if kv is None
                                     else tr.crossover_context(model, conventional)),
        "record_bytes_kernel": kernel.write,
        "record_bytes_conservative": conservative.write,
        "replay_ratio_conservative": round(
            tr.replay(L, conservative, state).per_token / conventional, 6
        ),
        "conventional_mib_per_token": mib(conventional),
        "replay_mib_per_token": mib(replay),
        "optimal_window": round(tr.optimal_window(state, kernel), 3),
        "optimal_window_brute_force": tr.best_window(
            lambda window: tr.replay(window, kernel, state).per_token, range(1, 1025)
        ),
        "two_precision_mib_per_token": mib(tr.replay(L, kernel, lo, hi).per_token),
        "two_precision_formats": {"recurrence": hi_format, "read": lo_format},
        "window": L,
        "spec": {
            "verified": T,
            "window": L,
            "snapshot_all_accepted": mib(tr.snapshot_spec(state, T, T).per_token),
            "snapshot_all_rejected": mib(tr.snapshot_spec(state, T, 1).per_token),
            "replay_all_accepted": mib(tr.replay_spec(L, T, T, kernel, state).per_token),
            "replay_all_rejected": mib(tr.replay_spec(L, T, 1, kernel, state).per_token),
            "two_precision_all_accepted": mib(tr.replay_spec(L, T, T, kernel, lo, hi).per_token),
            "two_precision_all_rejected": mib(tr.replay_spec(L, T, 1, kernel, lo, hi).per_token),
            "plain_conventional": mib(conventional),
            "plain_replay": mib(replay),
        },
    }


def csv_path(config: Config, sweep: str) -> Path:
    return Path(config.out_dir) / f"traffic_{sweep}_{config.model}.csv"


def summary_path(config: Config) -> Path:
    return Path(config.out_dir) / f"traffic_summary_{config.model}.json"


def meta_file(config: Config) -> Path:
    return Path(config.out_dir) / f"traffic_{config.model}.meta.json"


def outputs(config: Config) -> list[Path]:
    """Every file a run writes, plots included when asked for."""
    files = [csv_path(config, s) for s in SWEEPS] + [summary_path(config), meta_file(config)]
    if config.make_plots:
        files += [csv_path(config, s).with_suffix(".png") for s in SWEEPS]
    return files


def run(config: Config, command: str = PROG) -> pd.DataFrame:
    """Write the three CSVs, the summary JSON and the meta.json for `config.model`, each
    atomically; return all rows."""
    start = time.perf_counter()
    frames = []
    for name, sweep in (("window", window_sweep), ("spec", spec_sweep), ("memory", memory_sweep)):
        frame = sweep(config)
        write_csv(frame, csv_path(config, name), float_format=FLOAT_FORMAT)
        frames.append(frame)
    write_text(summary_path(config), json.dumps(summary(config), indent=2) + "\n")
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()
                if k not in ("out_dir", "summary_only", "make_plots")}
    files = {}
    for name in SWEEPS:
        path = csv_path(config, name)
        files[path.name] = {"rows": len(frames[SWEEPS.index(name)]), "sha256": file_sha256(path)}
    # one meta for the run's files; write_meta names it after its first argument
    write_meta(meta_file(config).with_name(f"traffic_{config.model}.csv"), command,
               time.perf_counter() - start, settings, device="cpu",
               extra={"experiment": SOURCE, "device": DEVICE, "files": files})
    return pd.concat(frames, ignore_index=True)


def read_sweep(csv: str | Path) -> pd.DataFrame:
    """A sweep CSV written by ``run``, checked against its sweep's schema and the sha256 its
    meta.json recorded; ``BadFile`` (one line naming the file and the line) otherwise."""
    csv = Path(csv)
    sweep = next((s for s in SWEEPS if csv.name.startswith(f"traffic_{s}_")), None)
    if sweep is None or csv.suffix != ".csv":
        raise BadFile(f"{csv}: expected a traffic_{{window,spec,memory}}_<model>.csv")
    model = csv.stem[len(f"traffic_{sweep}_"):]
    frame = read_table(csv, SCHEMAS[sweep])
    check_rows(csv, frame["model"] != model, f"model: expected {model!r} (the file's name)",
               frame["model"])
    meta_json = csv.with_name(f"traffic_{model}.meta.json")
    meta = read_meta(meta_json)
    recorded = meta.get("files", {}).get(csv.name)
    if not meta["command"].startswith(PROG) or not isinstance(recorded, dict):
        raise BadFile(f"{meta_json}: records no {csv.name} of {SOURCE}")
    if file_sha256(csv) != recorded.get("sha256"):
        raise BadFile(f"{csv}: its bytes differ from those {meta_json.name} recorded "
                      f"({recorded.get('rows')} rows): changed or cut after it was written")
    return frame


# --------------------------------------------------------------------------------------------
# Plots: each reads only its CSV
# --------------------------------------------------------------------------------------------

FORMAT_COLORS = {
    "fp32": "#1f77b4",
    "fp16": "#2ca02c",
    "bf16": "#17becf",
    "fp8_e4m3": "#ff7f0e",
    "mxfp4": "#9467bd",
    "nvfp4": "#d62728",
}
SCHEME_COLORS = {
    "snapshot": "#7f7f7f",
    "conventional": "#7f7f7f",
    "replay_shared": "#1f77b4",
    "two_precision": "#d62728",
}
LAYOUT_STYLES = {"kernel": "-", "conservative": "--", "none": ":"}


def _plain_log_y(ax) -> None:
    """Log y axis with ticks at powers of two written as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=2))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", lw=0.3, alpha=0.5)


def _plot_window(df: pd.DataFrame, axes) -> None:
    """One panel per format of the shared checkpoint (conventional, ReplaySSM with the
    kernel's and the conservative record layout: three series), then one panel per record
    layout of the two-precision pairs (conventional fp32 and the pairs), shared y axis."""
    shared_formats = list(dict.fromkeys(df[df.scheme == "replay_shared"].read_format))
    layouts = list(dict.fromkeys(df[df.scheme == "two_precision"].record_layout))
    conventional = df[df.scheme == "conventional"]

    def least(ax, rows, color):
        best = rows.loc[rows.mib_per_token.idxmin()]
        ax.plot(best.window, best.mib_per_token, "o", color=color, ms=3)

    for ax, fmt in zip(axes, shared_formats, strict=False):
        color = FORMAT_COLORS.get(fmt)
        rows = conventional[conventional.read_format == fmt]
        ax.plot(rows.window, rows.mib_per_token, ":", color="0.4", label="conventional")
        for layout, rows in df[(df.scheme == "replay_shared") & (df.read_format == fmt)].groupby(
                "record_layout", sort=False):
            ax.plot(rows.window, rows.mib_per_token, LAYOUT_STYLES[layout], color=color,
                    label=f"ReplaySSM, {layout} records")
            least(ax, rows, color)
        ax.set_title(f"one shared checkpoint in {fmt}", fontsize=9)
    for ax, layout in zip(axes[len(shared_formats):], layouts, strict=False):
        rows = conventional[conventional.read_format == "fp32"]
        ax.plot(rows.window, rows.mib_per_token, ":", color="0.4", label="conventional fp32")
        two = df[(df.scheme == "two_precision") & (df.record_layout == layout)]
        for (hi, lo), rows in two.groupby(["recurrence_format", "read_format"], sort=False):
            color = FORMAT_COLORS.get(lo) if hi == "fp16" else "black"
            ax.plot(rows.window, rows.mib_per_token, "-", color=color,
                    label=f"recurrence {hi} + read {lo}")
            least(ax, rows, color)
        ax.set_title(f"two precisions, {layout} records", fontsize=9)
    for i, ax in enumerate(axes):
        ax.axvline(16, color="0.8", lw=0.8, zorder=0)  # DESIGN.md's default window
        ax.set_xlabel("window L (tokens per flush)", fontsize=8)
        _plain_log_y(ax)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2))
        if i % 4 == 0:
            ax.set_ylabel("MiB moved per token\n(per layer, per sequence)", fontsize=8)


def _plot_spec(df: pd.DataFrame, ax_T, ax_acc) -> None:
    for scheme, rows in df.groupby("scheme", sort=False):
        color = SCHEME_COLORS[scheme]
        label = scheme if scheme == "snapshot" else (f"{scheme} L={int(rows.window.iloc[0])}")
        accepted = rows[rows.committed == rows.verified]
        rejected = rows[rows.committed == 1]
        ax_T.plot(
            accepted.verified,
            accepted.mib_per_token,
            "-o",
            ms=3,
            color=color,
            label=f"{label}, all accepted",
        )
        ax_T.plot(
            rejected.verified,
            rejected.mib_per_token,
            "--s",
            ms=3,
            color=color,
            label=f"{label}, all rejected",
        )
        # T = 4 and 8, or the largest T of the CSV when L < 4 leaves neither (T <= L)
        shown = [T for T in (4, 8) if T in set(rows.verified)] or [rows.verified.max()]
        for T, style in zip(shown, ("-o", "--^"), strict=False):
            at_T = rows[rows.verified == T]
            if len(at_T):
                ax_acc.plot(
                    at_T.acceptance,
                    at_T.mib_per_token,
                    style,
                    ms=3,
                    color=color,
                    label=f"{label}, T={T}",
                )
    ax_T.set_xlabel("tokens verified per step T")
    ax_T.set_title("against T (acceptance 100% and 0%)")
    ax_acc.set_xlabel("fraction of drafts accepted, (c - 1) / (T - 1)")
    ax_acc.set_title("against acceptance")
    ax_T.set_ylabel("MiB per committed token (per layer, per sequence)")
    for ax in (ax_T, ax_acc):
        _plain_log_y(ax)
        ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))


def _plot_memory(df: pd.DataFrame, axes) -> None:
    contexts = sorted(df.context.unique())
    # a model without attention layers keeps no KV cache: its requests cost the same at every
    # context (the CSV does not say so otherwise), and "+ KV" would name a cache it lacks
    no_kv = df.groupby(["scheme", "verified"]).per_request_bytes.nunique().eq(1).all()
    for ax, context in zip(axes, contexts, strict=True):
        at_context = df[df.context == context]
        for (scheme, T), rows in at_context.groupby(["scheme", "verified"], sort=False):
            label = (
                scheme
                if scheme in ("conventional", "snapshot")
                else (f"{scheme} L={int(rows.window.iloc[0])}")
            )
            per_request = rows.per_request_bytes.iloc[0] / tr.MIB
            ax.plot(
                rows.memory_gib,
                rows.requests,
                "-" if T == 1 else "--",
                color=SCHEME_COLORS[scheme],
                label=f"{label}, T={T} ({per_request:,.0f} MiB/request)",
            )
        ax.set_xlabel("memory for the decode cache (GiB)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_title("SSM state only" if context == 0
                     else f"SSM state at {context:,} tokens (no attention: no KV)" if no_kv
                     else f"SSM state + KV at {context:,} tokens")
        ax.grid(True, lw=0.3, alpha=0.5)
        ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    axes[0].set_ylabel("requests that fit")


def plot(csv: str | Path) -> Path:
    """Draw the figure of one `traffic_*.csv` (reading nothing else); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv = Path(csv)
    df = read_sweep(csv)
    sweep = df.sweep.iloc[0]
    model = df.model.iloc[0]
    if sweep == "window":
        panels = (df[df.scheme == "replay_shared"].read_format.nunique()
                  + df[df.scheme == "two_precision"].record_layout.nunique())
        nrows = -(-panels // 4)
        fig, grid = plt.subplots(nrows, 4, figsize=(15, 3.9 * nrows), sharey=True,
                                 squeeze=False)
        axes = list(grid.flat)
        for ax in axes[panels:]:
            ax.set_visible(False)
        _plot_window(df, axes[:panels])
        title = ("State-cache traffic per token against the window L (T = 1): conventional "
                 "vs ReplaySSM; dots mark the least traffic")
    else:
        ncols = df.context.nunique() if sweep == "memory" else 2
        height = {"spec": 4.9, "memory": 4.8}.get(sweep, 4.8)
        fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, height), squeeze=False)
        axes = list(axes[0])
    if sweep == "window":
        pass
    elif sweep == "spec":
        _plot_spec(df, *axes)
        title = "Speculative decoding: traffic per committed token"
    elif sweep == "memory":
        _plot_memory(df, axes)
        title = "Requests whose decode cache fits in memory (whole model)"
    else:
        raise ValueError(f"csv: expected a traffic_{{window,spec,memory}} CSV, got sweep {sweep!r}")
    fig.suptitle(f"{title} - {model}", fontsize=9)
    fig.tight_layout()
    png = csv.with_suffix(".png")
    save_small_png(fig, png, dpi=150, source=SOURCE)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


MAX_WINDOW = 65536  # --window's limit: it took 15 s here (2026-12-01), the time linear in L


OUTPUT_RULE = f"""where outputs go (paths relative to the current folder):
  --model in {", ".join(REGENERATE_MODELS)}, default --window and --spec-verified:
                 results/ (the committed results' regenerate command)
  --out DIR      DIR, every file of the run
  anything else  runs/traffic_<model>_<settings>/ (git-ignored); the output line says where
  a file there that is not this experiment's output is replaced only with --force"""


def _folder(text: str) -> Path:
    """--out's folder; an empty one (an unset shell variable) would be the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r}")
    return Path(text)


def default_folder(model: str, window: int, spec_verified: int) -> Path:
    """results/ for a committed model at the default settings, else a runs/ folder named by
    the settings."""
    if model in REGENERATE_MODELS and (window, spec_verified) == (
            Config.window, Config.spec_verified):
        return Path("results")
    words = [model] + ([f"window-{window}"] if window != Config.window else []) + (
        [f"spec-verified-{spec_verified}"] if spec_verified != Config.spec_verified else [])
    return runs_folder("traffic", words)


def parse_args(argv: list[str] | None = None) -> Config:
    return _parse(argv)[0]


def _parse(argv: list[str] | None = None):
    """(config, parser, whether --plot-only was given)."""
    parser = OneLineParser(
        prog=PROG,
        description=(
            "Memory traffic and capacity of SSM decoding: bytes per committed token for "
            "conventional decoding, ReplaySSM (shared checkpoint or two precisions) and "
            "speculative decoding (snapshots vs ReplaySSM), per layer and per sequence. "
            "Writes traffic_{window,spec,memory}_<model>.csv/.png, "
            "traffic_summary_<model>.json and traffic_<model>.meta.json."
        ),
        epilog=OUTPUT_RULE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=Config.model,
        choices=models.names(),
        help=f"model shape (lowprec/models.py; default {Config.model})",
    )
    parser.add_argument("--out", type=_folder, default=None,
                        help="output folder (default: see 'where outputs go' below)")
    parser.add_argument(
        "--window",
        type=int,
        default=Config.window,
        help="ReplaySSM window L for the speculative and memory sweeps and the summary (the "
        f"speculative sweep's T runs up to 8 or L, whichever is smaller; default {Config.window})",
    )
    parser.add_argument(
        "--spec-verified",
        type=int,
        default=Config.spec_verified,
        help="tokens verified per step T for the summary's 'spec' entry and the memory sweep; "
        f"at most --window (default {Config.spec_verified})",
    )
    parser.add_argument(
        "--summary",
        action="store_true",
        help="print the summary as one JSON object on stdout and write nothing",
    )
    parser.add_argument("--no-plot", action="store_true", help="write the CSVs only")
    parser.add_argument("--plot-only", action="store_true",
                        help="compute nothing: redraw the PNGs from the output folder's CSVs, "
                        "refusing a CSV that is not complete and unchanged")
    parser.add_argument("--force", action="store_true",
                        help="replace files that are not this experiment's output")
    args = parser.parse_args(argv)
    if not 1 <= args.window <= MAX_WINDOW:  # the speculative cycles take time linear in L
        parser.error(f"--window: expected an integer in [1, {MAX_WINDOW}], got {args.window}")
    if args.spec_verified < 1:
        parser.error(f"--spec-verified: expected an integer >= 1, got {args.spec_verified}")
    if args.spec_verified > args.window:
        # lowprec.replay's rule (T <= L): a step verifies at most one window of drafts, as the
        # replay_spec cycle and its closed form assume
        parser.error(f"--spec-verified: expected T <= the window L = {args.window} (--window), "
                     f"got {args.spec_verified}")
    if args.plot_only and (args.summary or args.no_plot):
        parser.error("--plot-only: draws the plots; not with --summary or --no-plot")
    out = args.out if args.out is not None else default_folder(
        args.model, args.window, args.spec_verified)
    if not args.summary and is_file(out):
        parser.error(f"--out: expected a folder, got the file {out}")
    if not args.summary and (problem := folder_problem(out)):
        parser.error(f"--out: cannot write under {out}: {problem}")
    config = Config(
        model=args.model,
        out_dir=out,
        verified=tuple(T for T in Config.verified if T <= args.window),  # T <= L as above
        window=args.window,
        spec_verified=args.spec_verified,
        summary_only=args.summary,
        make_plots=not args.no_plot,
    )
    if not args.summary and not args.force:
        written = outputs(config)
        if args.plot_only:
            written = [p for p in written if p.suffix == ".png"]
        # the summary JSON carries no provenance of its own: the run's meta.json beside it does
        own_meta = meta_file(config).is_file() and not output_problem(meta_file(config), SOURCE)
        for path in written:
            header = SCHEMAS[path.stem.split("_")[1]].header if path.suffix == ".csv" else None
            if path == summary_path(config) and own_meta:
                continue
            if problem := output_problem(path, SOURCE, header):
                parser.error(f"--out: {problem}")
    return config, parser, args.plot_only


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    config, parser, plot_only = _parse(argv)
    if config.summary_only:
        json.dump(summary(config), sys.stdout)
        sys.stdout.write("\n")
        return
    try:  # the checks before (os.access) say yes to root for paths it cannot write
        if plot_only:
            for name in SWEEPS:
                plot(csv_path(config, name))
        else:
            run(config, " ".join([PROG, *map(shlex.quote, argv)]))
            if config.make_plots:
                for name in SWEEPS:
                    plot(csv_path(config, name))
    except OSError as error:
        parser.exit(2, f"{PROG}: error: cannot write under {config.out_dir}: {error}\n")
    except BadFile as error:
        parser.exit(2, f"{PROG}: error: --plot-only: {error}\n")
    kinds = "png" if plot_only else "{csv,png}" if config.make_plots else "csv"
    extra = "" if plot_only else (f", traffic_summary_{config.model}.json and "
                                  f"traffic_{config.model}.meta.json")
    print(f"wrote traffic_{{window,spec,memory}}_{config.model}.{kinds}{extra} under "
          f"{config.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
