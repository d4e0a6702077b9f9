"""The simulation of an error-growth cell: its inputs, the exact run, and the two backends.

``_Inputs`` draws every slot's input stream, ``exact_outputs`` runs the FP64 reference once
per window, and ``run_cell`` steps one cell through the reference simulator
(`lowprec.policies.Simulator`) or the Triton emulation (``_emulation_step``: Mamba-2's
kernels through ``mamba2_kernel_inputs``, GDN/KDA's generic step) and returns its rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import numpy as np
import pandas as pd
import torch

from experiments.error_growth_config import Cell, Config, recorded_steps
from experiments.error_growth_table import CSV_COLUMNS
from lowprec import philox
from lowprec._checks import check_float, check_ndim, check_shape
from lowprec.metrics import rel_err
from lowprec.policies import Simulator, advance_state

# Whole input chunks replay as CUDA graphs on a GPU (_Driver); False steps one token at a time
# (the tests compare the two).
CUDA_GRAPHS = True
# Inputs are drawn this many steps at a time; the chunk is part of the definition of a seed's
# input stream (changing it changes the numbers), so it is a constant, not an option.
INPUT_CHUNK = 256


class _Inputs:
    """The input stream of every (memory, seed) slot, drawn INPUT_CHUNK steps at a time.

    Per seed and chunk the draws are, in this order: v [C, H, dv], k [C, H, dk],
    q [C, H, dk], the uniform behind the decay [C, H] (KDA: [C, H, dk]), and for GDN and KDA
    beta [C, H]. The slots of one seed share these draws across memory profiles.
    """

    def __init__(self, config: Config, prefetch: bool | None = None):
        self.config = config
        self.generators = [
            torch.Generator().manual_seed(config.seed0 + s) for s in range(config.seeds)
        ]
        lows = torch.tensor([m.low for m in config.memory], dtype=torch.float64, device="cpu")
        highs = torch.tensor([m.high for m in config.memory], dtype=torch.float64, device="cpu")
        self.low, self.span = lows, highs - lows
        self.chunk: list[torch.Tensor] = []
        self.position = INPUT_CHUNK
        # On a GPU the CPU draws (2.5 ms a step at the real layer shape on a 2-core machine)
        # would stall the loop: one worker thread draws the next chunk while the GPU steps.
        # The draws and their order are the same, so the inputs are the same.
        prefetch = config.device != "cpu" if prefetch is None else prefetch
        self.pool = ThreadPoolExecutor(max_workers=1) if prefetch else None
        self.pending = self.pool.submit(self._draw) if self.pool else None

    def _draw(self) -> list:
        c = self.config
        per_seed = [_draw_seed(gen, c) for gen in self.generators]
        n_mem = len(c.memory)

        def slots(i):  # [C, seeds, ...] -> [C, memories * seeds, ...], memory-major slots
            t = torch.stack([p[i] for p in per_seed], dim=1)
            return t.repeat(1, n_mem, *([1] * (t.dim() - 2))).contiguous()

        v, k, q, u = (slots(i) for i in range(4))
        per_slot = (1, n_mem * c.seeds) + (1,) * (u.dim() - 2)  # broadcast over [C, B, ...]
        low = self.low.repeat_interleave(c.seeds).view(per_slot)
        span = self.span.repeat_interleave(c.seeds).view(per_slot)
        a = low + span * u
        beta = slots(4) if c.recurrence != "mamba2" else None
        return [None if x is None else x.to(c.device) for x in (v, k, q, a, beta)]

    def next(self):
        """``(a, v, k, q, beta)`` of the next step, batch = memories * seeds."""
        if self.position == INPUT_CHUNK:
            if self.pool is None:
                self.chunk = self._draw()
            else:
                self.chunk = self.pending.result()
                self.pending = self.pool.submit(self._draw)
            self.position = 0
        p = self.position
        self.position += 1
        v, k, q, a, beta = self.chunk
        return a[p], v[p], k[p], q[p], None if beta is None else beta[p]

    def next_chunk(self) -> tuple:
        """``(a, v, k, q, beta)`` of the next INPUT_CHUNK steps ``[C, batch, ...]``; only at a
        chunk boundary (the steps ``next`` would return, in one piece)."""
        if self.position != INPUT_CHUNK:
            raise RuntimeError("next_chunk: the stream is inside a chunk")
        self.next()
        self.position = INPUT_CHUNK
        v, k, q, a, beta = self.chunk
        return a, v, k, q, beta

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _draw_seed(gen: torch.Generator, c: Config) -> tuple:
    """One seed's next INPUT_CHUNK steps, ``(v, k, q, u, beta)``, in _Inputs' draw order."""

    def draw(*shape, uniform=False):
        sample = torch.rand if uniform else torch.randn
        return sample(*shape, generator=gen, dtype=torch.float64, device="cpu")

    v = draw(INPUT_CHUNK, c.heads, c.dv)
    k = draw(INPUT_CHUNK, c.heads, c.dk)
    q = draw(INPUT_CHUNK, c.heads, c.dk)
    u = draw(INPUT_CHUNK, c.heads, *((c.dk,) if c.recurrence == "kda" else ()), uniform=True)
    if c.recurrence == "mamba2":
        return v, k, q, u, None
    beta = torch.sigmoid(draw(INPUT_CHUNK, c.heads))
    k = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True)
    q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    return v, k, q, u, beta


def make_inputs(config: Config, steps: int) -> list[tuple]:
    """The first ``steps`` inputs ``(a, v, k, q, beta)`` of ``run(config)``, for tests."""
    stream = _Inputs(config)
    return [stream.next() for _ in range(steps)]



_EXACT_CACHE: dict = {}


def exact_outputs(config: Config, window: int, bar=None) -> tuple[np.ndarray, torch.Tensor]:
    """``(steps_kept, y)``: the recorded steps of ``window`` and the exact FP64 outputs there,
    ``y [len(steps_kept), memories * seeds, heads, dv]`` on the run's device. Computed once
    per (config, window) and process."""
    c = config
    key = (c.recurrence, c.dv, c.dk, c.heads, c.seeds, c.seed0, c.steps, c.memory, c.log_grid,
           c.device, window)
    if key in _EXACT_CACHE:
        return _EXACT_CACHE[key]
    steps_kept = recorded_steps(c.steps, window, c.log_grid)
    ys = []
    with _on_device(c), _cpu_threads(c.threads), torch.no_grad():
        drive = _Driver(c, _exact_step(c), int(steps_kept[-1]), steps_kept, in_place=True)
        for _, y in drive.outputs(bar):
            ys.append(y.clone())
    result = (steps_kept, torch.stack(ys))
    _EXACT_CACHE.clear()  # one entry: a sweep over windows needs one at a time
    _EXACT_CACHE[key] = result
    return result


def run_cell(config: Config, cell: Cell, bar=None,
             on_stop: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """The rows of one cell (``CSV_COLUMNS``; memory, seed, step order), from the cell's own
    input stream and the exact outputs: the same rows wherever and with whatever other cells
    it runs. A cell returns only complete rows: Ctrl-C or SIGTERM (a KeyboardInterrupt) in
    its step loop is raised again, after ``on_stop`` was given the whole windows done (a
    frame whose ``attrs['steps_done']`` says how far it got)."""
    c = config
    batch = len(c.memory) * c.seeds
    steps_kept, y_exact = exact_outputs(c, cell.window, bar=bar)
    errors = torch.full((batch, len(steps_kept)), float("nan"), dtype=torch.float64)
    with _on_device(c), _cpu_threads(c.threads), torch.no_grad():
        if c.backend == "emulation":
            step = _emulation_step(c, cell, batch)
        else:
            policy = cell.arm.policy(cell.window, c.seed0, cell.sr_bits, cell.philox_rounds)
            step = Simulator(c.recurrence, policy, batch, c.heads, c.dv, c.dk,
                             dtype=torch.float64).step
        # the emulation's caches change in place; the reference Simulator rebinds its state
        drive = _Driver(c, step, int(steps_kept[-1]), steps_kept,
                        in_place=c.backend == "emulation")
        try:
            for column, (_, y_hat) in enumerate(drive.outputs(bar)):
                errors[:, column] = rel_err(y_hat, y_exact[column]).cpu()
        except KeyboardInterrupt:
            if on_stop is not None:  # the whole windows done
                done = drive.done
                whole = steps_kept <= done - done % cell.window
                frame = _to_frame(c, cell, steps_kept[whole], errors[:, : int(whole.sum())])
                frame.attrs["steps_done"] = done
                on_stop(frame)
            raise
    return _to_frame(c, cell, steps_kept, errors)


def _exact_step(c: Config):
    """The exact FP64 run as a step function whose state is updated in place (so that a CUDA
    graph of its steps replays on the same buffers); the update is the `Simulator`'s."""
    state = torch.zeros(len(c.memory) * c.seeds, c.heads, c.dv, c.dk, dtype=torch.float64)

    def step(a, v, k, q, beta):
        state.copy_(advance_state(c.recurrence, state, a, v, k, beta))
        return (state @ q[..., :, None])[..., 0]

    return step


