"""The trainer's hook points: what code outside the training step (the test-only fault injection of
``train/faults.py``) may observe or change, so that the step itself carries no such code.

Each event has a fixed signature; a hook is called with the event's arguments, in registration order:

======================  =============================================================================
event                   called / hook signature
======================  =============================================================================
``corpus``              after the corpus is loaded, before the ranks agree on it:
                        ``fn(corpus) -> corpus`` (``data.Corpus``; may return another)
``built``               after the model, FSDP and the straggler probe are built: ``fn()``
``step_begin``          at each step's start (after the straggler probe's start): ``fn(step)``
``batch``               each micro-batch (CPU tensors, ``(b, T)`` int64 each), before it is checked:
                        ``fn((inputs, targets), step, micro) -> (inputs, targets)``
``logits``              after each micro-batch's forward: ``fn(step, micro, logits)`` (``(b, T, V)``)
``loss``                each micro-batch's loss (0-d), before the backward: ``fn(loss, step, micro) ->
                        loss``
``after_optimizer``     after an applied optimizer step: ``fn(step)``
``save_writer``         each checkpoint save: ``fn(step) -> writer_factory | None`` (the first that is
                        not None is used: ``folder -> StorageWriter``; None: DCP's own)
``close``               ``Trainer.close``: ``fn()`` (release what the hooks hold)
======================  =============================================================================

Local: nothing here communicates; a hook that calls a collective must be registered on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EVENTS = (
    "corpus", "built", "step_begin", "batch", "logits", "loss", "after_optimizer", "save_writer", "close",
)  # fmt: skip


class _Handle:
    def __init__(self, fns: list, fn: Callable) -> None:
        self._fns, self._fn = fns, fn

    def remove(self) -> None:
        if self._fn in self._fns:
            self._fns.remove(self._fn)


class Hooks:
    """A registry of trainer hooks by event (the module docstring's table). ``bool(hooks)`` is False
    while none is registered (the step then skips every call)."""

    def __init__(self) -> None:
        self._fns: dict[str, list[Callable]] = {e: [] for e in EVENTS}

    def register(self, event: str, fn: Callable) -> _Handle:
        """Add ``fn`` for ``event``; returns a handle whose ``remove()`` takes it out. ValueError for an
        unknown event."""
        if event not in self._fns:
            raise ValueError(f"event={event!r} is not a trainer hook event; one of {EVENTS}")
        self._fns[event].append(fn)
        return _Handle(self._fns[event], fn)

    def __bool__(self) -> bool:
        return any(self._fns.values())

    def fire(self, event: str, *args: Any) -> None:
        """Call every hook of ``event`` with ``args``."""
        for fn in list(self._fns[event]):
            fn(*args)

    def pipe(self, event: str, value: Any, *args: Any) -> Any:
        """Thread ``value`` through the hooks of ``event``: ``value = fn(value, *args)``."""
        for fn in list(self._fns[event]):
            value = fn(value, *args)
        return value

    def first(self, event: str, *args: Any) -> Any:
        """The first result of ``event``'s hooks that is not None (None if there is none)."""
        for fn in list(self._fns[event]):
            out = fn(*args)
            if out is not None:
                return out
        return None


__all__ = ["EVENTS", "Hooks"]
