"""Where a kernel's warps wait, instruction by instruction: ncu's warp-state sampling
(the SourceCounters section) read back per SASS instruction and per source line.

`scripts/ncu_source.sh` profiles a kernel_bench kernel on the H200 with CuTe DSL's line
information on (CUTE_DSL_LINEINFO=1) and exports ncu's source page twice: per SASS
instruction with every stall reason's samples (`--print-source sass`), and interleaved with
the Python lines they came from (`--print-source cuda,sass`). This module joins the two,
keeps the part worth keeping in the repository (`--trim`: one row per instruction, gzip),
and prints where the samples fall:

    python -m tools.stall_sites OUT/stalls_cute_nonflush_nvfp4.csv.gz

- by stall reason (ncu's names: long_sb is a wait on a global or local load, barrier a
  CTA barrier, math a busy pipe, not_selected / selected an eligible warp);
- by source line (file:line, the instructions' samples summed);
- for the long-scoreboard samples, by the load they wait on: the nearest earlier global load
  that writes a register the waiting instruction reads (a heuristic: within 400 instructions,
  in address order; "?" where none is found).

`--top N` prints N rows in each table (without it, 15 lines and loads and the 10 largest
reasons). With a raw export, `--lines` names its cuda,sass export (scripts/ncu_source.sh's
comments show the commands); one that maps none of its instructions is an error, not a report
with every sample on "?:0".

No GPU and no CuTe DSL needed. A sample is a warp seen at an instruction on one of the SM
sub-partitions' sampling ticks, so a reason's share of the samples is its share of the
warps' time (issued or not).
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.stall_sites")

import argparse
import csv
import gzip
import io
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
# instructions whose results a long-scoreboard wait can be on (global and local memory)
LOAD_OPCODES = ("LDG", "LDL", "LD.", "ATOMG", "ATOM.", "RED")
TRIM_COLUMNS = ("offset", "file", "line", "sass", "samples", "stalls", "source")
# rows per table without --top: ncu has some 14 stall reasons, the last few with almost no
# samples, so the reasons' table stops at 10
TOP, TOP_REASONS = 15, 10


class LinesError(ValueError):
    """The --lines file (the cuda,sass export) is at fault, not the report: the command line
    names the option, so that a bad --lines is not taken for a bad report."""


@dataclass
class Instruction:
    offset: int  # bytes from the kernel's first instruction
    sass: str
    samples: int
    stalls: dict = field(default_factory=dict)  # reason (ncu's, less "stall_") -> samples
    file: str = "?"
    line: int = 0
    source: str = ""


# --------------------------------------------------------------------------------------------
# Reading


def _open_text(path: str | Path):
    path = Path(path)
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, newline="", encoding="utf-8")


def _int(text: str) -> int:
    return int(text) if text not in ("", "-") else 0


def read_sass_export(path: str | Path) -> list[Instruction]:
    """The instructions of ncu's `--page source --csv --print-source sass` export (its first
    kernel), in address order."""
    with _open_text(path) as f:
        rows = list(csv.reader(f))
    header = next((i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"]), None)
    if header is None:
        raise ValueError(f"{path}: no 'Address','Source' header (not an ncu source export)")
    names = rows[header]
    col = {name: i for i, name in enumerate(names)}
    if SAMPLES not in col:
        raise ValueError(f"{path}: no '{SAMPLES}' column (profile with --section SourceCounters)")
    reasons = [n for n in names if n.startswith("stall_") and not n.endswith("(Not Issued)")]
    out, base = [], None
    for r in rows[header + 1:]:
        if len(r) < len(names) or not r[0].startswith("0x"):
            break  # the next kernel's section, if any
        address = int(r[0], 16)
        base = address if base is None else base
        stalls = {n[len("stall_"):]: _int(r[col[n]]) for n in reasons if _int(r[col[n]])}
        out.append(Instruction(address - base, r[1].strip(), _int(r[col[SAMPLES]]), stalls))
    return out


def read_line_map(path: str | Path) -> dict[int, tuple[str, int, str]]:
    """Address -> (file name, line, source text) from ncu's `--print-source cuda,sass`
    export, where each source line's row precedes the rows of its instructions. A row that
    is neither is a ValueError naming the file and the line."""
    found: dict[int, tuple[str, int, str]] = {}
    current, file = None, "?"
    with _open_text(path) as f:
        reader = csv.reader(f)
        for r in reader:
            if not r:
                continue
            where = f"{path}: line {reader.line_num}"
            if r[0] == "File Path" and len(r) > 1:
                file = Path(r[1]).name
            elif r[0] in ("Line No", "Function Name", "Kernel Name"):
                continue
            elif r[0]:
                try:
                    current = (file, int(r[0]), r[1].strip())
                except (ValueError, IndexError):
                    raise ValueError(f"{where}: expected a source line's number and text, got "
                                     f"{r[:2]} (not ncu's --print-source cuda,sass export)"
                                     ) from None
            elif len(r) > 2 and r[2].startswith("0x") and current is not None:
                try:
                    found[int(r[2], 16)] = current
                except ValueError:
                    raise ValueError(f"{where}: {r[2]!r} is not an address") from None
    return found


def read_export(sass_csv: str | Path, lines_csv: str | Path | None = None) -> list[Instruction]:
    """The instructions of a raw export, with their source lines where `lines_csv` (the
    cuda,sass export of the same report) maps them."""
    instructions = read_sass_export(sass_csv)
    if lines_csv is not None:
        try:
            by_address = read_line_map(lines_csv)
        except OSError as error:  # (its text names the file again)
            raise LinesError(f"{lines_csv}: {error.strerror or error}") from None
        except (ValueError, csv.Error) as error:
            message = str(error)
            raise LinesError(message if message.startswith(str(lines_csv))
                             else f"{lines_csv}: {message}") from None
        # both exports list the same addresses; the sass export's first is the kernel's start
        with _open_text(sass_csv) as f:
            base = next(int(r[0], 16) for r in csv.reader(f) if r and r[0].startswith("0x"))
        mapped = 0
        for ins in instructions:
            loc = by_address.get(base + ins.offset)
            if loc:
                ins.file, ins.line, ins.source = loc
                mapped += 1
        # a lines file of another report or kernel maps nothing: every sample would go to '?:0'
        # without a word; a few unmapped instructions (no line information) are ncu's
        if instructions and not mapped:
            raise LinesError(f"{lines_csv}: maps none of the {len(instructions)} instructions "
                             f"of {sass_csv} (from {hex(base)}; it maps {len(by_address)} "
                             "addresses): the cuda,sass export of another report or kernel?")
    return instructions


def write_trimmed(instructions: list[Instruction], path: str | Path) -> None:
    """One row per instruction (TRIM_COLUMNS; stalls as 'reason:samples;...'), gzip when the
    name ends in .gz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open(path, "wt", encoding="utf-8", newline="") if path.suffix == ".gz" \
        else open(path, "w", encoding="utf-8", newline="")
    with opener as f:
        w = csv.writer(f)
        w.writerow(TRIM_COLUMNS)
        for ins in instructions:
            stalls = ";".join(f"{k}:{v}" for k, v in sorted(ins.stalls.items()))
            w.writerow([ins.offset, ins.file, ins.line, ins.sass, ins.samples, stalls,
                        ins.source])


