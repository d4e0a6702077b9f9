"""ReplaySSM bookkeeping for a batch of slots: checkpoint copies, the ring, the cursors.

No GPU code: this is the reference the kernels' control flow follows. A cache holds, per slot,

- ``hi`` (recurrence copy) and ``lo`` (read copy) of the checkpoint, ``[slots, h, dv, dk]``,
  stored as their dequantised values in the cache dtype (``Policy.write_copies`` decides what
  each holds: one FP64 copy for ``exact``, one rounded copy for ``shared``, two for
  ``separate``; ``conventional`` is not a replay scheme and is refused);
- the ring of records (layouts in ``lowprec.mamba2`` / ``lowprec.gdn``), capacity
  ``Lcap = L`` for standard decoding and ``L + T`` for speculative decoding with ``T`` drafts;
- ``count [slots]``: committed records ``h``, and ``flushes [slots]``: checkpoint writes so
  far (the Philox flush counter of the next write).

**Standard decoding** (``draft=0``). A step appends its record at position ``h``. If the ring
then holds ``L`` records it is a *flush* step: the ring is folded into the recurrence copy
(``*_replay_flush``), the output is read from that unrounded new state, both copies are written
from it and ``h`` returns to 0. Otherwise the output is replayed from the read copy and the ring
(``*_replay_output``), and no state is formed.

**Speculative decoding** (``draft=T``, ``1 <= T <= L``). ``verify`` first decides, per slot and
before anything runs, whether this is a flush step: ``h + T > L``. A flush folds only the ``h``
committed records into the recurrence copy and writes both copies. The ``T`` drafts are
appended behind the committed records (positions ``h .. h+T-1 <= L+T-1``: the ring never
overruns) and all ``T`` outputs are computed at once, from the read copy, or on a flush step
from the unrounded new state, in which case the drafts are then rotated to the front of the
ring (their new window starts with them; a kernel would address the ring modulo ``Lcap``
instead). ``commit(a)`` advances ``h`` by the ``a`` accepted drafts; the rejected ones stay in
the ring past ``h`` and are overwritten by the next ``verify``: rollback is a pointer move.

GDN and KDA cache ``u`` per record (computed on its own step from the state that step read:
the read copy and the ring, or, for the drafts of a flushing verify, the unrounded new state;
the window's later steps read those ``u`` beside the read copy) and the raw ``v``; their
flushes recompute every ``u`` from the recurrence copy. Their drafts' ``u`` depend on each
other, so their ``verify`` computes the ``T`` records in order.

SR words for a copy are ``random_words(policy.seed, slot, flushes[slot], ...)``, so every write
of a slot's copy uses fresh words and a replay regenerates them.
"""

from dataclasses import dataclass, field

import torch

from lowprec import gdn, mamba2
from lowprec._checks import (
    check_device,
    check_float,
    check_inputs_apart,
    check_positive_int,
    check_same_device,
    check_shape,
    check_tensor,
)
from lowprec.mamba2 import _gate, _group_to_heads
from lowprec.philox import FLUSH_LIMIT
from lowprec.policies import Policy

__all__ = ["ReplaySSM", "Mamba2Replay", "GDNReplay", "KDAReplay", "FLUSH_COUNTER_LIMIT",
           "check_counter_ranges", "check_flush_field"]

# A flush uses its slot's counter f (the Philox counter's flush field, FLUSH_LIMIT = 2^20
# values; past it the field overflows into the slot's) and leaves f + 1, so f must stay below
# 2^20 - 1 for the next flush to fit.
FLUSH_COUNTER_LIMIT = FLUSH_LIMIT - 1


def check_flush_field(name: str, counters: torch.Tensor) -> None:
    """ValueError unless every value of ``counters`` (a flush or token counter, any device)
    lies in [0, FLUSH_COUNTER_LIMIT), the Philox counter's flush field: one host read of two
    numbers (a stream sync on a GPU). The token counters of the conventional SR updates and
    the reference's flushing slots use it; `check_counter_ranges` reads cursors and flushes in
    one go."""
    if not counters.numel():
        return
    low, high = torch.stack([counters.min(), counters.max()]).tolist()
    if low < 0 or high >= FLUSH_COUNTER_LIMIT:
        raise ValueError(f"{name}: expected values in [0, 2^20 - 1) (the Philox counter's flush "
                         f"field), got range [{low}, {high}]")


