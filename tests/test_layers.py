"""The kit's packages stack in one direction: lowprec (the definition) imports none of the
others; emulation and cute_kernels build on lowprec and not on each other, the experiments
or the diagnostics in tools; experiments and tools may use them all. A kernel module that
imported experiments would pull pandas and matplotlib into every kernel import (and a cycle
waits there: kernel_bench imports cute_kernels)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> kit packages it must not import
FORBIDDEN = {
    "lowprec": {"emulation", "cute_kernels", "experiments", "tools", "tests"},
    "emulation": {"cute_kernels", "experiments", "tools", "tests"},
    "cute_kernels": {"emulation", "experiments", "tools", "tests"},
    "experiments": {"tests"},
    "tools": {"tests"},
}


def kit_imports(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_package_imports_only_the_layers_below_it(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert len(files) >= 3  # the package is where this test looks for it
    wrong = {f.relative_to(ROOT).as_posix(): sorted(kit_imports(f) & FORBIDDEN[package])
             for f in files}
    assert {f: names for f, names in wrong.items() if names} == {}


def test_the_import_reader_sees_nested_and_aliased_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from experiments import _common as c\n"
                      "    import cute_kernels.replay_output, numpy as np\n"
                      "from . import sibling\n")
    assert kit_imports(module) == {"os", "experiments", "cute_kernels", "numpy"}
