"""The trainer's hook registry (``train/hooks.py``) and the step without fault taps: faults reach the
step only through hooks (``train/faults.py: install``). Reference: the calls recorded by plain
functions, and the step's source text."""

from __future__ import annotations

import inspect

import pytest

from raggedfsdp.app.train.hooks import EVENTS, Hooks


def test_fire_pipe_first_in_registration_order_and_remove():
    h, seen = Hooks(), []
    assert not h
    a = h.register("step_begin", lambda step: seen.append(("a", step)))
    h.register("step_begin", lambda step: seen.append(("b", step)))
    assert h
    h.fire("step_begin", 3)
    assert seen == [("a", 3), ("b", 3)]
    a.remove()
    a.remove()  # idempotent
    h.fire("step_begin", 4)
    assert seen[2:] == [("b", 4)]
    h.register("loss", lambda v, step, micro: v * 2)
    h.register("loss", lambda v, step, micro: v + step + micro)
    assert h.pipe("loss", 5, 1, 0) == 11  # (5 * 2) + 1 + 0, in order
    assert h.pipe("batch", ("x", "y"), 1, 0) == ("x", "y")  # no hook: unchanged
    h.register("save_writer", lambda step: None)
    h.register("save_writer", lambda step: f"w{step}")
    h.register("save_writer", lambda step: "never")
    assert h.first("save_writer", 7) == "w7" and h.first("corpus") is None


def test_unknown_event_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"event='on_step' is not a trainer hook event; one of \('corpus'"):
        Hooks().register("on_step", print)
    assert set(EVENTS) >= {"step_begin", "batch", "logits", "loss", "after_optimizer", "save_writer", "close"}


def test_the_training_step_has_no_fault_taps():
    from raggedfsdp.app.train.trainer import Trainer

    for fn in (Trainer.train_step, Trainer._batch, Trainer._save, Trainer._build):
        src = inspect.getsource(fn)
        assert "fault" not in src.lower(), f"{fn.__name__} still taps the faults:\n{src}"
