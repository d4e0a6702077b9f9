"""Number formats as data.

An `ElementFormat` describes one sign-exponent-mantissa element (`ebits, mbits, bias,
max_finite`); a `Format` adds how elements are grouped under scales. Every rounding and
packing rule in `lowprec.quantize` reads these fields; nothing branches on a format's name.

Element formats (README.md, "Element formats"):

    name   ebits mbits bias  max_finite               notes
    fp64     11    52  1023  1.797...e308             the exact arm: rounding is the identity
    fp32      8    23   127  3.403e38 = (2-2^-23)2^127
    fp16      5    10    15  65504
    bf16      8     7   127  3.390e38 = (2-2^-7)2^127
    e4m3      4     3     7  448                      OCP E4M3FN: no inf, S.1111.111 is NaN
    e5m2      5     2    15  57344
    e2m1      2     1     1  6                        no inf, no NaN

Formats (README.md, "Block formats"):

    name           element  block  scale   two_level  scale rule
    fp64/fp32/...  itself   None   None    False      none: elements only
    nvfp4          e2m1     16     'e4m3'  True       s_g = amax(S)/2688,
                                                      s_b = RN_e4m3(amax_b/(6 s_g))
    mxfp4          e2m1     32     'e8m0'  False      s_b = 2^(floor(log2 amax_b) - 2)
    fp8_e4m3_row   e4m3     ROW    'fp32'  False      s = row_amax/448, unrounded
    fp4_e2m1_b16   e2m1     16     'fp32'  False      s = block_amax/6, unrounded
    fp4_e2m1_b32   e2m1     32     'fp32'  False      s = block_amax/6, unrounded (mxfp4's
                                                      blocks: isolates its E8M0 rounding)

`block` is the number of consecutive elements along the last dimension that share a scale;
`ROW` (= -1) means the whole last dimension (one scale per state row). A two-level format
also keeps one fp32 scale per state, i.e. per index of the leading dimensions `shape[:-2]`.

Storage: `Format.nbytes(shape)` counts element bits, block-scale bytes and second-level
scales for a tensor of that shape. `Format.bits_per_element` is element bits plus the block
scale amortised over its block; it cannot include per-row or per-state scales, which depend
on the shape: use `Format.bits_per_element_at(shape)` for the exact figure.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

ROW = -1

SCALE_KINDS = (None, "e4m3", "e8m0", "fp32")
SCALE_BITS = {None: 0, "e4m3": 8, "e8m0": 8, "fp32": 32}


@dataclass(frozen=True)
class ElementFormat:
    """One signed floating-point element: `1 + ebits + mbits` bits, IEEE-style subnormals."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_finite: float

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return math.frexp(self.max_finite)[1] - 1

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.mbits)

    @property
    def has_inf(self) -> bool:
        """IEEE-style formats reserve the all-ones exponent for inf and NaN."""
        return self.emax + self.bias < (1 << self.ebits) - 1


FP64 = ElementFormat("fp64", 11, 52, 1023, sys.float_info.max)
FP32 = ElementFormat("fp32", 8, 23, 127, math.ldexp(2.0 - 2.0**-23, 127))
FP16 = ElementFormat("fp16", 5, 10, 15, 65504.0)
BF16 = ElementFormat("bf16", 8, 7, 127, math.ldexp(2.0 - 2.0**-7, 127))
E4M3 = ElementFormat("e4m3", 4, 3, 7, 448.0)
E5M2 = ElementFormat("e5m2", 5, 2, 15, 57344.0)
E2M1 = ElementFormat("e2m1", 2, 1, 1, 6.0)

ELEMENTS = {e.name: e for e in (FP64, FP32, FP16, BF16, E4M3, E5M2, E2M1)}


