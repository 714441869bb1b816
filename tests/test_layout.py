"""The tests' own layout (issue 34, "tests mirror the package"): no test module imports another
(what they share lives in ``tests/support/``), and every test basename is unique across the
folders (pytest's default ``prepend`` import mode imports each test file by its basename).

Imports are read from the source with :mod:`ast`, at any depth (a function-level import counts);
imports by string (``importlib.import_module``) are not seen."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imports_of_test_modules(root: Path) -> list[tuple[str, int, str]]:
    """``(file, line, imported module)`` for every import of a ``test_*`` module by a ``.py`` file
    under ``root`` (relative imports included: ``from .test_x import y``, ``from . import
    test_x``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names if not node.module]
            else:
                continue
            found += [(rel, node.lineno, n) for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    assert imports_of_test_modules(TESTS) == [], "move what they share into tests/support/"


def test_the_check_catches_a_test_module_importing_another(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "test_a.py").write_text("def helper():\n    return 1\n")
    (tmp_path / "engine" / "test_b.py").write_text("def test_b():\n    from test_a import helper\n")
    (tmp_path / "test_c.py").write_text("import engine.test_a\n")
    (tmp_path / "test_d.py").write_text("from . import test_c\nfrom support import fakes\n")
    assert imports_of_test_modules(tmp_path) == [
        ("engine/test_b.py", 2, "test_a"),
        ("test_c.py", 1, "engine.test_a"),
        ("test_d.py", 1, "test_c"),
    ]


def test_test_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_gpu_tests_sit_beside_the_cpu_tests_of_their_part():
    """A ``test_gpu_*.py`` lives in a part's folder, not at the root (the root holds checks of the
    whole repository: README, examples, install, import graphs, this layout)."""
    assert sorted(p.name for p in TESTS.glob("test_gpu_*.py")) == []
    assert all(p.parent.parent == TESTS for p in TESTS.rglob("test_gpu_*.py"))
