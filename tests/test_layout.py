"""The repository's shape: which package may import which (parsed with `ast`, imports inside
functions included), how long a module may grow, and that no tracked text speaks of how the
kit was developed instead of what it is."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lowprec", "emulation", "cute_kernels", "experiments", "tools")
MAX_MODULE_LINES = 1200

# package -> top-level modules it must never import
FORBIDDEN = {
    "lowprec": {"emulation", "cute_kernels", "experiments", "tools", "triton", "cutlass"},
    "emulation": {"cute_kernels", "experiments", "tools", "cutlass"},
    "cute_kernels": {"emulation", "experiments", "tools", "triton"},
}
# lowprec is the plain PyTorch definition: the standard library, torch and numpy only
LOWPREC_ALLOWED = set(sys.stdlib_module_names) | {"torch", "numpy", "lowprec"}

# Wording that tells how the kit was developed rather than what it is; each pattern is
# chosen not to meet ordinary technical text (a Philox round, "call a function").
HISTORY = [
    re.compile(r"\bsessions?\b", re.I),
    re.compile(r"\bcalls? \d+\b", re.I),
    re.compile(r"\bcalls? [A-Z]\b"),  # "call A", "calls B" (case-sensitive: not "call a")
    re.compile(r"\bruns? [A-C]\b"),  # a benchmark run named by its letter (see RUN_LABEL_FILES)
    re.compile(r"\b(?:tuning|development|device) (?:rounds?|calls?)\b", re.I),
    re.compile(r"\bround \d+ of\b", re.I),
    # a numbered round after a preposition of time ("in round 12"), not a Philox round's name
    re.compile(r"\b(?:in|from|since|until|after|before|during) rounds? \d+\b", re.I),
    re.compile(r"\b\d+(?:st|nd|rd|th) (?:session|call|round|attempt)\b", re.I),
    re.compile(r"\btwenty-", re.I),
    re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
               r"eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|"
               r"eighteenth|nineteenth|twentieth) (?:session|call|round|attempt)\b", re.I),
    # "the issue" as a ticket, not the issue rate, slots or width of a scheduler
    re.compile(r"\bthe issue\b(?!\s+(?:rate|slots?|width|queue|stage|order|latency|cycles?|"
               r"floor|bound|limit)\b)", re.I),
    re.compile(r"\bissue #?\d+\b(?!\.\d)", re.I),  # not "issues 0.65 a cycle"
    re.compile(r"\bissue-\d+\b", re.I),
    re.compile(r"\bpreviously\b", re.I),
    re.compile(r"\bno longer\b", re.I),
    re.compile(r"\bused to be\b", re.I),
]
HISTORY_EXEMPT = {"tests/test_layout.py"}  # it spells the patterns out
# kernel_bench labels the runs it merges by letter (its `run` column: "A", "B"), so there
# "run A" names a label, not a past run
RUN_LABEL_FILES = {"experiments/kernel_bench.py", "tests/test_kernel_bench.py"}
RUN_LABEL = HISTORY[3]


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else []


def _imported(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (relative imports: its own package)."""
    package = path.relative_to(ROOT).parts[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(package if node.level else node.module.split(".")[0])
    return names


def _tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    return [name for name in listed if name and name not in HISTORY_EXEMPT]


def test_the_packages_are_there():
    for package in ("lowprec", "emulation", "cute_kernels", "experiments", "tools"):
        assert _modules(package), f"{package}/ has no Python module"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_directions_hold(package):
    """lowprec imports no kernels, experiments or tools; emulation and cute_kernels never
    import each other; no kernel package imports experiments or tools."""
    hits = [f"{path.relative_to(ROOT)} imports {name}"
            for path in _modules(package) for name in sorted(_imported(path) & FORBIDDEN[package])]
    assert not hits, "\n".join(hits)


def test_lowprec_imports_only_the_standard_library_torch_and_numpy():
    hits = [f"{path.relative_to(ROOT)} imports {name}"
            for path in _modules("lowprec") for name in sorted(_imported(path) - LOWPREC_ALLOWED)]
    assert not hits, "\n".join(hits)


def test_import_check_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    """The check itself: an import inside a function and a relative import are found."""
    fake_root = tmp_path
    (fake_root / "emulation").mkdir()
    module = fake_root / "emulation" / "m.py"
    module.write_text("def f():\n    import cute_kernels.numerics\n"
                      "from . import numerics\nfrom experiments.kernel_bench import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    assert _imported(module) == {"cute_kernels", "emulation", "experiments"}


def test_no_module_exceeds_the_line_limit():
    long = []
    for package in PACKAGES:
        for path in _modules(package):
            lines = path.read_text().count("\n")
            if lines > MAX_MODULE_LINES:
                long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_tracked_text_speaks_of_how_the_kit_was_developed():
    hits = []
    for name in _tracked_text_files():
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (PNG, gzip) or deleted in the work tree
        patterns = [p for p in HISTORY if not (p is RUN_LABEL and name in RUN_LABEL_FILES)]
        if not any(p.search(text) for p in patterns):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found = next((m for p in patterns if (m := p.search(line))), None)
            if found:  # one report a line, for its first pattern
                hits.append(f"{name}:{number}: {found.group(0)!r}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} lines of development history:\n" + "\n".join(hits)


@pytest.mark.parametrize("text, hit", [
    ("timed in the seventh session", True), ("call 3 of the run", True), ("call A", True),
    ("run B timed it", True), ("as the issue asks", True), ("see issue 7", True),
    ("the twenty-sixth time", True), ("previously slower", True),
    ("Philox round 1 is specialised", False), ("call a function", False),
    ("a run of the benchmark", False), ("an issue of bandwidth", False),
    ("calls the kernel", False), ("re-issue the loads", False),
    ("the issue rate stops at 0.65", False), ("it issues 0.650 a cycle", False),
    ("issue 7.", True), ("as given in the issue.", True),
    ("the issue floor they set", False), ("in round 12 it was faster", True),
    ("the 14th round", True), ("measured in rounds 3 and 4", True),
    ("Round 1 is specialised", False), ("Philox round 7 adds the key", False),
    ("a 10-round Philox", False), ("philox_rounds 10", False), ("the twelfth session", True),
])
def test_history_patterns_meet_history_and_not_ordinary_text(text, hit):
    assert any(p.search(text) for p in HISTORY) == hit, text
