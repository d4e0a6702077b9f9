"""tools.stall_sites: ncu's per-instruction warp samples joined with their source lines,
summed by reason, by line and by the load a long-scoreboard wait is on (CPU only)."""

import csv
import gzip
import random

import pytest

from tools import stall_sites as ss

REASONS = ("barrier", "long_sb", "math", "not_selected", "selected", "wait")
BASE = 0x7F00_0000_5700


def _program(rng):
    """An odd-length SASS listing: loads, their consumers and filler, with random samples."""
    prog = [
        ("LDG.E.128 R4, desc[UR4][R2.64]", "k.py", 10, "state = load()"),
        ("LDG.E R9, desc[UR4][R30.64]", "k.py", 11, "bias = load()"),
        ("IMAD.SHL.U32 R12, R6, 0x10, RZ", "k.py", 20, "decode(state)"),  # reads R6: R4..R7
        ("FADD R13, R9, R1", "k.py", 21, "raw + bias"),  # reads R9
        ("@!P0 LOP3.LUT R14, R12, 0xff, RZ, 0xc0, !PT", "k.py", 20, "decode(state)"),
        ("STG.E desc[UR4][R20.64], R14", "k.py", 30, "store(out)"),
        ("FFMA R15, R40, R41, R42", "k.py", 31, "acc = acc + c * x"),  # no load feeds it
    ]
    out = []
    for sass, file, line, source in prog:
        stalls = {r: rng.randrange(0, 50) for r in rng.sample(REASONS, 3)}
        out.append((sass, file, line, source, stalls))
    return out


def _write_exports(tmp_path, prog):
    """The two ncu exports of one kernel, in ncu's layout."""
    reasons = [f"stall_{r}" for r in REASONS] + [f"stall_{r} (Not Issued)" for r in REASONS]
    names = ["Address", "Source", ss.SAMPLES, "# Samples", *reasons]
    sass_csv = tmp_path / "src_k.csv"
    with open(sass_csv, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "kernel_0"])
        w.writerow(names)
        for i, (sass, _, _, _, stalls) in enumerate(prog):
            total = sum(stalls.values())
            w.writerow([hex(BASE + 16 * i), "      " + sass, total, total]
                       + [stalls.get(r, 0) for r in REASONS] + ["-"] * len(REASONS))
    lines_csv = tmp_path / "src_k.cuda_sass.csv"
    with open(lines_csv, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["File Path", "/repo/k.py"])
        w.writerow(["Function Name", "kernel_0"])
        w.writerow(["Line No", "Source", "Address", "Source", ss.SAMPLES])
        by_line = {}
        for i, (sass, _, line, source, _) in enumerate(prog):
            by_line.setdefault((line, source), []).append((i, sass))
        for (line, source), rows in sorted(by_line.items()):
            w.writerow([line, source, "-", "-", 0])
            for i, sass in rows:
                w.writerow(["", "", hex(BASE + 16 * i), sass, 0])
    return sass_csv, lines_csv


@pytest.fixture
def exported(tmp_path):
    prog = _program(random.Random(7))
    return prog, *_write_exports(tmp_path, prog)


def test_export_joins_every_instruction_with_its_source_line(exported):
    prog, sass_csv, lines_csv = exported
    ins = ss.read_export(sass_csv, lines_csv)
    assert [i.offset for i in ins] == [16 * k for k in range(len(prog))]
    assert [(i.file, i.line, i.source) for i in ins] == [(f, ln, s) for _, f, ln, s, _ in prog]
    assert [i.samples for i in ins] == [sum(st.values()) for *_, st in prog]
    assert [i.stalls for i in ins] == [{k: v for k, v in st.items() if v} for *_, st in prog]


def test_sums_by_reason_and_line_account_for_every_sample(exported):
    prog, sass_csv, lines_csv = exported
    ins = ss.read_export(sass_csv, lines_csv)
    reasons = ss.by_reason(ins)
    assert sum(reasons.values()) == sum(i.samples for i in ins)
    for r in REASONS:
        assert reasons[r] == sum(st.get(r, 0) for *_, st in prog)
    lines = ss.by_line(ins)
    assert lines[("k.py", 20)]["samples"] == ins[2].samples + ins[4].samples
    assert lines[("k.py", 20)]["instructions"] == 2
    assert sum(e["samples"] for e in lines.values()) == sum(i.samples for i in ins)


