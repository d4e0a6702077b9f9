"""`python -m lowprec`: quantise one random decode state with every format and print its error
and storage bytes, then the ReplaySSM records of Mamba-2, Gated DeltaNet and KDA: a
thirty-second tour of what the formats cost and keep.

The state is one Nemotron-3-Super Mamba-2 layer's state for one sequence (128 heads x 64 x 128),
drawn like a long-memory state (Gaussian with a per-row spread of magnitudes), fixed seed.

The records are those of one layer and sequence of each registered model (`lowprec.models`:
nemotron3-super and mamba2-2.7b Mamba-2, qwen3-next-80b Gated DeltaNet, kimi-linear-48b KDA),
counted by `lowprec.traffic` in the kernel layout with the model's activations: each field
with its length, format and copies; the bytes a record takes and what a non-flush step and the
flush read of each held record; the read copy (nvfp4) and recurrence copy (fp16); and the bytes
moved per token at the window L = 16 by two precisions, an fp32 checkpoint and conventional fp32
decoding. --heads, --dv and --dk size the quantised state only.
"""

import argparse

import torch

from lowprec import formats, models, philox
from lowprec import traffic as tr
from lowprec.metrics import rel_err
from lowprec.philox import random_words
from lowprec.quantize import fake_quantize

KIND_NAMES = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet", "kda": "KDA"}
WINDOW = 16  # DESIGN.md's default window


def print_records() -> None:
    """The ReplaySSM record of every registered model, with its state copies and the bytes a
    token moves (see the module docstring)."""
    print(f"\nReplaySSM records (lowprec.traffic, kernel layout), one layer and sequence; "
          f"bytes a token at L = {WINDOW}")
    for name in models.names():
        model = models.get(name)
        ssm, act = model.ssm, model.act_format
        lengths = {"d_v": ssm.d_v, "d_k": ssm.d_k, "1": 1}
        fields = tr.RECORD_LAYOUTS[(ssm.kind, "kernel")]
        layout = "; ".join(f"per {per}: " + ", ".join(
            f"{f.name} [{lengths[f.length]}] {act if f.dtype == 'act' else f.dtype}"
            for f in fields if f.per == per) for per in ("head", "group")
            if any(f.per == per for f in fields))
        record = tr.ring_record(ssm, "kernel", act)
        lo, hi, fp32 = (tr.state_bytes(ssm, f) for f in ("nvfp4", "fp16", "fp32"))
        groups = f"{ssm.ngroups} group{'s' if ssm.ngroups > 1 else ''}"
        print(f"{name}: {KIND_NAMES[ssm.kind]}, {ssm.nheads} heads of d_v {ssm.d_v} x d_k "
              f"{ssm.d_k}, {groups}")
        print(f"  record     {layout}")
        print(f"  bytes      {record.write:,} a record; of each held record a non-flush step "
              f"reads {record.nonflush_read:,}, the flush {record.flush_read:,}")
        print(f"  state      read copy nvfp4 {lo:,}; recurrence copy fp16 {hi:,}; fp32 {fp32:,}")
        print(f"  per token  fp16 + nvfp4 {tr.replay(WINDOW, record, lo, hi).per_token:,.0f}; "
              f"fp32 checkpoint {tr.replay(WINDOW, record, fp32).per_token:,.0f}; "
              f"conventional fp32 {tr.conventional(fp32).per_token:,.0f}")


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
    print_records()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status, no traceback
        import sys

        sys.stderr.write("python -m lowprec: interrupted (Ctrl-C)\n")
        sys.exit(130)