def check_counter_ranges(cursors: torch.Tensor, flushes: torch.Tensor, low: int, high: int,
                         why: str, prefix: str = "") -> None:
    """ValueError unless every cursor lies in [low, high] (``why`` says what bounds them) and
    every flush counter in [0, FLUSH_COUNTER_LIMIT). For the kernels' device-side counters
    (int32 on any device): one host read of four numbers, so a stream sync (the emulation
    checks on every call, the CuTe kernels when asked). ``prefix`` names the object holding
    them ("cache.")."""
    if not cursors.numel():
        return
    c_lo, c_hi, f_lo, f_hi = torch.stack(
        [cursors.min(), cursors.max(), flushes.min(), flushes.max()]).tolist()
    if c_lo < low or c_hi > high:
        raise ValueError(f"{prefix}cursors: expected values in [{low}, {high}] ({why}), got "
                         f"range [{c_lo}, {c_hi}]")
    if f_lo < 0 or f_hi >= FLUSH_COUNTER_LIMIT:
        raise ValueError(f"{prefix}flushes: expected values in [0, 2^20 - 1) (the Philox "
                         f"counter's flush field), got range [{f_lo}, {f_hi}]")


@dataclass(kw_only=True)
class ReplaySSM:
    """Checkpoint copies, ring and cursors of a batch of slots (see the module docstring)."""

    policy: Policy
    hi: torch.Tensor  # [slots, h, dv, dk] recurrence copy
    lo: torch.Tensor  # [slots, h, dv, dk] read copy
    ring: dict  # name -> [slots, h or g, Lcap, ...]
    count: torch.Tensor  # [slots] int64: committed records h
    flushes: torch.Tensor  # [slots] int64: checkpoint writes so far
    draft: int = 0  # T: drafts per verify, 0 for standard decoding
    pending: bool = field(default=False)  # a verify awaits its commit

    @property
    def window(self) -> int:
        return self.policy.window

    @property
    def capacity(self) -> int:
        return self.window + self.draft

    @property
    def shape(self):
        return tuple(self.hi.shape)

    @staticmethod
    def _check_config(policy, batch, nheads, dv, dk, draft, dtype):
        if not isinstance(policy, Policy):
            raise ValueError(f"policy: expected a Policy, got {type(policy).__name__}")
        if policy.kind == "conventional":
            raise ValueError(
                "policy: expected kind 'exact', 'shared' or 'separate' (a replay cache writes its "
                "checkpoint once per window), got 'conventional'"
            )
        for name, value in (("batch", batch), ("nheads", nheads), ("dv", dv), ("dk", dk)):
            check_positive_int(name, value)
        check_positive_int("draft", draft, minimum=0)
        if draft > policy.window:
            raise ValueError(
                f"draft: expected T <= L = policy.window = {policy.window}, got {draft}"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        policy.check_state(dv, dk, dtype)

    @staticmethod
    def _empty_ring(layouts, dtype):
        """Ring tensors filled with NaN, so that a read of an unwritten entry shows."""
        return {name: torch.full(shape, float("nan"), dtype=dtype) for name, shape in layouts}

    # ---- cursors ------------------------------------------------------------------------------

    def _check_mode(self, speculative: bool):
        if speculative and self.draft == 0:
            raise ValueError("draft: expected T >= 1 for verify/commit, got 0 (standard decoding)")
        if not speculative and self.draft != 0:
            raise ValueError(
                f"draft: expected 0 for step() (standard decoding), got {self.draft}; "
                "use verify() and commit()"
            )

    def _append(self, records: dict, start: torch.Tensor):
        """Write ``records[name] [slots, h|g, n, ...]`` at ring positions ``start .. start+n-1``
        of each slot."""
        for name, rec in records.items():
            check_device(name, rec, self.ring[name].device, "the ring's")
            n = rec.shape[2]
            end = int((start + n).max())
            if end > self.capacity:
                raise RuntimeError(
                    f"ring overrun: positions up to {end - 1} in a ring of {self.capacity}"
                )
            pos = start[:, None] + torch.arange(n)  # [slots, n]
            idx = pos.view(-1, 1, n, *([1] * (rec.dim() - 3))).expand_as(rec)
            self.ring[name] = self.ring[name].scatter(2, idx, rec.to(self.ring[name].dtype))

    def _rotate(self, shift: torch.Tensor):
        """Move each slot's ring by ``-shift[slot]`` positions (position ``shift`` to 0)."""
        pos = (torch.arange(self.capacity)[None, :] + shift[:, None]) % self.capacity
        for name, ring in self.ring.items():
            idx = pos.view(-1, 1, self.capacity, *([1] * (ring.dim() - 3))).expand_as(ring)
            self.ring[name] = torch.gather(ring, 2, idx)

    def _write_copies(self, new_state, mask):
        """Write both copies of the slots in ``mask`` from the unrounded ``new_state``."""
        slots = torch.arange(self.shape[0])
        check_flush_field("flushes", self.flushes[mask])  # as the kernels refuse it
        hi, lo = self.policy.write_copies(new_state, slots, self.flushes)
        m = mask[:, None, None, None]
        self.hi = torch.where(m, hi, self.hi)
        self.lo = torch.where(m, lo, self.lo)
        self.flushes = self.flushes + mask.to(self.flushes.dtype)

    def commit(self, accepted):
        """Accept the first ``accepted`` drafts of the last ``verify`` (int, or int tensor
        ``[slots]`` with values in ``[0, T]``): ``h += accepted``."""
        self._check_mode(True)
        if not self.pending:
            raise ValueError("commit: expected a verify() before each commit(), got none pending")
        if not isinstance(accepted, torch.Tensor):
            if isinstance(accepted, bool) or not isinstance(accepted, int):
                raise ValueError(f"accepted: expected an int or int tensor, got {accepted!r}")
            accepted = torch.full((self.shape[0],), accepted, dtype=torch.int64)
        check_tensor("accepted", accepted)
        if accepted.dtype.is_floating_point or accepted.dtype == torch.bool:
            raise ValueError(f"accepted: expected an integer dtype, got {accepted.dtype}")
        check_shape("accepted", accepted, (self.shape[0],))
        check_device("accepted", accepted, self.count.device, "the cache's")
        if int(accepted.min()) < 0 or int(accepted.max()) > self.draft:
            raise ValueError(
                f"accepted: expected values in [0, T={self.draft}], got {accepted.tolist()}"
            )
        self.count = self.count + accepted.to(torch.int64)
        self.pending = False

    def _begin_verify(self):
        """Decide the flush per slot (``h + T > L``) before the step, and check the flushing
        slots' counters (as ``_write_copies`` does, but before anything is written); clears a
        pending verify (nothing accepted). A verify is pending only once its checks pass, as in
        the emulation: a refused one appends no draft, and a commit after it would count stale
        ring entries as records."""
        self._check_mode(True)
        is_flush = self.count + self.draft > self.window
        check_flush_field("flushes", self.flushes[is_flush])
        self.pending = True
        return is_flush

    def _held_tensors(self) -> dict:
        """The tensors this cache holds and a step writes or reads after writing, by name."""
        held = {"cache.hi": self.hi, "cache.lo": self.lo, "cache.count": self.count,
                "cache.flushes": self.flushes}
        held.update({f"cache.ring[{name!r}]": t for name, t in self.ring.items()})
        return held

    def _check_cache(self, speculative: bool):
        """The cursors a caller can set: ``count`` an int64 ``[slots]`` on the cache's device
        with values in [0, L - 1] (standard: a full ring has flushed) or [0, L] (speculative),
        ``flushes`` likewise shaped; every held tensor on the copies' device."""
        check_same_device(self._held_tensors())
        for name in ("count", "flushes"):
            t = getattr(self, name)
            check_tensor(name, t)
            if t.dtype != torch.int64:
                raise ValueError(f"{name}: expected dtype torch.int64, got {t.dtype}")
            check_shape(name, t, (self.shape[0],))
        high = self.window if speculative else self.window - 1
        if self.count.numel():
            low_count, high_count = torch.stack([self.count.min(), self.count.max()]).tolist()
            if low_count < 0 or high_count > high:
                raise ValueError(f"count: expected values in [0, {high}] (records held in a "
                                 f"window of L={self.window}), got range "
                                 f"[{low_count}, {high_count}]")
            if int(self.flushes.min()) < 0:
                raise ValueError(f"flushes: expected values >= 0, got {self.flushes.tolist()}")

    def _check_records(self, specs, dtype):
        for name, t, shape in specs:
            if t is None:
                continue
            check_float(name, t, dtype)
            check_shape(name, t, shape)
            check_device(name, t, self.hi.device, "the cache's")
        check_inputs_apart({name: t for name, t, _ in specs}, self._held_tensors())


@dataclass(kw_only=True)
class Mamba2Replay(ReplaySSM):
    """ReplaySSM for Mamba-2. Ring: ``x [slots, h, Lcap, dv]``, ``dt [slots, h, Lcap]``
    (processed: bias and softplus applied), ``B [slots, g, Lcap, dk]``."""

    A: torch.Tensor  # [h], negative
    D: torch.Tensor | None = None  # [h]
    dt_bias: torch.Tensor | None = None  # [h]
    dt_softplus: bool = True

    @classmethod
    def create(
        cls,
        batch: int,
        nheads: int,
        dv: int,
        dk: int,
        A: torch.Tensor,
        *,
        ngroups: int = 1,
        D=None,
        dt_bias=None,
        dt_softplus: bool = True,
        policy: Policy | None = None,
        draft: int = 0,
        dtype=torch.float64,
    ) -> "Mamba2Replay":
        """A cache at a zero state, empty ring; ``policy`` defaults to ``Policy('exact')``
        (its ``window`` is L)."""
        policy = Policy("exact") if policy is None else policy
        cls._check_config(policy, batch, nheads, dv, dk, draft, dtype)
        if not isinstance(dt_softplus, bool):
            raise ValueError(f"dt_softplus: expected a bool, got {dt_softplus!r}")
        check_positive_int("ngroups", ngroups)
        if nheads % ngroups:
            raise ValueError(f"ngroups: expected a divisor of nheads={nheads}, got {ngroups}")
        check_float("A", A, dtype)
        check_shape("A", A, (nheads,))
        for name, t in (("D", D), ("dt_bias", dt_bias)):
            if t is not None:
                check_float(name, t, dtype)
                check_shape(name, t, (nheads,))
        # the cache lives on the CPU (its copies and ring are made there)
        check_same_device({"cache": torch.zeros(()), "A": A, "D": D, "dt_bias": dt_bias})
        lcap = policy.window + draft
        ring = cls._empty_ring(
            (
                ("x", (batch, nheads, lcap, dv)),
                ("dt", (batch, nheads, lcap)),
                ("B", (batch, ngroups, lcap, dk)),
            ),
            dtype,
        )
        zero = torch.zeros(batch, nheads, dv, dk, dtype=dtype)
        return cls(
            policy=policy,
            hi=zero,
            lo=zero,
            ring=ring,
            count=torch.zeros(batch, dtype=torch.int64),
            flushes=torch.zeros(batch, dtype=torch.int64),
            draft=draft,
            A=A,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
        )

    def _check_inputs(self, x, dt, B, C, z, ndraft):
        b, h, dv, dk = self.shape
        g = self.ring["B"].shape[1]
        t = () if ndraft is None else (ndraft,)
        self._check_records(
            (
                ("x", x, (b, h, *t, dv)),
                ("dt", dt, (b, h, *t)),
                ("B", B, (b, g, *t, dk)),
                ("C", C, (b, g, *t, dk)),
                ("z", z, (b, h, *t, dv)),
            ),
            self.hi.dtype,
        )

    def _ring_args(self):
        return self.ring["x"], self.ring["dt"], self.ring["B"]

    def _flush_output(self, state, C, x, z):
        """``y = S C + D x`` (times ``silu(z)``) from a formed state; ``C [b, g, dk]``."""
        y = torch.einsum("bhvk,bhk->bhv", state, _group_to_heads(C, state.shape[1]))
        return _gate(y, self.D, x, z)

    def step(self, x, dt, B, C, z=None) -> torch.Tensor:
        """One token of standard decoding: ``x [b, h, dv]``, ``dt [b, h]`` (raw),
        ``B, C [b, g, dk]``, ``z [b, h, dv]``; returns ``y [b, h, dv]``."""
        self._check_mode(False)
        self._check_cache(False)
        self._check_inputs(x, dt, B, C, z, None)
        dt = mamba2.mamba2_process_dt(dt, self.dt_bias, self.dt_softplus)
        self._append({"x": x[:, :, None], "dt": dt[:, :, None], "B": B[:, :, None]}, self.count)
        held = self.count + 1
        is_flush = held == self.window
        y = mamba2.mamba2_replay_output(self.lo, *self._ring_args(), held, C, x, self.A, self.D, z)
        if bool(is_flush.any()):
            new_state = mamba2.mamba2_replay_flush(self.hi, *self._ring_args(), held, self.A)
            y = torch.where(is_flush[:, None, None], self._flush_output(new_state, C, x, z), y)
            self._write_copies(new_state, is_flush)
        self.count = torch.where(is_flush, 0, held)
        return y

    def verify(self, x, dt, B, C, z=None) -> torch.Tensor:
        """Outputs of ``T`` drafts at once: ``x [b, h, T, dv]``, ``dt [b, h, T]`` (raw),
        ``B, C [b, g, T, dk]``, ``z [b, h, T, dv]``; returns ``y [b, h, T, dv]``. Follow with
        ``commit``."""
        self._check_mode(True)
        self._check_cache(True)
        self._check_inputs(x, dt, B, C, z, self.draft)
        is_flush = self._begin_verify()
        committed = self.count
        read_copy = self.lo
        if bool(is_flush.any()):
            new_state = mamba2.mamba2_replay_flush(self.hi, *self._ring_args(), committed, self.A)
            self._write_copies(new_state, is_flush)
            read_copy = torch.where(is_flush[:, None, None, None], new_state, self.lo)
        dt = mamba2.mamba2_process_dt(dt, self.dt_bias, self.dt_softplus)
        self._append({"x": x, "dt": dt, "B": B}, committed)
        self._rotate(torch.where(is_flush, committed, 0))
        self.count = torch.where(is_flush, 0, committed)
        return mamba2.mamba2_replay_verify(
            read_copy, *self._ring_args(), self.count + self.draft, C, x, self.A, self.D, z
        )


@dataclass(kw_only=True)
class GDNReplay(ReplaySSM):
    """ReplaySSM for Gated DeltaNet. Ring: ``u, v [slots, h, Lcap, dv]``,
    ``k [slots, h, Lcap, dk]``, ``g, beta [slots, h, Lcap]``."""

    per_channel = False  # KDA: the decay g has a d_k dim

    @classmethod
    def create(
        cls,
        batch: int,
        nheads: int,
        dv: int,
        dk: int,
        *,
        policy: Policy | None = None,
        draft: int = 0,
        dtype=torch.float64,
    ):
        """A cache at a zero state, empty ring; ``policy`` defaults to ``Policy('exact')``."""
        policy = Policy("exact") if policy is None else policy
        cls._check_config(policy, batch, nheads, dv, dk, draft, dtype)
        lcap = policy.window + draft
        decay = (batch, nheads, lcap, dk) if cls.per_channel else (batch, nheads, lcap)
        ring = cls._empty_ring(
            (
                ("u", (batch, nheads, lcap, dv)),
                ("v", (batch, nheads, lcap, dv)),
                ("k", (batch, nheads, lcap, dk)),
                ("g", decay),
                ("beta", (batch, nheads, lcap)),
            ),
            dtype,
        )
        zero = torch.zeros(batch, nheads, dv, dk, dtype=dtype)
        return cls(
            policy=policy,
            hi=zero,
            lo=zero,
            ring=ring,
            count=torch.zeros(batch, dtype=torch.int64),
            flushes=torch.zeros(batch, dtype=torch.int64),
            draft=draft,
        )

    def _check_inputs(self, q, k, v, g, beta, ndraft):
        b, h, dv, dk = self.shape
        t = () if ndraft is None else (ndraft,)
        decay = (b, h, *t, dk) if self.per_channel else (b, h, *t)
        self._check_records(
            (
                ("q", q, (b, h, *t, dk)),
                ("k", k, (b, h, *t, dk)),
                ("v", v, (b, h, *t, dv)),
                ("g", g, decay),
                ("beta", beta, (b, h, *t)),
            ),
            self.hi.dtype,
        )

    def _replay_u(self, ckpt, held):
        r = self.ring
        return gdn._replay_u(
            ckpt, r["u"], r["v"], r["k"], r["g"], r["beta"], held, self.per_channel
        )

    def _replay_output(self, ckpt, held, q):
        r = self.ring
        return gdn._replay_output(ckpt, r["u"], r["k"], r["g"], held, q, self.per_channel)

    def _replay_flush(self, ckpt, held):
        r = self.ring
        return gdn._replay_flush(ckpt, r["v"], r["k"], r["g"], r["beta"], held, self.per_channel)

    def _advance_one(self, ckpt, position, q):
        """Compute and store ``u`` of the record at ``position [slots]`` (already in the ring)
        from ``ckpt``; return its output."""
        held = position + 1
        u = self._replay_u(ckpt, held)
        self._append({"u": u[:, :, None]}, position)
        return self._replay_output(ckpt, held, q)

    def step(self, q, k, v, g, beta) -> torch.Tensor:
        """One token of standard decoding: ``q, k [b, h, dk]``, ``v [b, h, dv]``,
        ``g [b, h]`` (KDA: ``[b, h, dk]``) log-decay, ``beta [b, h]``; returns ``y [b, h, dv]``."""
        self._check_mode(False)
        self._check_cache(False)
        self._check_inputs(q, k, v, g, beta, None)
        self._append(
            {"v": v[:, :, None], "k": k[:, :, None], "g": g[:, :, None], "beta": beta[:, :, None]},
            self.count,
        )
        y = self._advance_one(self.lo, self.count, q)
        held = self.count + 1
        is_flush = held == self.window
        if bool(is_flush.any()):
            new_state = self._replay_flush(self.hi, held)
            y_flush = torch.einsum("bhvk,bhk->bhv", new_state, q)
            y = torch.where(is_flush[:, None, None], y_flush, y)
            self._write_copies(new_state, is_flush)
        self.count = torch.where(is_flush, 0, held)
        return y

    def verify(self, q, k, v, g, beta) -> torch.Tensor:
        """Outputs of ``T`` drafts: ``q, k [b, h, T, dk]``, ``v [b, h, T, dv]``,
        ``g [b, h, T]`` (KDA: ``[b, h, T, dk]``), ``beta [b, h, T]``; returns
        ``y [b, h, T, dv]``. The drafts' ``u`` are computed in order. Follow with ``commit``."""
        self._check_mode(True)
        self._check_cache(True)
        self._check_inputs(q, k, v, g, beta, self.draft)
        is_flush = self._begin_verify()
        committed = self.count
        read_copy = self.lo
        if bool(is_flush.any()):
            new_state = self._replay_flush(self.hi, committed)
            self._write_copies(new_state, is_flush)
            read_copy = torch.where(is_flush[:, None, None, None], new_state, self.lo)
        self._append({"v": v, "k": k, "g": g, "beta": beta}, committed)
        self._rotate(torch.where(is_flush, committed, 0))
        self.count = torch.where(is_flush, 0, committed)
        ys = [self._advance_one(read_copy, self.count + i, q[:, :, i]) for i in range(self.draft)]
        return torch.stack(ys, dim=2)


@dataclass(kw_only=True)
class KDAReplay(GDNReplay):
    """ReplaySSM for KDA: as ``GDNReplay`` with ``g [slots, h, Lcap, dk]`` in the ring."""

    per_channel = True
