"""Learning-rate schedules as pure functions of the (1-based) optimizer step."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(
    step: int,
    *,
    lr: float,
    total_steps: int,
    warmup_steps: int,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.1,
) -> float:
    """Learning rate for optimizer step ``step`` (1..total_steps).

    Linear warmup from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps`` steps; then
    ``"constant"`` keeps ``lr`` and ``"cosine"`` decays to ``lr * min_lr_ratio`` at ``total_steps``.
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}; choose 'cosine' or 'constant'")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    min_lr = lr * min_lr_ratio
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
