"""The README's quick start runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_a_quick_start():
    assert _python_blocks(), "README lost its python quick start"


@pytest.mark.parametrize("block", _python_blocks())
def test_readme_python_block_runs(block):
    exec(compile(block, str(README), "exec"), {})
