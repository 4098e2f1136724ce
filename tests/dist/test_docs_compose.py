"""The runnable snippets of docs/fsdp.md "Composing with TP, EP and torch.compile", executed as written on 4
gloo ranks (the ``torchrun --nproc-per-node 4`` the docs name), TP and EP in one spawn: they must run, print
the placements they claim and lower the loss."""

from __future__ import annotations

import io
import pathlib
import re
from contextlib import redirect_stdout

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "fsdp.md"


def snippet(name: str) -> str:
    text = DOC.read_text()
    m = re.search(r"<!-- snippet: " + re.escape(name) + r"\b[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, f"snippet {name!r} not found in {DOC}"
    return m.group(1)


def _claimed_tp_placement() -> str:
    """The placement the prose after the TP snippet says it prints (it once said ``dims=(0,)`` while the
    snippet printed ``dims=(0, 1)``)."""
    m = re.search(r"The weight prints `(RaggedShard\([^`]*\))`", DOC.read_text())
    assert m, f"the TP placement claim is not found in {DOC}"
    return m.group(1)


def _run(rank, ws, snippets):
    for code, placements in snippets:
        buf = io.StringIO()
        with redirect_stdout(buf):
            exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})
        out = buf.getvalue()
        assert all(p in out for p in placements), out
        losses = [float(x) for x in re.findall(r"loss (\S+)", out)]
        assert len(losses) == 3 and losses[2] < losses[0], out


def _snippets(rank, ws):
    _run(
        rank,
        ws,
        [
            (snippet("compose-tp"), ("('dp', 'tp') (RaggedShard(", "Shard(dim=1))", _claimed_tp_placement())),
            (snippet("compose-ep"), ("('dp', 'ep') (RaggedShard(", "Shard(dim=0))")),
        ],
    )


def test_compose_tp_and_ep_snippets_run():
    SPAWNS.check(4, "docs_compose")