class _Driver:
    """Steps 1..``last`` of a config's input stream through ``step``; ``outputs`` yields
    ``(t, y)`` at the kept steps, in order, and ``done`` counts the steps taken.

    On a GPU a step-by-step loop is bound by the host (kernel launches and Python, about 1 ms
    a step at the real layer shapes, against tens of microseconds of GPU work), so an
    ``in_place`` step (all its state in buffers it updates in place) runs whole INPUT_CHUNK
    chunks as one CUDA graph: captured once after an eager first chunk (which compiles and
    warms every kernel), then replayed on fixed input buffers that each chunk is copied into.
    The graph runs the same kernels on the same values, so the outputs are those of the
    step-by-step loop; a step that cannot be captured runs step by step, with a warning."""

    def __init__(self, c: Config, step, last: int, steps_kept: np.ndarray, in_place: bool):
        self.c, self.step, self.last = c, step, last
        self.keep = np.zeros(last + 1, dtype=bool)
        self.keep[steps_kept[steps_kept <= last]] = True
        self.graphed = CUDA_GRAPHS and in_place and torch.device(c.device).type == "cuda"
        self.done = 0

    def outputs(self, bar=None):
        inputs = _Inputs(self.c)
        try:
            while self.done < self.last:
                take = min(INPUT_CHUNK, self.last - self.done)
                if self.graphed and self.done > 0 and take == INPUT_CHUNK:
                    yield from self._graph_chunk(inputs.next_chunk(), bar)
                    continue
                for _ in range(take):
                    y = self.step(*inputs.next())
                    self.done += 1
                    if self.keep[self.done]:
                        yield self.done, y
                    if bar is not None:
                        bar.update()
        finally:
            inputs.close()

    def _graph_chunk(self, chunk, bar):
        if not hasattr(self, "graph"):
            self._capture(chunk)
        if self.graph is None:  # not capturable: step by step
            for i in range(INPUT_CHUNK):
                y = self.step(*(None if x is None else x[i] for x in chunk))
                self.done += 1
                if self.keep[self.done]:
                    yield self.done, y
                if bar is not None:
                    bar.update()
            return
        for buffer, x in zip(self.buffers, chunk, strict=True):
            if buffer is not None:
                buffer.copy_(x)
        self.graph.replay()
        first = self.done
        self.done += INPUT_CHUNK
        if bar is not None:
            bar.update(INPUT_CHUNK)
        for t in range(first + 1, self.done + 1):
            if self.keep[t]:
                yield t, self.ys[t - first - 1]

    def _capture(self, chunk) -> None:
        self.buffers = [None if x is None else x.clone() for x in chunk]
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the input thread's copies to the GPU go on while this one captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                ys = [self.step(*(None if b is None else b[i] for b in self.buffers))
                      for i in range(INPUT_CHUNK)]
                self.ys = torch.stack(ys)
        except RuntimeError as error:  # a launch that a graph cannot hold
            warnings.warn(f"error_growth: stepping without a CUDA graph ({error})", stacklevel=2)
            graph = None
        self.graph = graph


