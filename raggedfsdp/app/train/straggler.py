"""Straggler attribution: which rank is slow, and before which FSDP unit's all-gather.

A collective hides a straggler: every rank waits in it for the slowest, so each rank's step time is
the same. What differs is how long each rank took to *reach* the collective. So every rank records,
per step, the time from the step's start to the forward of each FSDP unit (a forward pre-hook that
runs before the unit's own, i.e. before its all-gather is waited), as increments: the time since the
previous unit's all-gather was waited (a second pre-hook, after the unit's own), or since the step
began for the first. Ranks leave each collective together, so the increment is that rank's own work
(and delays) between two collectives, without the time it spent waiting for the others.

The sums since the last log step travel in the log step's existing MAX all-reduce (the peak-memory
one; each rank fills only its row of a ``(world, units)`` block, so MAX is a gather): no collective is
added to any step. Rank 0 then names, for the unit with the largest excess, the slowest rank and its
excess over the median of the other ranks: ``slowest rank 1: +38 % before all-gather of layers.3``.
The times are host clock times (``time.perf_counter``, no device sync): on CPU/gloo the all-gather wait
blocks the host, so they cover all of a rank's work; on CUDA the wait is a stream wait, so they show a
host-side straggler (data loading, Python, a host sync) but not a slow GPU, which only appears where
the host blocks on it. Single-device reference: :func:`attribute` on a plain ``(world, units)`` array
(unit-tested).
"""

from __future__ import annotations

import time

import torch
from torch.distributed.fsdp import FSDPModule

from raggedfsdp.fsdp import eager_hook

REPORT_PCT = 20.0  # print when the slowest rank's excess is at least this (always in metrics.jsonl)
REPORT_MIN_S = 0.005  # ... and at least this many seconds per step


def attribute(per_rank: list[list[float]], units: list[str], steps: int) -> dict | None:
    """``per_rank[r][u]``: rank ``r``'s summed time (s) over ``steps`` steps from reaching the previous
    unit (or the step's start) to reaching unit ``u``. Returns ``{"rank", "unit", "excess_pct",
    "excess_s", "median_s"}`` for the unit where the slowest rank lags the median of the others the
    most (seconds per step), or None for one rank / no unit / no steps."""
    world = len(per_rank)
    if world < 2 or not units or steps <= 0:
        return None
    best = None
    for u, name in enumerate(units):
        col = [per_rank[r][u] / steps for r in range(world)]
        slow = max(range(world), key=lambda r: col[r])
        others = sorted(col[r] for r in range(world) if r != slow)
        k = len(others)
        median = others[k // 2] if k % 2 else 0.5 * (others[k // 2 - 1] + others[k // 2])
        excess = col[slow] - median
        if best is None or excess > best["excess_s"]:
            pct = 100.0 * excess / median if median > 0 else float("inf")
            best = {"rank": slow, "unit": name, "excess_pct": pct, "excess_s": excess, "median_s": median}
    return best


def describe(rep: dict) -> str:
    pct = "inf" if rep["excess_pct"] == float("inf") else f"{rep['excess_pct']:.0f}"
    return (
        f"slowest rank {rep['rank']}: +{pct} % before all-gather of {rep['unit']} "
        f"({1e3 * rep['excess_s']:.1f} ms/step over the others' median {1e3 * rep['median_s']:.1f} ms)"
    )


class StragglerProbe:
    """Per-rank arrival times at every FSDP unit of ``model`` (``torch.distributed.fsdp.FSDPModule``:
    raggedfsdp's and torch's). The trainer calls :meth:`start_step` at each step's start and
    :meth:`stop` after its forward/backward passes; only the first forward of each unit per step
    counts (micro-batches, activation-checkpoint recomputes and eval forwards do not). Local."""

    def __init__(self, model: torch.nn.Module, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.units: list[str] = []
        self._hooks = []
        for name, m in model.named_modules():
            if isinstance(m, FSDPModule):
                i = len(self.units)
                self.units.append(name or "root")
                # host timers: eager_hook keeps them out of a compiled block's graph (--compile true)
                self._hooks.append(m.register_forward_pre_hook(eager_hook(self._reached(i)), prepend=True))
                self._hooks.append(m.register_forward_pre_hook(eager_hook(self._left)))  # after FSDP's wait
        self.sums = [0.0] * len(self.units)
        self.steps = 0
        self._last: float | None = None  # None: not inside a step's forward/backward
        self._seen: set[int] = set()

    def _reached(self, i: int):
        def hook(_module, _args):
            if self._last is None or i in self._seen:
                return
            now = time.perf_counter()
            self.sums[i] += now - self._last
            self._last = now
            self._seen.add(i)

        return hook

    def _left(self, _module, _args):
        """After the unit's own pre-forward (its all-gather waited): what follows is this rank's work."""
        if self._last is not None:
            self._last = time.perf_counter()

    def start_step(self) -> None:
        self._last = time.perf_counter()
        self._seen.clear()
        self.steps += 1

    def stop(self) -> None:
        self._last = None

    def row(self) -> list[float]:
        """This rank's row of the ``(world, units)`` block, zeros elsewhere (for a MAX all-reduce)."""
        out = [0.0] * (self.world_size * len(self.units))
        out[self.rank * len(self.units) : (self.rank + 1) * len(self.units)] = self.sums
        return out

    def report(self, block: list[float]) -> dict | None:
        """From the all-reduced block (``world * units`` values): the attribution since the last log
        step (:func:`attribute`), then start counting afresh."""
        n = len(self.units)
        per_rank = [block[r * n : (r + 1) * n] for r in range(self.world_size)]
        rep = attribute(per_rank, self.units, self.steps)
        self.sums, self.steps = [0.0] * n, 0
        return rep

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def inject_slow_rank(model: torch.nn.Module, debug, rank: int, probe: StragglerProbe) -> float:
    """``--debug.slow_rank R --debug.slow_s S [--debug.slow_unit NAME]`` (test-only fault): rank ``R``
    sleeps ``S`` seconds every training step, before unit ``NAME``'s forward (a pre-hook that runs
    before the probe's) or, without a unit, at the step's start. Returns the seconds the trainer
    sleeps at the step's start (0 when the hook does it, or on other ranks). Raises ValueError for an
    unknown unit or a negative delay."""
    if debug.slow_rank < 0:
        return 0.0
    if debug.slow_s < 0:
        raise ValueError(f"debug.slow_s={debug.slow_s} must be >= 0 (seconds of delay per step)")
    if debug.slow_unit and debug.slow_unit not in probe.units:
        raise ValueError(
            f"debug.slow_unit={debug.slow_unit!r} is not an FSDP unit of this model; one of {probe.units}"
        )
    if debug.slow_rank != rank:
        return 0.0
    if not debug.slow_unit:
        return float(debug.slow_s)
    mods = dict(model.named_modules())
    unit = mods[""] if debug.slow_unit == "root" else mods[debug.slow_unit]

    def delay(_module, _args):
        if probe._last is not None and probe.units.index(debug.slow_unit) not in probe._seen:
            time.sleep(debug.slow_s)

    probe._hooks.append(unit.register_forward_pre_hook(eager_hook(delay), prepend=True))  # before the probe's
    return 0.0


__all__ = ["REPORT_MIN_S", "REPORT_PCT", "StragglerProbe", "attribute", "describe", "inject_slow_rank"]
