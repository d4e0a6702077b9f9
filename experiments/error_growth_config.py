"""The configuration of an error-growth run: the arms grammar, the decay ranges, the cells.

``ArmSpec`` is one arm (``parse_arm``/``parse_arms`` read ``--arms``, the grammar in
`experiments.error_growth`'s docstring), ``Memory`` one decay range (``parse_memory``),
``Config`` everything a run depends on (validated on construction), ``cells(config)`` the run's
independent cells and ``recorded_steps`` the steps whose error it records.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from lowprec import formats, philox
from lowprec.policies import Policy, make_policy

SOURCE = "experiments.error_growth"
PROG = "python -m " + SOURCE
SCHEMES = ("every_step", "shared", "separate")
# alias -> (recurrence copy format, its rounding) of a separate arm
ALIASES = {"separate_exact": ("fp64", "rn"), "separate_fp16sr": ("fp16", "sr")}
ARMS = (*SCHEMES, *ALIASES)
RECURRENCES = ("mamba2", "gdn", "kda")
BACKENDS = ("reference", "emulation")
ROUNDINGS = ("rn", "sr")
MEMORY_PROFILES = {"long": (0.9995, 0.99999), "short": (0.9, 0.95)}
SUMMARY_STEPS = (64, 1024, 4096)
# every_step uses the token counter as Philox's write counter, which has 20 bits.
MAX_STEPS = philox.FLUSH_LIMIT
# The emulation's state update refuses a counter of 2^20 - 1 before its call, so one step less.
MAX_EMULATION_STEPS = philox.FLUSH_LIMIT - 1
EMULATION_ARMS_TEXT = (
    "the emulation backend runs every_step with any format but fp64 (rn or sr), separate "
    "with any read-copy format but fp64 (a recurrence copy in fp64 is kept in fp32), and "
    "shared only with rn and an element format but fp64 (fp32, fp16, bf16, fp8_e4m3, fp8_e5m2)"
)



@dataclass(frozen=True)
class ArmSpec:
    """One simulated policy: its scheme, the recurrence copy (``hi``: the stored state for
    every_step and shared) and the read copy (``lo``), each a format and a rounding."""

    scheme: str
    lo_format: str
    lo_rounding: str
    hi_format: str
    hi_rounding: str

    @classmethod
    def single(cls, scheme: str, fmt: str, rounding: str) -> ArmSpec:
        """every_step or shared: one copy in ``fmt`` with ``rounding``."""
        return cls(scheme, fmt, rounding, fmt, rounding)

    @classmethod
    def separate(cls, hi_format: str, hi_rounding: str, lo_format: str) -> ArmSpec:
        return cls("separate", lo_format, "rn", hi_format, hi_rounding)

    @property
    def label(self) -> str:
        """The canonical arm: ``every_step:fp16:rn``, ``separate:fp16:sr:nvfp4``."""
        if self.scheme == "separate":
            return f"separate:{self.hi_format}:{self.hi_rounding}:{self.lo_format}"
        return f"{self.scheme}:{self.lo_format}:{self.lo_rounding}"

    @property
    def sr(self) -> bool:
        """Whether a copy of the arm draws SR words."""
        return "sr" in (self.lo_rounding, self.hi_rounding)

    def policy(self, window: int, seed: int, sr_bits: int = philox.DEFAULT_SR_BITS,
               philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS) -> Policy:
        """The `lowprec.policies.Policy` of the arm with windows of ``window`` tokens and SR
        words of ``sr_bits`` bits from ``philox_rounds``-round Philox (an arm without SR
        takes the defaults)."""
        if self.scheme == "separate":
            sr = self.hi_rounding == "sr"
            return Policy("separate", fmt=self.lo_format, rounding="rn",
                          hi_fmt=self.hi_format, hi_rounding=self.hi_rounding, window=window,
                          seed=seed if sr else 0,
                          sr_bits=sr_bits if sr else philox.DEFAULT_SR_BITS,
                          philox_rounds=philox_rounds if sr else philox.DEFAULT_PHILOX_ROUNDS)
        return make_policy(self.scheme, self.lo_format, self.lo_rounding, window=window,
                           seed=seed, sr_bits=sr_bits, philox_rounds=philox_rounds)


@dataclass(frozen=True)
class Memory:
    """A decay range ``[low, high)`` and its name in the CSV."""

    name: str
    low: float
    high: float


@dataclass(frozen=True)
class Cell:
    """One independent piece of a run: one arm at one window and one SR setting (an arm
    without SR has the defaults 16 bits, 7 rounds, which it does not use), over every memory
    profile and seed of the config (the simulator's batch). ``index`` is its place in
    ``cells(config)``, which is the order of its rows in the CSV."""

    index: int
    window: int
    arm: ArmSpec
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS

    @property
    def key(self) -> str:
        """Unique per cell of a run and stable across runs: the cell store's key."""
        return f"L{self.window}/{self.arm.label}/sr{self.sr_bits}x{self.philox_rounds}"


@dataclass(frozen=True)
class Config:
    """Everything a run depends on (``out``, ``plot`` and ``progress`` do not change numbers).
    ``window`` is one L or a tuple of them (stored as a tuple)."""

    recurrence: str = "mamba2"
    dv: int = 8
    dk: int = 32
    heads: int = 1
    seeds: int = 4
    seed0: int = 0
    steps: int = 4096
    window: tuple[int, ...] = (16,)
    memory: tuple[Memory, ...] = tuple(Memory(n, *r) for n, r in MEMORY_PROFILES.items())
    arms: tuple[ArmSpec, ...] = field(
        default_factory=lambda: parse_arms("every_step,shared,separate_exact,separate_fp16sr",
                                           "fp8_e4m3_row", "sr")
    )
    log_grid: int = 0
    out: str = "runs/error_growth_custom/error_growth.csv"
    plot: str | None = "runs/error_growth_custom/error_growth.png"
    progress: bool = True
    device: str = "cpu"
    threads: int = 1
    backend: str = "reference"
    sr_bits: tuple[int, ...] = (philox.DEFAULT_SR_BITS,)
    philox_rounds: tuple[int, ...] = (philox.DEFAULT_PHILOX_ROUNDS,)

    def __post_init__(self):
        if self.recurrence not in RECURRENCES:
            raise ValueError(
                f"recurrence: expected one of {list(RECURRENCES)}, got {self.recurrence!r}"
            )
        windows = (self.window,) if isinstance(self.window, int) else self.window
        if not isinstance(windows, tuple) or not windows:
            raise ValueError(f"window: expected an int or a non-empty tuple of ints, got "
                             f"{self.window!r}")
        for w in windows:
            _check_int("window", w, 1)
        if len(set(windows)) != len(windows):
            raise ValueError(f"window: expected distinct windows, got {list(windows)}")
        object.__setattr__(self, "window", windows)
        for name, check in (("sr_bits", philox.check_sr_bits),
                            ("philox_rounds", philox.check_philox_rounds)):
            values = getattr(self, name)
            values = (values,) if isinstance(values, int) else values
            if not isinstance(values, tuple) or not values:
                raise ValueError(f"{name}: expected an int or a non-empty tuple of ints, got "
                                 f"{getattr(self, name)!r}")
            values = tuple(check(v) for v in values)
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: expected distinct values, got {list(values)}")
            object.__setattr__(self, name, values)
        for name in ("dv", "dk", "heads", "seeds", "steps"):
            _check_int(name, getattr(self, name), 1)
        _check_int("seed0", self.seed0, 0)
        _check_int("log_grid", self.log_grid, 0)
        _check_int("threads", self.threads, 1)
        if self.steps > MAX_STEPS:
            raise ValueError(f"steps: expected at most {MAX_STEPS}, got {self.steps}")
        if self.heads * self.dv * self.dk > philox.ELEMENT_LIMIT:
            raise ValueError(
                f"heads * dv * dk: expected at most {philox.ELEMENT_LIMIT} state elements per "
                f"sequence, got {self.heads * self.dv * self.dk}"
            )
        if not self.memory:
            raise ValueError("memory: expected at least one decay range, got none")
        names = [m.name for m in self.memory]
        # by bounds: 'short' and '0.9,0.95' are one range under two names (it would run twice)
        if len({(m.low, m.high) for m in self.memory}) != len(names):
            raise ValueError(f"memory: expected distinct ranges, got {names}")
        for m in self.memory:
            _check_memory(m.low, m.high)
        if self.seed0 + self.seeds > philox.SEED_LIMIT:
            raise ValueError(f"seed0: expected seed0 + seeds <= 2^64, got {self.seed0}")
        if len(self.memory) * self.seeds > philox.SLOT_LIMIT:
            raise ValueError(
                f"seeds: expected memories * seeds <= {philox.SLOT_LIMIT} Philox slots, "
                f"got {len(self.memory) * self.seeds}"
            )
        if not self.arms:
            raise ValueError("arms: expected at least one arm, got none")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms: expected distinct arms, got {[a.label for a in self.arms]}")
        for spec in self.arms:
            _check_arm(spec, self.dv, self.dk)
        _check_device(self.device)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {self.backend!r}")
        if self.backend == "emulation":
            _check_emulation(self)
        _check_memory_use(self)


def memory_estimate(c: Config) -> tuple[int, int]:
    """(bytes on the run's device, bytes in host memory), roughly: four fp64 copies of the
    state for the arm of a cell and for the exact run, the exact outputs at the recorded steps
    (on the device), and the fp64 errors of every arm, sequence and recorded step (host)."""
    batch = len(c.memory) * c.seeds
    states = 2 * batch * c.heads * c.dv * c.dk * 8 * 4
    n_windows = math.ceil(c.steps / min(c.window))
    recorded = c.steps if c.log_grid == 0 else min(
        c.steps, (min(c.log_grid, n_windows) + len(SUMMARY_STEPS) + 1) * max(c.window))
    exact = recorded * batch * c.heads * c.dv * 8
    errors = len(c.arms) * len(c.window) * batch * recorded * 8 * 4  # and the frame's columns
    return (states + exact, errors) if c.device != "cpu" else (0, states + exact + errors)


def _check_memory_use(c: Config) -> None:
    """Refuse a run that cannot fit, before the progress bar starts (not an allocation failure
    or thrashing later): host memory here, and the GPU's for a cuda device."""
    device_bytes, host_bytes = memory_estimate(c)
    try:
        host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        host_total = None
    limits = [("host memory", host_bytes, host_total)]
    if c.device != "cpu" and torch.cuda.is_available():
        limits.append((f"{c.device} memory", device_bytes,
                       torch.cuda.get_device_properties(torch.device(c.device)).total_memory))
    for where, need, total in limits:
        if total and need > 0.8 * total:
            raise ValueError(
                f"size: this run needs about {need / 2**30:.1f} GiB of {where}, more than 80% "
                f"of the {total / 2**30:.1f} GiB here (fewer --seeds, --heads, arms or a "
                "smaller --dv/--dk or --log-grid)")


def _check_emulation(c: Config) -> None:
    """The limits of the emulation kernels, beyond those of the reference."""
    if (c.sr_bits, c.philox_rounds) != ((philox.DEFAULT_SR_BITS,),
                                        (philox.DEFAULT_PHILOX_ROUNDS,)):
        missing = _emulation_without_sr_settings()
        if missing:
            raise ValueError(f"sr_bits: the installed emulation's {missing} takes no sr_bits "
                             "and philox_rounds: the emulation backend runs the default setting "
                             "only (use --backend reference)")
    if c.steps > MAX_EMULATION_STEPS:
        raise ValueError(
            f"steps: expected at most {MAX_EMULATION_STEPS} with the emulation backend (Philox "
            f"token counter), got {c.steps}"
        )
    if len(c.memory) * c.seeds >= philox.SLOT_LIMIT:
        raise ValueError(
            f"seeds: expected memories * seeds < {philox.SLOT_LIMIT} slots with the emulation "
            f"backend, got {len(c.memory) * c.seeds}"
        )
    for spec in c.arms:
        supported = formats.get(spec.lo_format).element.bits <= 32
        if spec.scheme == "every_step" or spec.scheme == "shared":
            supported = supported and formats.get(spec.hi_format).element.bits <= 32
        if spec.scheme == "shared":
            fmt = formats.get(spec.lo_format)
            supported = supported and fmt.block is None and spec.lo_rounding == "rn"
        if not supported:
            raise ValueError(f"arms: {EMULATION_ARMS_TEXT}; got {spec.label}")


def _emulation_without_sr_settings() -> str | None:
    """The first emulation cache whose ``empty`` lacks ``sr_bits``/``philox_rounds``, or None."""
    import inspect

    from emulation.gdn_replay_decode import GDNReplayCache
    from emulation.replay_decode import ReplayCache
    from emulation.state_update import StateCache

    for cls in (ReplayCache, StateCache, GDNReplayCache):
        parameters = inspect.signature(cls.empty).parameters
        if not {"sr_bits", "philox_rounds"} <= set(parameters):
            return f"{cls.__name__}.empty"
    return None


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def _check_device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")


def _check_memory(low: float, high: float) -> None:
    if not (0.0 < low <= high < 1.0):
        raise ValueError(f"memory: expected 0 < LO <= HI < 1, got LO={low!r}, HI={high!r}")


def _check_arm(spec: ArmSpec, dv: int, dk: int) -> None:
    if spec.scheme not in SCHEMES:
        raise ValueError(f"arms: expected schemes among {list(SCHEMES)}, got {spec.scheme!r}")
    for name in ("lo_format", "hi_format"):
        if getattr(spec, name) not in formats.names():
            raise ValueError(f"arms: expected formats among {formats.names()}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")
    for name in ("lo_rounding", "hi_rounding"):
        if getattr(spec, name) not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")
    if spec.scheme == "separate" and spec.lo_rounding != "rn":
        raise ValueError(f"rounding: the read copy of a separate arm is always RN, got "
                         f"{spec.lo_rounding!r} in {spec.label}")
    if spec.scheme != "separate" and (spec.hi_format, spec.hi_rounding) != (
            spec.lo_format, spec.lo_rounding):
        raise ValueError(f"arms: {spec.scheme} keeps one copy, got hi {spec.hi_format} "
                         f"{spec.hi_rounding} and lo {spec.lo_format} {spec.lo_rounding}")
    if spec.scheme == "separate" and spec.hi_format == "fp64" and spec.hi_rounding != "rn":
        raise ValueError(f"rounding: a recurrence copy in fp64 is exact (nothing to round), "
                         f"got {spec.hi_rounding!r} in {spec.label}")
    for name in {spec.lo_format, spec.hi_format}:
        fmt = formats.get(name)
        if fmt.block is not None:
            fmt.block_length((dv, dk))  # raises ValueError naming the shape and the block


def parse_memory(text: str) -> Memory:
    """``'long'``, ``'short'`` or ``'LO,HI'`` (named ``'LO..HI'`` in the CSV, comma-free)."""
    if text in MEMORY_PROFILES:
        return Memory(text, *MEMORY_PROFILES[text])
    parts = text.split(",")
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"memory: expected 'long', 'short' or 'LO,HI' (two numbers), got {text!r}"
        ) from None
    _check_memory(low, high)
    return Memory(f"{low!r}..{high!r}", low, high)  # repr: exact (%g kept 6 digits)