def test_long_scoreboard_waits_go_to_the_load_that_wrote_the_register(exported):
    """IMAD reads R6, which the 16-byte load into R4..R7 writes; FADD reads R9 (the 4-byte
    load); the predicated LOP3 reads R12, written by no load; FFMA reads nothing loaded."""
    _, sass_csv, lines_csv = exported
    ins = ss.read_export(sass_csv, lines_csv)
    waits = ss.by_load(ins)
    lsb = [i.stalls.get("long_sb", 0) for i in ins]
    assert waits[("k.py", 10, "state = load()")] == lsb[2]
    assert waits[("k.py", 11, "bias = load()")] == lsb[3]
    assert waits[("?", 0, "")] == lsb[0] + lsb[1] + lsb[4] + lsb[5] + lsb[6]


def test_registers_widen_vector_loads_and_stores_write_nothing():
    assert ss.registers("LDG.E.128 R20, desc[UR14][R24.64+0x10] ;") == (
        "LDG.E.128", {20, 21, 22, 23}, {24})
    assert ss.registers("@!P1 LDG.E.64 R58, desc[UR14][R44.64+0x400] ;")[1] == {58, 59}
    assert ss.registers("STG.E desc[UR4][R20.64], R14 ;") == ("STG.E", set(), {20, 14})
    assert ss.registers("FFMA R95, R82, R2, R3 ;") == ("FFMA", {95}, {82, 2, 3})


@pytest.mark.parametrize("name", ["t.csv", "t.csv.gz"])
def test_trimmed_file_round_trips(exported, tmp_path, name):
    _, sass_csv, lines_csv = exported
    ins = ss.read_export(sass_csv, lines_csv)
    ss.write_trimmed(ins, tmp_path / name)
    assert ss.read_any(tmp_path / name) == ins
    assert ss.report(ss.read_any(tmp_path / name)) == ss.report(ins)


def test_report_names_the_largest_shares(exported, capsys):
    _, sass_csv, lines_csv = exported
    assert ss.main([str(sass_csv), "--lines", str(lines_csv), "--top", "3"]) == 0
    text = capsys.readouterr().out
    ins = ss.read_export(sass_csv, lines_csv)
    total = sum(i.samples for i in ins)
    top_reason, n = ss.by_reason(ins).most_common(1)[0]
    assert f"{top_reason:18s} {n / total:6.3f}" in text
    assert f"{len(ins)} SASS instructions, {total} warp samples" in text


def test_a_file_that_is_not_an_export_is_a_clear_error(tmp_path, capsys):
    """One line naming the file once, exit status 2."""
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert ss.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not an ncu source export" in err and err.count(str(bad)) == 1
    assert len(err.strip().splitlines()) == 1
    assert ss.main([str(tmp_path / "missing.csv")]) == 2
    assert capsys.readouterr().err.count("missing.csv") == 1