@contextmanager
def _on_device(c: Config):
    """lowprec's factory calls (zeros, arange) follow the default device; the device context
    intercepts every torch call (half of a GPU run's host time), so it is entered only for a
    GPU."""
    with torch.device(c.device) if c.device != "cpu" else nullcontext():
        yield


def mamba2_kernel_inputs(a, v, k, q, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    """``(x, dt, A, B, C)`` of the Mamba-2 kernels for the generic step S_t = a S_{t-1} + v k^T,
    y = S q (``a [b, h]``, ``v [b, h, dv]``, ``k, q [b, h, dk]``), in ``dtype``:

        dt = -log(a)   the processed dt: call with dt_softplus=False and no dt_bias
        A  = -1        per head, so that exp(dt A) = a
        x  = v / dt    with the rounded dt, so that dt x = v up to one rounding of x
        B  = k, C = q  ngroups = nheads: each head its own B and C

    In fp32, exp(dt A) and dt x are a and v to a few units of 2^-24 (relative).
    """
    check_float("a", a)
    check_ndim("a", a, 2, "[b, h]")
    b, h = a.shape
    for name, t in (("v", v), ("k", k), ("q", q)):
        check_float(name, t)
        check_ndim(name, t, 3, f"[{b}, {h}, d]")
        check_shape(name, t, (b, h, t.shape[-1]))
    check_shape("q", q, k.shape)
    dt = (-torch.log(a)).to(dtype)
    x = (v / dt.to(v.dtype)[..., None]).to(dtype)
    A = torch.full((a.shape[-1],), -1.0, dtype=dtype, device=a.device)
    return x, dt, A, k.to(dtype), q.to(dtype)


def _emulation_step(c: Config, cell: Cell, batch: int):
    """A function ``(a, v, k, q, beta) -> y_hat`` (the generic inputs) that advances one
    cell's emulation cache by one token: every_step on a ``StateCache`` (the output reads the
    stored state), the windowed arms on a ``ReplayCache`` (Mamba-2) or ``GDNReplayCache``
    (GDN, KDA: per-channel decay) with the arm's recurrence copy (fp64 kept in fp32) and read
    copy (RN). Slot b of the cache is slot b of the reference's batch and the seed is
    ``seed0``, so SR uses the same Philox words; the cell's SR setting is passed to the cache
    only where it differs from the default (16 bits, 7 rounds)."""
    # Imported here: the reference backend needs neither Triton nor the emulation (and
    # emulation.numerics switches Triton's interpreter on without CUDA).
    from emulation.gdn_replay_decode import GDNReplayCache, gdn_generic_step, kda_generic_step
    from emulation.replay_decode import ReplayCache, mamba2_replay_decode
    from emulation.state_update import StateCache, mamba2_state_update

    spec, window = cell.arm, cell.window
    shape = (batch, c.heads, c.dv, c.dk)
    sr = {}
    if spec.sr and (cell.sr_bits, cell.philox_rounds) != (philox.DEFAULT_SR_BITS,
                                                          philox.DEFAULT_PHILOX_ROUNDS):
        sr = {"sr_bits": cell.sr_bits, "philox_rounds": cell.philox_rounds}
    # Every slot advances in lockstep and _check_emulation bounds the steps, so the counters
    # stay in range: on a GPU the per-call range check (a stream sync that stops the host from
    # running ahead) is skipped; on the CPU it costs nothing and stays.
    check = c.device == "cpu"
    hi_format = "fp32" if spec.hi_format == "fp64" else spec.hi_format
    if spec.scheme == "every_step":
        cache = StateCache.empty(*shape, format=spec.lo_format, rounding=spec.lo_rounding,
                                 seed=c.seed0, device=c.device, **sr)
    elif c.recurrence == "mamba2":
        cache = ReplayCache.empty(*shape, ngroups=c.heads, window=window, hi_format=hi_format,
                                  hi_rounding=spec.hi_rounding, lo_format=spec.lo_format,
                                  seed=c.seed0, act_dtype=torch.float32, device=c.device, **sr)
    else:
        cache = GDNReplayCache.empty(*shape, per_channel=c.recurrence == "kda", window=window,
                                     hi_format=hi_format, hi_rounding=spec.hi_rounding,
                                     lo_format=spec.lo_format, seed=c.seed0,
                                     act_dtype=torch.float32, device=c.device, **sr)
    if c.recurrence != "mamba2":
        generic = kda_generic_step if c.recurrence == "kda" else gdn_generic_step

        def step(a, v, k, q, beta):
            return generic(cache, a, v, k, q, beta, check_counters=check)

        return step
    if spec.scheme == "every_step":

        def step(a, v, k, q, beta):
            return mamba2_state_update(cache, *mamba2_kernel_inputs(a, v, k, q),
                                       dt_softplus=False, output_from="stored",
                                       check_counters=check)

        return step

    def step(a, v, k, q, beta):
        return mamba2_replay_decode(cache, *mamba2_kernel_inputs(a, v, k, q), dt_softplus=False,
                                    check_counters=check)

    return step


@contextmanager
def _cpu_threads(n: int):
    """Run with ``n`` torch CPU threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _to_frame(c: Config, cell: Cell, steps_kept: np.ndarray, errors: torch.Tensor
              ) -> pd.DataFrame:
    """A cell's rows ordered by memory, seed, step (``errors [memory * seed, step]``)."""
    n_mem, n_steps = len(c.memory), len(steps_kept)
    mem_idx = np.repeat(np.arange(n_mem), c.seeds * n_steps)
    # seeds reach 2^64 - 1 (Philox keys): past int64, uint64
    kind = np.int64 if c.seed0 + c.seeds <= 2**63 else np.uint64
    seed = np.tile(np.repeat(np.arange(c.seeds, dtype=kind), n_steps), n_mem)
    seed += kind(c.seed0)
    arm = cell.arm
    frame = pd.DataFrame(
        {
            "recurrence": c.recurrence,
            "arm": arm.label,
            "hi_format": arm.hi_format,
            "hi_rounding": arm.hi_rounding,
            "lo_format": arm.lo_format,
            "lo_rounding": arm.lo_rounding,
            "sr_bits": cell.sr_bits,
            "philox_rounds": cell.philox_rounds,
            "memory": np.array([m.name for m in c.memory], dtype=object)[mem_idx],
            "window": cell.window,
            "seed": seed,
            "step": np.tile(steps_kept, n_mem * c.seeds),
            "rel_err": errors.reshape(-1).numpy(),
        }
    )
    return frame[list(CSV_COLUMNS)]