def _count(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {text!r}")
    return value


def _trimmed_row(r: list[str]) -> Instruction:
    if len(r) != len(TRIM_COLUMNS):
        raise ValueError(f"expected {len(TRIM_COLUMNS)} columns ({','.join(TRIM_COLUMNS)}), "
                         f"got {len(r)}")
    offset, file, line, sass, samples, stalls, source = r
    parsed = {}
    for part in filter(None, stalls.split(";")):
        reason, colon, n = part.partition(":")
        if not reason or not colon:
            raise ValueError(f"stalls: expected 'reason:samples;...', got {stalls!r}")
        parsed[reason] = _count(f"stalls ({reason})", n)
    return Instruction(_count("offset", offset), sass, _count("samples", samples), parsed,
                       file, _count("line", line), source)


def read_trimmed(path: str | Path) -> list[Instruction]:
    """The instructions of a file written by write_trimmed. A malformed row (a column missing
    or extra, a count that is not an integer) is a ValueError naming the file and the line,
    not a traceback from deep in the report."""
    with _open_text(path) as f:
        reader = csv.reader(f)
        if tuple(next(reader, ())) != TRIM_COLUMNS:
            raise ValueError(f"{path}: expected the columns {list(TRIM_COLUMNS)}")
        out = []
        for r in reader:
            if not r:
                continue  # a blank line, as csv.DictReader skips it
            try:
                out.append(_trimmed_row(r))
            except ValueError as error:
                raise ValueError(f"{path}: line {reader.line_num}: {error}") from None
    return out


def read_any(path: str | Path, lines_csv: str | Path | None = None) -> list[Instruction]:
    """A trimmed file, or a raw sass export (with `lines_csv` for its source lines). A trimmed
    file carries its source lines: `lines_csv` with one is refused, not ignored."""
    with _open_text(path) as f:
        first = f.readline()
    if first.startswith(",".join(TRIM_COLUMNS[:2])):
        if lines_csv is not None:
            raise ValueError("a trimmed file carries its source lines: drop --lines")
        return read_trimmed(path)
    return read_export(path, lines_csv)


# --------------------------------------------------------------------------------------------
# Where the samples fall


def by_reason(instructions: list[Instruction]) -> Counter:
    total: Counter = Counter()
    for ins in instructions:
        total.update(ins.stalls)
    return total


def by_line(instructions: list[Instruction]) -> dict[tuple[str, int], dict]:
    """(file, line) -> {'samples', 'reasons' (Counter), 'source', 'instructions'}."""
    out: dict = defaultdict(lambda: {"samples": 0, "reasons": Counter(), "source": "",
                                     "instructions": 0})
    for ins in instructions:
        entry = out[(ins.file, ins.line)]
        entry["samples"] += ins.samples
        entry["reasons"].update(ins.stalls)
        entry["source"] = entry["source"] or ins.source
        entry["instructions"] += 1
    return dict(out)


def registers(sass: str) -> tuple[str, set[int], set[int]]:
    """(opcode, registers written, registers read) of one SASS instruction; vector accesses
    (.64, .128) widen the first destination register to 2 or 4."""
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).rstrip(" ;")
    parts = text.split(None, 1)
    opcode, operands = parts[0], (parts[1] if len(parts) > 1 else "")
    fields = [o.strip() for o in operands.split(",")]

    def regs(t: str) -> set[int]:
        return {int(m) for m in re.findall(r"(?<![A-Z_])R(\d+)", t)}

    written = regs(fields[0]) if fields and fields[0] else set()
    read = set().union(*(regs(t) for t in fields[1:])) if len(fields) > 1 else set()
    if opcode.startswith("ST") or opcode.startswith("RED"):  # stores write nothing
        written, read = set(), written | read
    width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
    if width > 1 and written:
        first = min(written)
        written = {first + i for i in range(width)}
    return opcode, written, read