def test_bad_top_or_trim_path_is_a_clear_error(exported, tmp_path, capsys):
    """--top below 1 (a negative one printed all rows but the last) and a --trim path that
    cannot be written (a traceback) are one-line errors with exit status 2; a --trim path in
    a folder not made yet is written, the folder made, as the other commands do."""
    _, sass_csv, lines_csv = exported
    for top in ("0", "-2"):
        with pytest.raises(SystemExit) as exit_:
            ss.main([str(sass_csv), "--top", top])
        assert exit_.value.code == 2
        assert "--top: expected an integer >= 1" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    for out in (tmp_path, tmp_path / "file" / "t.csv.gz"):
        assert ss.main([str(sass_csv), "--lines", str(lines_csv), "--trim", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("stall_sites: --trim ") and "Traceback" not in err
    new = tmp_path / "new" / "t.csv.gz"
    assert ss.main([str(sass_csv), "--lines", str(lines_csv), "--trim", str(new)]) == 0
    assert ss.read_any(new) == ss.read_export(sass_csv, lines_csv)


def test_lines_with_a_trimmed_file_is_refused_not_ignored(exported, tmp_path, capsys):
    """A trimmed file carries its source lines; --lines with one was silently ignored, now a
    one-line error (exit 2). Without --lines the trimmed file reports as the export did."""
    _, sass_csv, lines_csv = exported
    trimmed = tmp_path / "t.csv.gz"
    assert ss.main([str(sass_csv), "--lines", str(lines_csv), "--trim", str(trimmed)]) == 0
    capsys.readouterr()
    assert ss.main([str(trimmed), "--lines", str(lines_csv)]) == 2
    err = capsys.readouterr().err
    assert "drop --lines" in err and "Traceback" not in err
    assert ss.main([str(trimmed)]) == 0
    from_trimmed = capsys.readouterr().out
    assert ss.main([str(sass_csv), "--lines", str(lines_csv)]) == 0
    assert capsys.readouterr().out == from_trimmed


def _reasons_table(text):
    body = text.split("by stall reason (share of all samples):\n")[1].split("\nby source line")[0]
    return [row.split()[0] for row in body.splitlines()]


@pytest.mark.parametrize("bad, message", [
    (lambda r: r[:4], "expected 7 columns (offset,file,line,sass,samples,stalls,source), got 4"),
    (lambda r: r + ["0x1f"], "expected 7 columns (offset,file,line,sass,samples,stalls,source), "
     "got 8"),
    (lambda r: r[:4] + ["3e2"] + r[5:], "samples: expected an integer >= 0, got '3e2'"),
    (lambda r: r[:2] + [""] + r[3:], "line: expected an integer >= 0, got ''"),
    (lambda r: r[:5] + ["long_sb=17;wait:2"] + r[6:],
     "stalls: expected 'reason:samples;...', got 'long_sb=17;wait:2'"),
    (lambda r: r[:5] + ["mio:5;wait:-4"] + r[6:], "stalls (wait): expected an integer >= 0, "
     "got '-4'"),
], ids=["column-missing", "column-extra", "samples", "line", "stalls", "stall-count"])
def test_a_malformed_row_of_a_trimmed_file_names_the_file_and_line(exported, tmp_path, capsys,
                                                                    bad, message):
    """A row with a column missing was a traceback (AttributeError on None) and a count that
    is not an integer an error without the line; now one line, the file named once with the
    line, exit status 2."""
    _, sass_csv, lines_csv = exported
    trimmed = tmp_path / "t.csv.gz"
    assert ss.main([str(sass_csv), "--lines", str(lines_csv), "--trim", str(trimmed)]) == 0
    with gzip.open(trimmed, "rt", newline="") as f:
        rows = list(csv.reader(f))
    rows[5] = bad(rows[5])  # the file's line 6 (one row a line: the sources have no newline)
    with gzip.open(trimmed, "wt", newline="") as f:
        csv.writer(f).writerows(rows)
    capsys.readouterr()
    assert ss.main([str(trimmed)]) == 2
    err = capsys.readouterr().err
    assert err == f"stall_sites: {trimmed}: line 6: {message}\n"
    with pytest.raises(ValueError, match="line 6: "):
        ss.read_any(trimmed)


def test_a_bad_lines_file_is_blamed_on_lines_not_the_report(exported, tmp_path, capsys):
    """A --lines file missing, not gzip, or not a cuda,sass export (the sass export given in
    its place) was reported as '<report>: ...'; now 'stall_sites: --lines <file>: ...', the
    report not named, the file once, exit status 2."""
    _, sass_csv, lines_csv = exported
    sass_again = tmp_path / "src_k_again.csv"
    sass_again.write_bytes(sass_csv.read_bytes())
    not_gzip = tmp_path / "src_k.cuda_sass.csv.gz"
    not_gzip.write_bytes(lines_csv.read_bytes())
    cases = {tmp_path / "no_such.cuda_sass.csv": "No such file or directory",
             not_gzip: "Not a gzipped file",
             sass_again: "line 2: expected a source line's number and text, got ['Address', "
                         "'Source'] (not ncu's --print-source cuda,sass export)"}
    for lines, message in cases.items():
        assert ss.main([str(sass_csv), "--lines", str(lines)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"stall_sites: --lines {lines}: ") and message in err, err
        assert str(sass_csv) not in err and err.count(str(lines)) == 1
        assert len(err.strip().splitlines()) == 1


def test_lines_that_map_no_instruction_is_an_error_not_a_silent_report(exported, tmp_path,
                                                                       capsys):
    """The cuda,sass export of another kernel (other addresses) mapped nothing and the report
    put every sample on '?:0' without a word (and --trim kept that); now an error naming
    --lines, nothing written. One address missing (an instruction without line information)
    is still read, that instruction on '?:0'."""
    prog, sass_csv, lines_csv = exported
    text = lines_csv.read_text()
    other = tmp_path / "other.cuda_sass.csv"
    other.write_text(text.replace(hex(BASE)[:-3], hex(BASE + 0x3A000)[:-3]))
    assert other.read_text() != text
    trimmed = tmp_path / "t.csv.gz"
    for extra in ([], ["--trim", str(trimmed)]):
        assert ss.main([str(sass_csv), "--lines", str(other), *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (
            f"stall_sites: --lines {other}: maps none of the {len(prog)} instructions of "
            f"{sass_csv} (from {hex(BASE)}; it maps {len(prog)} addresses): the cuda,sass export "
            "of another report or kernel?\n")
    assert not trimmed.exists()
    partial = tmp_path / "partial.cuda_sass.csv"
    partial.write_text("".join(r for r in text.splitlines(keepends=True)
                               if hex(BASE + 16 * 3) not in r))
    ins = ss.read_export(sass_csv, partial)
    assert [(i.file, i.line) for i in ins].count(("?", 0)) == 1 and ins[3].file == "?"


def test_top_applies_to_the_reasons_table_too(tmp_path, capsys):
    """--top cut the lines' and loads' tables but the reasons' stayed at 10; now it cuts all
    three. Without --top the output is as before: 15 lines and loads, the 10 largest of the
    reasons."""
    rng = random.Random(2029)
    reasons = [f"r{rng.randrange(10**6):06d}" for _ in range(13)]
    ins = [ss.Instruction(16 * k, "FADD R1, R2, R3", 0,
                          {r: rng.randrange(1, 90) for r in rng.sample(reasons, 5)},
                          "q.py", 3 + k % 17, f"x{k % 17} = y") for k in range(41)]
    for i in ins:
        i.samples = sum(i.stalls.values())
    ranked = [r for r, _ in ss.by_reason(ins).most_common()]
    assert len(ranked) == 13
    assert _reasons_table(ss.report(ins)) == ranked[:10]
    assert ss.report(ins).count("q.py:") == 15
    for top in (3, 12, 20):
        assert _reasons_table(ss.report(ins, top)) == ranked[:top]
    trimmed = tmp_path / "q.csv"
    ss.write_trimmed(ins, trimmed)
    assert ss.main([str(trimmed), "--top", "4"]) == 0
    assert _reasons_table(capsys.readouterr().out) == ranked[:4]
    assert ss.main([str(trimmed)]) == 0
    assert capsys.readouterr().out == ss.report(ins) + "\n"


def test_top_with_trim_is_refused(exported, tmp_path, capsys):
    """--trim writes every instruction, so --top with it had no effect, silently; now an
    argument error (exit status 2) and nothing written."""
    _, sass_csv, lines_csv = exported
    trimmed = tmp_path / "t.csv.gz"
    with pytest.raises(SystemExit) as exit_:
        ss.main([str(sass_csv), "--lines", str(lines_csv), "--trim", str(trimmed), "--top", "7"])
    assert exit_.value.code == 2
    assert "--top has no effect with --trim" in capsys.readouterr().err
    assert not trimmed.exists()
