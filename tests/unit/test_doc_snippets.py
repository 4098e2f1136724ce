"""The Python blocks of docs/planner.md run as written (pure planner code: no process group)."""

from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "planner.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_planner_doc_block_runs(i):
    exec(compile(BLOCKS[i], f"{DOC.name} block {i}", "exec"), {})


def test_there_are_blocks():
    assert len(BLOCKS) >= 2