def parse_arm(item: str, fmts: list[str], roundings: list[str]) -> list[ArmSpec]:
    """The arms of one ``--arms`` item (see the module docstring's grammar); a missing format
    expands over ``fmts``, a missing rounding of every_step or shared over ``roundings``.

    ``separate:fp16:sr:nvfp4`` -> one arm; ``separate:bf16:nvfp4`` -> the recurrence copy
    RN; ``separate:fp16:sr`` -> read copies over ``fmts``; ``separate_fp16sr:nvfp4`` ->
    ``separate:fp16:sr:nvfp4``."""
    parts = item.split(":")
    if not all(parts):
        raise ValueError(f"arms: expected items without empty fields, got {item!r}")
    scheme, rest = parts[0], parts[1:]
    if scheme not in ARMS:
        raise ValueError(f"arms: expected arms among {list(ARMS)}, got {scheme!r} in {item!r}")
    if scheme in ALIASES:
        if len(rest) > 2 or (len(rest) == 2 and rest[1] != "rn"):
            raise ValueError(f"arms: expected {scheme}[:READ_FORMAT] (its read copy is RN), "
                             f"got {item!r}")
        hi_format, hi_rounding = ALIASES[scheme]
        return [ArmSpec.separate(hi_format, hi_rounding, f) for f in (rest[:1] or fmts)]
    if scheme == "separate":
        if not rest or len(rest) > 3:
            raise ValueError("arms: expected separate:HI_FORMAT[:ROUNDING][:READ_FORMAT], got "
                             f"{item!r}")
        hi_format, rest = rest[0], rest[1:]
        hi_rounding = rest.pop(0) if rest and rest[0] in ROUNDINGS else "rn"
        if len(rest) > 1:
            raise ValueError(f"arms: expected separate:HI_FORMAT[:ROUNDING][:READ_FORMAT], got "
                             f"{item!r} ({rest[0]!r} is not a rounding)")
        return [ArmSpec.separate(hi_format, hi_rounding, f) for f in (rest or fmts)]
    if len(rest) > 2:
        raise ValueError(f"arms: expected {scheme}[:FORMAT[:ROUNDING]], got {item!r}")
    item_fmts = rest[:1] or fmts
    item_roundings = rest[1:2] or roundings
    return [ArmSpec.single(scheme, f, r) for f in item_fmts for r in item_roundings]