@dataclass(frozen=True)
class Format:
    """A storage format: an element format, optionally grouped under scales.

    block: None (no scale), a positive block length along the last dim, or ROW (-1, the
    whole last dim). scale: None, 'e4m3', 'e8m0' or 'fp32' (the block scale's format).
    two_level: an extra fp32 scale per state (over the last two dims), as in NVFP4.
    """

    name: str
    element: ElementFormat
    block: int | None = None
    scale: str | None = None
    two_level: bool = False

    def __post_init__(self):
        if not isinstance(self.element, ElementFormat):
            raise ValueError(f"element: expected an ElementFormat, got {self.element!r}")
        if self.block is not None and (isinstance(self.block, bool)
                                       or not isinstance(self.block, int)):
            raise ValueError(f"block: expected an int or None, got {self.block!r}")
        if not isinstance(self.scale, (str, type(None))) or self.scale not in SCALE_KINDS:
            raise ValueError(f"scale: expected one of {SCALE_KINDS}, got {self.scale!r}")
        if (self.block is None) != (self.scale is None):
            raise ValueError(
                f"block and scale: expected both None or both set, got block={self.block!r}, "
                f"scale={self.scale!r}"
            )
        if self.block is not None and self.block != ROW and self.block <= 0:
            raise ValueError(f"block: expected a positive length or ROW (-1), got {self.block}")
        if self.two_level != (self.scale == "e4m3"):
            # the E4M3 block scale is defined with its per-state fp32 scale (README.md: s_g
            # brings the block amaxes into E4M3's range); one level alone would be computed with
            # an s_g that pack drops, so unpack would give other values
            raise ValueError(
                f"two_level: expected True exactly with an 'e4m3' block scale (nvfp4's two "
                f"levels), got two_level={self.two_level} with scale={self.scale!r}"
            )

    @property
    def bits_per_element(self) -> float:
        """Element bits plus a fixed-length block's scale bits over its block (see module doc)."""
        if self.block is None or self.block == ROW:
            return float(self.element.bits)
        return self.element.bits + SCALE_BITS[self.scale] / self.block

    def block_length(self, shape) -> int:
        """Elements per scale along the last dim for this shape (validated)."""
        shape = tuple(shape)
        if self.block is None:
            raise ValueError(f"format {self.name!r} has no blocks")
        if len(shape) < (2 if self.two_level else 1):
            raise ValueError(
                f"shape: format {self.name!r} expects [..., d_v, d_k], got {list(shape)}"
            )
        n = shape[-1]
        block = n if self.block == ROW else self.block
        if block <= 0 or n <= 0 or n % block:
            raise ValueError(
                f"shape: last dim (d_k) must be a positive multiple of block {block} for format "
                f"{self.name!r}, got d_k={n} in shape {list(shape)}"
            )
        return block

    def nbytes(self, shape) -> int:
        """Storage bytes of a tensor of `shape` in this format, all scales included."""
        shape = tuple(shape)
        numel = math.prod(shape)
        element_bits = numel * self.element.bits
        total = (element_bits + 7) // 8
        if self.block is not None:
            n_blocks = numel // self.block_length(shape) if numel else 0
            total += n_blocks * SCALE_BITS[self.scale] // 8
        if self.two_level:
            total += 4 * math.prod(shape[:-2])
        return total

    def bits_per_element_at(self, shape) -> float:
        """Exact storage bits per element for `shape` (every dim >= 1), all scales included."""
        shape = tuple(shape)
        if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                            for n in shape):
            raise ValueError(f"shape: expected a non-empty shape of ints >= 1 (bits per "
                             f"element of no element are undefined), got {list(shape)}")
        return 8.0 * self.nbytes(shape) / math.prod(shape)


_FORMATS = {
    f.name: f
    for f in (
        Format("fp64", FP64),
        Format("fp32", FP32),
        Format("fp16", FP16),
        Format("bf16", BF16),
        Format("fp8_e4m3", E4M3),
        Format("fp8_e5m2", E5M2),
        Format("nvfp4", E2M1, block=16, scale="e4m3", two_level=True),
        Format("mxfp4", E2M1, block=32, scale="e8m0"),
        Format("fp8_e4m3_row", E4M3, block=ROW, scale="fp32"),
        Format("fp4_e2m1_b16", E2M1, block=16, scale="fp32"),
        Format("fp4_e2m1_b32", E2M1, block=32, scale="fp32"),
    )
}


def names() -> list[str]:
    """Names accepted by `get`, in a fixed order."""
    return list(_FORMATS)


def get(name: str | Format) -> Format:
    """The format called `name` (a `Format` passes through)."""
    if isinstance(name, Format):
        return name
    if not isinstance(name, str) or name not in _FORMATS:
        raise ValueError(f"format: expected one of {names()}, got {name!r}")
    return _FORMATS[name]
