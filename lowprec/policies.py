"""Precision policies for the decode state, and a vectorised simulator of each.

The simulator runs the generic linear recurrence the error-growth experiments use, for every
slot ``b`` and head ``h`` at once (state ``S [b, h, dv, dk]``, output ``y_t = S_t q_t``):

    mamba2:  S_t = a_t S_{t-1} + v_t k_t^T                    a [b, h]   (v = dt x, k = B, q = C)
    gdn:     S_t = a_t S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - a_t S_{t-1} k_t)
    kda:     S_t = S_{t-1} diag(a_t) + u_t k_t^T,  u_t = beta_t (v_t - S_{t-1} diag(a_t) k_t)
                                                              a [b, h, dk]

A policy says where the state is rounded and who reads the rounded copy. ``Q`` below is
``lowprec.quantize.fake_quantize`` with the policy's format and rounding; SR draws come from
``lowprec.philox.random_words(seed, slot=arange(batch), flush=counter, shape, sr_bits=,
philox_rounds=)`` with the counter of that copy's writes and the policy's ``sr_bits`` random
bits per element from ``philox_rounds``-round Philox (docs/design.md, "Random words").
Windows are ``L = policy.window`` tokens long; a window's last token is its flush step.

- ``exact``: the FP64 (``dtype``) recurrence; nothing is rounded.
- ``conventional``: the state is stored every token, ``S_t <- Q(S_t)`` with the token counter
  as the SR counter; the output reads the stored state.
- ``shared``: one checkpoint ``Q(S)`` written at each flush (flush counter), read by the window's
  non-flush steps and by the next flush.
- ``separate``: two copies written at each flush from the same unrounded new state: the
  recurrence copy ``hi = Q_hi(S)`` (``hi_fmt``, ``hi_rounding``, flush counter) that the next
  flush starts from, and the read copy ``lo = Q_lo(S)`` (``fmt``, always RN) that the window's
  non-flush steps read. ``hi_fmt='fp64'`` is the exact recurrence copy.

Non-flush outputs read the checkpoint copy plus the window's records; flush outputs read the
unrounded new state. For GDN and KDA a non-flush step's ``u`` comes from the state rebuilt from
the read copy, and the flush recomputes every ``u`` of the window from raw ``v`` and the
recurrence copy.

How it is simulated without replaying windows: given the ``u`` of the window, the replayed state
``G S_ckpt + sum_j G_{j+1:t} u_j k_j^T`` obeys the recurrence itself, so each copy is followed by
a running state that starts at the copy after each flush and advances once per token (the same
update as the exact arm, so an identity rounding reproduces the exact arm bit for bit):

- ``read``: starts at the read copy; its ``u`` are the ones a non-flush step computes from the
  read copy and the ring; its ``S q`` is a non-flush step's output.
- ``recur`` (separate only): starts at the recurrence copy; its ``u`` are the flush's
  recomputed ones; at the flush it is the unrounded new state.

In the shared policy the two coincide (one copy, one trajectory). Per step this is one or two
state updates and one matrix-vector product, plus the rounding on flush (or every) steps.
"""

from dataclasses import dataclass, fields

import torch

from lowprec import formats, philox, quantize
from lowprec._checks import check_float, check_positive_int, check_shape

__all__ = ["ARMS", "KINDS", "RECURRENCES", "Policy", "Simulator", "advance_state", "make_policy",
           "round_state"]

KINDS = ("exact", "conventional", "shared", "separate")
ROUNDINGS = ("rn", "sr")
RECURRENCES = ("mamba2", "gdn", "kda")
# arm name in the experiments' CSV -> (kind, hi_fmt, hi_rounding); see make_policy.
ARMS = {
    "exact": ("exact", "fp64", "rn"),
    "every_step": ("conventional", "fp64", "rn"),
    "shared": ("shared", "fp64", "rn"),
    "separate_exact": ("separate", "fp64", "rn"),
    "separate_fp16sr": ("separate", "fp16", "sr"),
}


def round_state(state, fmt, rounding, seed, slots, counter, *,
                sr_bits=philox.DEFAULT_SR_BITS, philox_rounds=philox.DEFAULT_PHILOX_ROUNDS):
    """``fake_quantize(state, fmt, rounding, sr_bits=sr_bits)`` of a state
    ``[slots, h, dv, dk]``, with the SR draws ``random_words(seed, slots, counter, [h, dv, dk],
    sr_bits=sr_bits, philox_rounds=philox_rounds)`` (one slot's shape): ``slots`` and
    ``counter`` are ints or int64 tensors ``[slots]``. ``fp64`` is the identity (no call is
    made)."""
    if fmt == "fp64":
        return state
    if rounding != "sr":
        return quantize.fake_quantize(state, fmt, rounding=rounding)
    # an int is every slot's (one slot's draws for all of them would be the wrong shape)
    slots, counter = (torch.full((state.shape[0],), v, dtype=torch.int64)
                      if isinstance(v, int) and not isinstance(v, bool) else v
                      for v in (slots, counter))
    rand = philox.random_words(seed, slots, counter, tuple(state.shape[1:]), sr_bits=sr_bits,
                               philox_rounds=philox_rounds)
    return quantize.fake_quantize(state, fmt, rounding=rounding, rand=rand, sr_bits=sr_bits)


