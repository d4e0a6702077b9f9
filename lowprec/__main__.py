"""`python -m lowprec`: quantise one random decode state with every format and print its error
and storage bytes: a thirty-second tour of what the formats cost and keep.

The state is one Nemotron-3-Super Mamba-2 layer's state for one sequence (128 heads x 64 x 128),
drawn like a long-memory state (Gaussian with a per-row spread of magnitudes), fixed seed.
"""

import argparse

import torch

from lowprec import formats, philox
from lowprec.metrics import rel_err
from lowprec.philox import random_words
from lowprec.quantize import fake_quantize


class _Parser(argparse.ArgumentParser):
    """An argument error is one line on stderr and exit status 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv=None) -> None:
    parser = _Parser(prog="python -m lowprec", description=__doc__, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=128, help="heads (default 128)")
    parser.add_argument("--dv", type=int, default=64, help="headdim d_v (default 64)")
    parser.add_argument("--dk", type=int, default=128,
                        help="dstate d_k, a multiple of 32 (mxfp4's block; default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = parser.parse_args(argv)
    for name in ("heads", "dv"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1 (got {getattr(args, name)})")
    if args.dk < 32 or args.dk % 32:
        parser.error(f"--dk must be a positive multiple of 32 (got {args.dk})")
    # the limits of the SR words (lowprec.philox), checked here rather than as a traceback
    if not 0 <= args.seed < philox.SEED_LIMIT:
        parser.error(f"--seed must be in [0, 2^64) (got {args.seed})")
    if args.heads * args.dv * args.dk > philox.ELEMENT_LIMIT:
        parser.error(f"--heads x --dv x --dk must be at most {philox.ELEMENT_LIMIT:,} state "
                     f"elements, the SR words' limit (got {args.heads * args.dv * args.dk:,})")

    g = torch.Generator().manual_seed(args.seed)
    shape = (args.heads, args.dv, args.dk)
    row_scale = torch.exp(torch.randn(args.heads, args.dv, 1, generator=g, dtype=torch.float64))
    state = torch.randn(*shape, generator=g, dtype=torch.float64) * row_scale
    words = random_words(args.seed, 0, 0, shape)
    print(f"one state {args.heads} x {args.dv} x {args.dk} "
          f"(fp32: {formats.get('fp32').nbytes(shape):,} bytes)")
    print(f"{'format':>14} {'bytes':>11} {'vs fp32':>8} {'rel err RN':>11} {'rel err SR':>11}")
    for name in formats.names():
        fmt = formats.get(name)
        # the kernels' states are fp32: a format is fed fp32, but fp32 itself (and fp64) the
        # fp64 state, so that its row shows the fp32 store's own RN and SR
        x = state if name in ("fp64", "fp32") else state.float()
        err = [rel_err(fake_quantize(x, fmt, r, words if r == "sr" else None).double(),
                       state, dims=(0, 1, 2)).item() for r in ("rn", "sr")]
        nbytes = fmt.nbytes(shape)
        ratio = formats.get("fp32").nbytes(shape) / nbytes
        print(f"{name:>14} {nbytes:>11,} {ratio:>7.2f}x {err[0]:>11.3e} {err[1]:>11.3e}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status, no traceback
        import sys

        sys.stderr.write("python -m lowprec: interrupted (Ctrl-C)\n")
        sys.exit(130)