def by_load(instructions: list[Instruction], window: int = 400) -> Counter:
    """Long-scoreboard samples by the load waited on: (file, line, source) of the nearest
    earlier load (LOAD_OPCODES) within `window` instructions writing a register that the
    waiting instruction reads; ('?', 0, '') where none is found."""
    decoded = [registers(ins.sass) for ins in instructions]
    out: Counter = Counter()
    for n, ins in enumerate(instructions):
        waiting = ins.stalls.get("long_sb", 0)
        if not waiting:
            continue
        _, _, read = decoded[n]
        key = ("?", 0, "")
        for k in range(n - 1, max(-1, n - window), -1):
            opcode, written, _ = decoded[k]
            if opcode.startswith(LOAD_OPCODES) and written & read:
                p = instructions[k]
                key = (p.file, p.line, p.source)
                break
        out[key] += waiting
    return out


def report(instructions: list[Instruction], top: int | None = None) -> str:
    """The three tables, `top` rows each; without `top`, TOP rows and TOP_REASONS reasons."""
    top, top_reasons = (TOP, TOP_REASONS) if top is None else (top, top)
    total = sum(ins.samples for ins in instructions)
    if total == 0:
        return "no samples (profile with --section SourceCounters)"
    lines = [f"{len(instructions)} SASS instructions, {total} warp samples"]
    lines.append("by stall reason (share of all samples):")
    for reason, n in by_reason(instructions).most_common(top_reasons):
        lines.append(f"  {reason:18s} {n / total:6.3f}")
    lines.append(f"by source line, the {top} with the most samples (share; the two largest "
                 "reasons there):")
    ranked = sorted(by_line(instructions).items(), key=lambda kv: -kv[1]["samples"])
    for (file, line), e in ranked[:top]:
        reasons = ", ".join(f"{r} {n / total:.3f}" for r, n in e["reasons"].most_common(2))
        lines.append(f"  {e['samples'] / total:6.3f}  {file}:{line}  [{reasons}]  "
                     f"{e['source'][:70]}")
    waits = by_load(instructions)
    lines.append(f"long-scoreboard samples ({sum(waits.values()) / total:.3f} of all) by the "
                 "load waited on:")
    for (file, line, source), n in waits.most_common(top):
        lines.append(f"  {n / total:6.3f}  {file}:{line}  {source[:70]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.stall_sites",
        allow_abbrev=False,  # a flag reads the same in a results file as in --help
        description="Where a kernel's warps wait: ncu's warp-state samples per stall reason, "
        "per source line and per load waited on, from scripts/ncu_source.sh's exports (or a "
        "file trimmed from them with --trim). CPU only.")
    p.add_argument("report", help="a trimmed file (.csv or .csv.gz) or a raw sass export "
                   "(src_<kernel>.csv)")
    p.add_argument("--lines", metavar="CSV", help="with a raw export: the cuda,sass export of "
                   "the same report (src_<kernel>.cuda_sass.csv), for the source lines")
    p.add_argument("--trim", metavar="OUT", help="write the joined instructions to OUT "
                   "(.csv.gz: gzip) instead of printing the report")
    p.add_argument("--top", type=int, help=f"rows in every table (default {TOP}, and the "
                   f"{TOP_REASONS} largest stall reasons); not with --trim, which keeps every "
                   "instruction")
    args = p.parse_args(argv)
    if args.top is not None and args.top < 1:
        p.error(f"--top: expected an integer >= 1, got {args.top}")
    if args.top is not None and args.trim:
        # the trimmed file is the whole reading, to be reported later with any --top; cutting
        # it to the top instructions would lose the sums, and ignoring --top would be silent
        p.error("--top has no effect with --trim (the trimmed file keeps every instruction): "
                "drop --top, and give it when reading the trimmed file")
    try:
        instructions = read_any(args.report, args.lines)
    except LinesError as error:  # (it names the file)
        print(f"stall_sites: --lines {error}", file=sys.stderr)
        return 2
    except (OSError, ValueError, StopIteration, csv.Error) as error:
        message = str(error) or type(error).__name__  # (OSError's and ours name the file)
        if args.report not in message:
            message = f"{args.report}: {message}"
        print(f"stall_sites: {message}", file=sys.stderr)
        return 2
    if args.trim:
        try:
            write_trimmed(instructions, args.trim)
        except OSError as error:
            print(f"stall_sites: --trim {args.trim}: {error}", file=sys.stderr)
            return 2
        print(f"wrote {args.trim} ({len(instructions)} instructions)")
        return 0
    print(report(instructions, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