def _check_seed(seed) -> int:
    seed = check_positive_int("seed", seed, minimum=0)
    if seed >= philox.SEED_LIMIT:
        raise ValueError(f"seed: expected an integer in [0, 2^64), got {seed}")
    return seed


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class Policy:
    """Where the decode state is rounded; see the module docstring for the semantics. A field
    the kind does not use (comments below) must keep its default: another value is refused."""

    kind: str  # 'exact' | 'conventional' | 'shared' | 'separate'
    fmt: str = "fp64"  # conventional/shared: the stored format; separate: the read copy (RN)
    rounding: str = "rn"  # rounding of fmt for conventional/shared; 'rn' for separate
    hi_fmt: str = "fp64"  # separate only: the recurrence copy's format
    hi_rounding: str = "rn"  # separate only: 'sr' for the FP16-SR recurrence copy
    window: int = 16  # L: tokens per window, the last one being the flush step (not conventional)
    seed: int = 0  # Philox seed for SR (only with an SR copy: rounding or hi_rounding 'sr')
    sr_bits: int = philox.DEFAULT_SR_BITS  # random bits per SR element (only with an SR copy)
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS  # rounds of SR's Philox (likewise)

    def __post_init__(self):
        _check_choice("kind", self.kind, KINDS)
        _check_choice("fmt", self.fmt, formats.names())
        _check_choice("rounding", self.rounding, ROUNDINGS)
        _check_choice("hi_fmt", self.hi_fmt, formats.names())
        _check_choice("hi_rounding", self.hi_rounding, ROUNDINGS)
        if self.kind == "separate" and self.rounding != "rn":
            raise ValueError(
                f"rounding: expected 'rn' for the separate policy's read copy, "
                f"got {self.rounding!r}"
            )
        # numpy integers are stored as ints, so a Policy compares and prints the same
        object.__setattr__(self, "window", check_positive_int("window", self.window))
        object.__setattr__(self, "seed", _check_seed(self.seed))
        object.__setattr__(self, "sr_bits", philox.check_sr_bits(self.sr_bits))
        object.__setattr__(self, "philox_rounds", philox.check_philox_rounds(self.philox_rounds))
        self._check_unused_fields()

    def _check_unused_fields(self):
        """A field the kind never reads must keep its default: set to anything else it would
        be ignored without a word (an 'exact' policy given fmt='nvfp4' simulates fp64, a
        'shared' one given hi_fmt='fp16' keeps its one copy in fmt, an RN policy's seed draws
        nothing). The window stays for 'exact': a replay cache's ring is that long."""
        nothing = "nothing is rounded"
        one_copy = "it keeps one copy, in fmt; hi_* are the separate policy's recurrence copy"
        unused = {
            "exact": dict.fromkeys(("fmt", "rounding", "hi_fmt", "hi_rounding"), nothing),
            "conventional": {"hi_fmt": one_copy, "hi_rounding": one_copy,
                             "window": "it writes the state every token, there are no windows"},
            "shared": {"hi_fmt": one_copy, "hi_rounding": one_copy},
            "separate": {},
        }[self.kind]
        for name, reason in unused.items():
            default, value = _FIELD_DEFAULTS[name], getattr(self, name)
            if value != default:
                raise ValueError(f"{name}: expected the default {default!r} for kind "
                                 f"{self.kind!r}, which does not use it ({reason}), got {value!r}")
        name = "hi_rounding" if self.kind == "separate" else "rounding"
        if self.kind != "exact" and getattr(self, name) == "sr":
            return
        for field, what in (("seed", "the seed only draws SR words"),
                            ("sr_bits", "only SR draws random bits"),
                            ("philox_rounds", "only SR draws Philox words")):
            default, value = _FIELD_DEFAULTS[field], getattr(self, field)
            if value == default:
                continue
            if self.kind == "exact":
                raise ValueError(f"{field}: expected the default {default} for kind 'exact' "
                                 f"({nothing}), got {value}")
            raise ValueError(f"{field}: expected the default {default} for kind "
                             f"{self.kind!r} with {name} 'rn' ({what}), got {value}")

    def check_state(self, dv: int, dk: int, dtype: torch.dtype) -> None:
        """ValueError unless this policy can round a state [..., dv, dk] of ``dtype``: an fp32
        or fp64 state where it rounds (a cache's copies keep the state's dtype), and d_k a
        multiple of each block format's block. Checked when a cache or simulator is made, so
        no step appends a record it cannot flush."""
        stored = {"exact": (), "conventional": (self.fmt,), "shared": (self.fmt,),
                  "separate": (self.fmt, self.hi_fmt)}[self.kind]
        rounded = [f for f in stored if f != "fp64"]
        if rounded and dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype: expected torch.float32 or torch.float64 for a policy that "
                             f"rounds to {rounded}, got {dtype}")
        for name in rounded:
            fmt = formats.get(name)
            if fmt.block is not None:
                fmt.block_length((dv, dk))  # raises ValueError naming d_k and the block

    def write_copies(self, new_state, slots, counter):
        """The ``(hi, lo)`` copies a flush writes from the unrounded ``new_state``, with SR
        words for ``slots`` at write ``counter`` (one copy object for exact, conventional and
        shared: they keep a single copy)."""
        if self.kind == "exact":
            return new_state, new_state
        if self.kind in ("conventional", "shared"):
            stored = round_state(new_state, self.fmt, self.rounding, self.seed, slots, counter,
                                 **self._sr)
            return stored, stored
        hi = round_state(new_state, self.hi_fmt, self.hi_rounding, self.seed, slots, counter,
                         **self._sr)
        return hi, round_state(new_state, self.fmt, "rn", self.seed, slots, counter)

    @property
    def _sr(self) -> dict:
        return {"sr_bits": self.sr_bits, "philox_rounds": self.philox_rounds}