def parse_arms(arms: str, fmts: str, rounding: str) -> tuple[ArmSpec, ...]:
    """Arm specs from ``--arms``, ``--formats`` and ``--rounding`` (all comma-separated).
    ``every_step,shared`` with ``fmts='fp16,nvfp4'`` gives four arms. Duplicates (an alias and
    its canonical form included) are dropped, the first occurrence keeping its place."""
    default_fmts = _split("formats", fmts)
    default_roundings = _split("rounding", rounding)
    # checked when no arm uses them too (--formats fp7 beside --arms shared:fp16 is an error)
    for fmt in default_fmts:
        if fmt not in formats.names():
            raise ValueError(f"formats: expected formats among {formats.names()}, got {fmt!r}")
    for r in default_roundings:
        if r not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got {r!r}")
    specs: list[ArmSpec] = []
    for item in _split("arms", arms):
        for spec in parse_arm(item, default_fmts, default_roundings):
            _check_arm_names(spec)
            if spec not in specs:
                specs.append(spec)
    return tuple(specs)


def _check_arm_names(spec: ArmSpec) -> None:
    """Formats and roundings by name (the shape checks wait for the config)."""
    for name in ("lo_format", "hi_format"):
        if getattr(spec, name) not in formats.names():
            raise ValueError(f"formats: expected formats among {formats.names()}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")
    for name in ("lo_rounding", "hi_rounding"):
        if getattr(spec, name) not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")


