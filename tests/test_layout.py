"""The repository's shape: which package may import which (parsed with `ast`, imports inside
functions included), and how long a module may grow."""

from __future__ import annotations

import ast
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