_FIELD_DEFAULTS = {f.name: f.default for f in fields(Policy) if f.name != "kind"}


def make_policy(arm: str, fmt: str, rounding: str = "rn", window=16, seed=0, *,
                sr_bits=philox.DEFAULT_SR_BITS,
                philox_rounds=philox.DEFAULT_PHILOX_ROUNDS) -> Policy:
    """The policy of an experiment arm.

    ``exact``: FP64, ``fmt`` ignored. ``every_step``: conventional, state in ``fmt`` with
    ``rounding``. ``shared``: one checkpoint in ``fmt`` with ``rounding``. ``separate_exact``:
    recurrence copy FP64, read copy ``fmt`` RN. ``separate_fp16sr``: recurrence copy FP16 SR,
    read copy ``fmt`` RN (``rounding`` must be 'rn' for both separate arms). ``sr_bits`` and
    ``philox_rounds`` set the SR copy's random bits per element and Philox rounds.

    Every arm takes the same arguments (the experiments make all of theirs with one call), so
    what an arm does not use is dropped here rather than refused by ``Policy``: ``window`` for
    ``every_step`` (no windows), ``seed``, ``sr_bits`` and ``philox_rounds`` for an arm
    without an SR copy.
    """
    _check_choice("arm", arm, ARMS)
    kind, hi_fmt, hi_rounding = ARMS[arm]
    if kind == "exact":
        fmt, rounding = "fp64", "rn"
    # a dropped value is still checked: a bad one is the caller's error whatever the arm
    window = check_positive_int("window", window)
    seed = _check_seed(seed)
    sr_bits = philox.check_sr_bits(sr_bits)
    philox_rounds = philox.check_philox_rounds(philox_rounds)
    if kind == "conventional":
        window = _FIELD_DEFAULTS["window"]
    if (hi_rounding if kind == "separate" else rounding) != "sr":
        seed = _FIELD_DEFAULTS["seed"]
        sr_bits = _FIELD_DEFAULTS["sr_bits"]
        philox_rounds = _FIELD_DEFAULTS["philox_rounds"]
    return Policy(kind, fmt, rounding, hi_fmt, hi_rounding, window, seed, sr_bits,
                  philox_rounds)


def advance_state(recurrence: str, state, a, v, k, beta=None) -> torch.Tensor:
    """``S_t`` from ``S_{t-1}`` for one token in the generic inputs (``a [b, h]``, KDA
    ``[b, h, dk]``; ``v [b, h, dv]``, ``k [b, h, dk]``, ``beta [b, h]`` for GDN and KDA): the
    update every arm of the `Simulator` shares, so that rounding-free arms agree bit for bit.
    Unchecked: the `Simulator` validates its inputs."""
    decayed = state * (a[..., None, :] if recurrence == "kda" else a[..., None, None])
    if recurrence == "mamba2":
        u = v
    else:
        u = beta[..., None] * (v - (decayed @ k[..., :, None])[..., 0])
    return torch.addcmul(decayed, u[..., :, None], k[..., None, :])