def _split(name: str, text: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not all(items):
        raise ValueError(
            f"{name}: expected a comma-separated list without empty items, got {text!r}"
        )
    return items


def recorded_steps(steps: int, window: int, log_grid: int) -> np.ndarray:
    """Sorted steps (from 1) whose rel_err is recorded: all of them for ``log_grid = 0``,
    else every step of the windows at ``log_grid`` geometrically spaced window indices over
    the run and of the windows holding steps 64, 1,024, 4,096 and the last step."""
    if log_grid == 0:
        return np.arange(1, steps + 1)
    n_windows = math.ceil(steps / window)
    points = min(log_grid, n_windows)  # more points than windows would repeat them
    grid = np.unique(np.rint(np.geomspace(1, n_windows, points))).astype(int).tolist()
    marks = [t for t in SUMMARY_STEPS if t <= steps] + [steps]
    chosen = sorted(set(grid) | {math.ceil(t / window) for t in marks})
    picked = [np.arange((w - 1) * window + 1, min(w * window, steps) + 1) for w in chosen]
    return np.concatenate(picked)


def sr_settings(config: Config) -> list[tuple[int, int]]:
    """The (sr_bits, philox_rounds) settings of the run: every bits value with every rounds
    value, bits outer."""
    return [(b, r) for b in config.sr_bits for r in config.philox_rounds]


def cells(config: Config) -> list[Cell]:
    """The run's independent cells, windows outer, then arms in the config's order, then the
    SR settings (``sr_settings``) of an arm with an SR copy (an arm without one: one cell, at
    the defaults): the order of the CSV's rows."""
    default = [(philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)]
    grid = [(w, arm, bits, rounds) for w in config.window for arm in config.arms
            for bits, rounds in (sr_settings(config) if arm.sr else default)]
    return [Cell(i, *item) for i, item in enumerate(grid)]

