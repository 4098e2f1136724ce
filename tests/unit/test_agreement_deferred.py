"""The deferred unit-agreement check (Note [unit agreement] in ``raggedfsdp/fsdp/_agreement.py``) reads
a result only once its copy has finished (``event.query()``) and never blocks the host
(``event.synchronize()``, which ``torch.cuda.set_sync_debug_mode`` cannot see): a result not ready
stays pending, in order, with every newer one; a ready mismatch raises the one-step-late error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raggedfsdp.fsdp._agreement import Agreement, DeferredCheck
from raggedfsdp.fsdp._common import CollectiveMismatchError


class _Event:
    def __init__(self, done: bool):
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self):
        raise AssertionError("the deferred check blocked the host (event.synchronize())")


def _check(event, *, agree: bool) -> DeferredCheck:
    unit = SimpleNamespace(unit_name="layers.0", unit_id=0)
    # the all-reduced [h, -h, counts, -counts]: MAX over ranks; equal hashes / counts iff h == -(-h)
    h, neg_h = (7, -7) if agree else (9, -7)
    return DeferredCheck(torch.tensor([h, neg_h, 2, -2]), event, [unit], [2], ran="all-gather of 'layers.0'")


def test_pending_check_is_read_only_when_its_event_completed():
    a = Agreement()
    older, newer = _Event(False), _Event(True)
    a.pending = [_check(older, agree=False), _check(newer, agree=True)]
    a.check_pending()  # the older one is not ready: nothing is read, nothing blocks, the order is kept
    assert older.queries == 1 and [d.event for d in a.pending] == [older, newer]
    older.done = True
    with pytest.raises(CollectiveMismatchError, match="deferred check .* already used the wrong gradients"):
        a.check_pending()
    assert not a.pending


def test_ready_checks_that_agree_are_consumed():
    a = Agreement()
    a.pending = [_check(_Event(True), agree=True), _check(None, agree=True)]
    a.check_pending()
    assert not a.pending