class Simulator:
    """Decode ``batch`` slots of ``nheads`` heads under ``policy``; ``step`` returns ``y_hat``.

    The state starts at zero; token ``t`` (counting from 0) is a flush step when
    ``(t + 1) % policy.window == 0``. After a step, ``last_was_flush`` tells which kind it was,
    ``tokens`` and ``flushes`` count the steps and the checkpoint writes so far, and ``hi`` /
    ``lo`` are the recurrence and read copies (both the stored state for exact and
    conventional).
    """

    def __init__(
        self,
        recurrence: str,
        policy: Policy,
        batch: int,
        nheads: int,
        dv: int,
        dk: int,
        dtype=torch.float64,
    ):
        _check_choice("recurrence", recurrence, RECURRENCES)
        if not isinstance(policy, Policy):
            raise ValueError(f"policy: expected a Policy, got {type(policy).__name__}")
        for name, value in (("batch", batch), ("nheads", nheads), ("dv", dv), ("dk", dk)):
            check_positive_int(name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        policy.check_state(dv, dk, dtype)
        self.recurrence = recurrence
        self.policy = policy
        self.shape = (batch, nheads, dv, dk)
        self.dtype = dtype
        self.tokens = 0
        self.flushes = 0
        self.last_was_flush = False
        self._slots = torch.arange(batch)
        zero = torch.zeros(self.shape, dtype=dtype)
        self.hi = zero
        self.lo = zero
        self._read = zero  # running state from the read copy (the state, for exact/conventional)
        self._recur = zero  # separate only: running state from the recurrence copy

    def step(self, a, v, k, q, beta=None) -> torch.Tensor:
        """One token for every slot and head; returns ``y_hat [batch, nheads, dv]``.

        ``a [b, h]`` (``[b, h, dk]`` for kda) decays in (0, 1), ``v [b, h, dv]``,
        ``k, q [b, h, dk]``, ``beta [b, h]`` (gdn and kda only). Float inputs of another dtype
        are converted to the simulator's.
        """
        a, v, k, q, beta = self._check_inputs(a, v, k, q, beta)
        kind = self.policy.kind
        is_flush = (self.tokens + 1) % self.policy.window == 0
        if kind == "exact":
            self._read = self._advance(self._read, a, v, k, beta)
            self.hi = self.lo = self._read
            y = self._output(self._read, q)
        elif kind == "conventional":
            new_state = self._advance(self._read, a, v, k, beta)
            self.hi, self.lo = self.policy.write_copies(new_state, self._slots, self.tokens)
            stored = self._read = self.lo
            y = self._output(stored, q)
        else:
            self._read = self._advance(self._read, a, v, k, beta)
            if kind == "separate":
                self._recur = self._advance(self._recur, a, v, k, beta)
                new_state = self._recur
            else:
                new_state = self._read
            y = self._output(new_state if is_flush else self._read, q)
            if is_flush:
                self._write_checkpoint(new_state)
        self.tokens += 1
        self.last_was_flush = is_flush and kind in ("shared", "separate")
        return y

    def _write_checkpoint(self, new_state):
        """Round the unrounded new state into the policy's copies and restart the windows."""
        self.hi, self.lo = self.policy.write_copies(new_state, self._slots, self.flushes)
        self._read = self.lo
        self._recur = self.hi
        self.flushes += 1

    def _advance(self, state, a, v, k, beta):
        return advance_state(self.recurrence, state, a, v, k, beta)

    @staticmethod
    def _output(state, q):
        return (state @ q[..., :, None])[..., 0]

    def _check_inputs(self, a, v, k, q, beta):
        b, h, dv, dk = self.shape
        expected = {
            "a": (b, h, dk) if self.recurrence == "kda" else (b, h),
            "v": (b, h, dv),
            "k": (b, h, dk),
            "q": (b, h, dk),
        }
        if self.recurrence == "mamba2":
            if beta is not None:
                raise ValueError(f"beta: expected None for mamba2, got {type(beta).__name__}")
        else:
            expected["beta"] = (b, h)
        given = {"a": a, "v": v, "k": k, "q": q, "beta": beta}
        out = []
        for name in ("a", "v", "k", "q", "beta"):
            t = given[name]
            if name in expected:
                if t is None:
                    raise ValueError(f"{name}: expected a tensor {list(expected[name])}, got None")
                check_float(name, t)
                check_shape(name, t, expected[name])
                t = t.to(self.dtype)
            out.append(t)
        return out
