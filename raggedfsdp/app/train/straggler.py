"""Straggler attribution: which rank is slow, and where in the step.

A collective hides a straggler: every rank waits in it for the slowest, so each rank's step time is
the same. What differs is how long each rank took to *reach* each collective. So every rank records,
per step, its own time between the step's collectives, as segments that end where the rank reaches
a collective and restart where it leaves it (the time it spent waiting for the others is in no
segment):

- ``forward`` of unit U: from the step's start (the first unit) or from leaving the previous unit's
  all-gather, to reaching U's forward all-gather (a forward pre-hook before the unit's own; "left" is
  a pre-hook after it);
- ``backward`` of unit U: to reaching U's backward all-gather (a gradient hook on U's forward outputs,
  registered before FSDP's pre-backward hook; "left" is one registered after it);
- ``post-backward`` of unit U: from leaving U's backward all-gather to reaching U's post-backward
  (its reduce-scatter's launch, where older reduce-scatters are waited): an identity autograd function
  on U's inputs, applied after FSDP's pre-forward so that its backward runs before FSDP's
  post-backward ("left": one applied before FSDP's, whose backward runs after it);
- ``reduce``: from the end of ``loss.backward()`` to the step's gradient all-reduce (the end of the
  backward, the root's reduce-scatter and FSDP's final callback waiting the reduce-scatters, counts
  as a collective);
- ``optimizer``: from that all-reduce to the end of the step (clipping, the optimizer step);
- ``stalled``: the time this process did not run (stopped, paused: :class:`StallClock`) while inside
  a collective. A rank stopped there holds the others up (its gloo threads stop too) although it had
  reached the collective in time, so that time is its own as well.

So a rank that is slow or frozen anywhere in its step (forward, backward, optimizer or a collective)
shows as own time that the others do not have. Only each unit's first forward and backward of a step
count (micro-batches after the first, activation-checkpoint recomputes and eval forwards fall in the
enclosing segment, or in none).

The sums since the last log step travel in the log step's existing MAX all-reduce (the peak-memory
one; each rank fills only its row of a ``(world, segments)`` block, so MAX is a gather): no collective
is added to any step. Rank 0 then names the rank whose own time per step (the sum of its segments)
lags the median of the other ranks' the most, and the segment where it lags most:
``slowest rank 1: +380 % own time per step (...), most before the backward all-gather of layers.3``,
when the lag passes :data:`REPORT_PCT` and :data:`REPORT_MIN_S` (:func:`named`).

The times are host clock times (``time.perf_counter``, no device sync): on CPU/gloo the collective
waits block the host, so they cover all of a rank's work; on CUDA the wait is a stream wait, so they
show a host-side straggler (data loading, Python, a host sync, a frozen process) but not a slow GPU,
which only appears where the host blocks on it. Single-device reference: :func:`attribute` on a plain
``(world, segments)`` array (unit-tested).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time

import torch
from torch.distributed.fsdp import FSDPModule

from raggedfsdp.fsdp import eager_hook

# name the slowest rank when its own time per step exceeds the others' median by this % and this many
# seconds (the attribution is always recorded): above the noise of ranks sharing busy cores (+31 %,
# 14 ms/step seen in a healthy 3-rank CPU run), far below a frozen or slowed rank (+100s of %)
REPORT_PCT = 50.0
REPORT_MIN_S = 0.02

PHASES = ("forward", "backward", "post-backward", "reduce", "optimizer", "stalled")


class StallClock:
    """Seconds this process did not run (stopped, paused): a daemon thread ticks every ``tick`` s, and
    a tick that comes more than ``slack`` s late adds its lateness. ``slack`` is above what CPU
    contention alone gives a waiting process (ticks up to 0.5 s late were counted at load 26 on 2
    cores with a 0.05 s slack, blaming a rank that only waited), far below a stopped rank's gap.
    :meth:`stalled` includes the stall in progress, so a thread that runs first after a ``SIGCONT``
    sees it. Local."""

    def __init__(self, tick: float = 0.02, slack: float = 0.25) -> None:
        self.tick, self.slack = tick, slack
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._total = 0.0
        self._last = time.perf_counter()
        self._at_exit = False

    def _late(self, now: float) -> float:
        late = now - self._last - self.tick
        return late if late > self.slack else 0.0

    def stalled(self) -> float:
        """Total seconds stalled since :meth:`start` (monotonic)."""
        with self._lock:
            return self._total + self._late(time.perf_counter())

    def _run(self) -> None:
        while not self._done.wait(self.tick):
            with self._lock:
                now = time.perf_counter()
                self._total += self._late(now)
                self._last = now

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._last = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="raggedfsdp-stall-clock", daemon=True)
            self._thread.start()
            if not self._at_exit:  # joined before the interpreter finalizes, whatever path ends the run
                atexit.register(self.stop)
                self._at_exit = True

    def stop(self) -> None:
        """Stop and join the thread (idempotent; :meth:`start` may start it again)."""
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None
            self._done.clear()


def _lag(vals: list[float], r: int) -> tuple[float, float]:
    """(``vals[r]`` minus the median of the others, that median)."""
    others = sorted(v for i, v in enumerate(vals) if i != r)
    k = len(others)
    median = others[k // 2] if k % 2 else 0.5 * (others[k // 2 - 1] + others[k // 2])
    return vals[r] - median, median


def _pct(excess: float, median: float) -> float:
    return 100.0 * excess / median if median > 0 else float("inf")


def attribute(per_rank: list[list[float]], segments: list[tuple[str, str]], steps: int) -> dict | None:
    """``per_rank[r][s]``: rank ``r``'s summed own time (s) over ``steps`` steps in segment
    ``segments[s] = (phase, unit)``. The slowest rank is the one whose own time per step (summed over
    the segments) most exceeds the median of the other ranks' (``own_excess_s`` over ``own_median_s``,
    ``own_excess_pct``); ``phase`` / ``unit`` name the segment where that rank's excess over the median
    of the others is largest (``excess_s`` over ``median_s``, ``excess_pct``: that segment, per step).
    Returns ``{"rank", "phase", "unit", "excess_pct", "excess_s", "median_s", "own_excess_pct",
    "own_excess_s", "own_median_s"}``, or None for one rank / no segment / no steps."""
    world = len(per_rank)
    if world < 2 or not segments or steps <= 0:
        return None
    totals = [sum(row) / steps for row in per_rank]
    slow = max(range(world), key=lambda r: totals[r])
    own, own_median = _lag(totals, slow)
    cols = [[per_rank[r][s] / steps for r in range(world)] for s in range(len(segments))]
    seg = max(range(len(segments)), key=lambda s: _lag(cols[s], slow)[0])
    excess, median = _lag(cols[seg], slow)
    phase, unit = segments[seg]
    return {
        "rank": slow, "phase": phase, "unit": unit,
        "excess_pct": _pct(excess, median), "excess_s": excess, "median_s": median,
        "own_excess_pct": _pct(own, own_median), "own_excess_s": own, "own_median_s": own_median,
    }  # fmt: skip


def where(phase: str, unit: str) -> str:
    """The words for a segment: ``before all-gather of layers.3``, ``before the gradient all-reduce``."""
    return {
        "forward": f"before all-gather of {unit}",
        "backward": f"before the backward all-gather of {unit}",
        "post-backward": f"before the reduce-scatter of {unit}",
        "reduce": "before the gradient all-reduce",
        "optimizer": "in the optimizer step",
        "stalled": "stopped inside collectives (the process did not run: SIGSTOP, a paused VM, swapping)",
    }[phase]


def describe(rep: dict) -> str:
    def pct(v: float) -> str:
        return "inf" if v == float("inf") else f"{v:.0f}"

    ms = {k: f"{1e3 * rep[k]:.1f}" for k in ("own_excess_s", "own_median_s", "excess_s", "median_s")}
    return (
        f"slowest rank {rep['rank']}: +{pct(rep['own_excess_pct'])} % own time per step "
        f"({ms['own_excess_s']} ms/step over the others' median {ms['own_median_s']} ms), most "
        f"{where(rep['phase'], rep['unit'])} (+{pct(rep['excess_pct'])} %, {ms['excess_s']} ms/step over "
        f"{ms['median_s']} ms)"
    )


def named(rep: dict | None) -> bool:
    """Whether the report names a straggler (the console line): its own time per step exceeds the
    others' median by ``REPORT_PCT`` % and ``REPORT_MIN_S`` s, outside the run's first step (its
    window holds the lazy initialisation, whose cost differs by rank: recorded, never named)."""
    if rep is None or rep.get("warmup"):
        return False
    return rep["own_excess_pct"] >= REPORT_PCT and rep["own_excess_s"] >= REPORT_MIN_S


class _Mark(torch.autograd.Function):
    """Identity on tensors; calls ``fn()`` when their gradients arrive (as FSDP's post-backward)."""

    @staticmethod
    def forward(ctx, fn, *xs):
        ctx.fn = fn
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


def _mark_inputs(args: tuple, fn) -> tuple | None:
    """``args`` with its positional tensors that require grad passed through :class:`_Mark` (None:
    none does, nothing to wrap)."""
    idx = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not idx:
        return None
    outs = _Mark.apply(fn, *(args[k] for k in idx))
    new = list(args)
    for k, o in zip(idx, outs):
        new[k] = o
    return tuple(new)


def _grad_tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _grad_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _grad_tensors(o)]
    return []


class StragglerProbe:
    """Per-rank own time between the collectives of each step (the module docstring's segments) for
    the FSDP units of ``model`` (``torch.distributed.fsdp.FSDPModule``: raggedfsdp's and torch's).
    The trainer calls :meth:`start_step` at each step's start, :meth:`grad_reduce` around the step's
    gradient all-reduce and :meth:`end_step` after the optimizer step. Local."""

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
                left = eager_hook(self._left_forward(i))
                self._hooks.append(m.register_forward_pre_hook(left))  # after FSDP's
                # backward: gradient hooks on the outputs, before and after FSDP's pre-backward hook
                self._hooks.append(m.register_forward_hook(eager_hook(self._arm_backward(i)), prepend=True))
                self._hooks.append(m.register_forward_hook(eager_hook(self._arm_left(i))))
        n = len(self.units)
        self.segments = [(phase, u) for phase in ("forward", "backward", "post-backward") for u in self.units]
        self.segments += [("reduce", ""), ("optimizer", ""), ("stalled", "")]
        self._reduce, self._optim, self._stalled = 3 * n, 3 * n + 1, 3 * n + 2
        self._ticker = StallClock()
        self._stall_from: float | None = None
        self._stall_at_left = 0.0
        self.sums = [0.0] * len(self.segments)
        self.steps = 0
        self._last: float | None = None  # None: not inside a step
        self._seen: set[int] = set()  # segments closed this step
        self._armed: dict[int, list[torch.Tensor]] = {}
        self._post_armed: set[int] = set()
        self._warmup = True  # the first report's window holds the run's first step

    def _close(self, seg: int) -> None:
        if self._last is None:
            return
        self._stall_from = self._ticker.stalled()  # a collective follows: see _left
        if seg in self._seen:
            return
        now = time.perf_counter()
        self.sums[seg] += now - self._last
        self._last = now
        self._seen.add(seg)

    def _reached(self, i: int):
        """Before FSDP's pre-forward: closes ``forward`` U; wraps the inputs so that their gradient, after
        FSDP's post-backward (its reduce-scatter launched, older ones waited), restarts the clock."""

        def hook(_module, args):
            first = self._last is not None and i not in self._seen
            self._close(i)
            if first and torch.is_grad_enabled():
                return _mark_inputs(args, self._left)
            return None

        return hook

    def _left_forward(self, i: int):
        """After FSDP's pre-forward (its all-gather waited): restarts the clock; wraps the inputs (as FSDP
        wrapped them) so that their gradient closes ``post-backward`` U before FSDP's post-backward."""
        seg = lambda: 2 * len(self.units) + i  # noqa: E731 (the units are all known when it runs)

        def hook(_module, args):
            armed = self._last is not None and i not in self._post_armed
            self._left()
            if armed and torch.is_grad_enabled():
                self._post_armed.add(i)
                return _mark_inputs(args, lambda: self._close(seg()))
            return None

        return hook

    def _left(self, *_args) -> None:
        """After FSDP's own pre-forward / pre-backward (its all-gather waited): what follows is this
        rank's work."""
        if self._last is not None:
            if self._stall_from is not None:  # stopped while inside the collective: it held the others up
                self.sums[self._stalled] += self._ticker.stalled() - self._stall_from
                self._stall_from = None
            self._last = time.perf_counter()
            self._stall_at_left = self._ticker.stalled()

    def _arm_backward(self, i: int):
        def hook(_module, _args, out):
            seg = len(self.units) + i  # the units are all known by then (not while __init__ lists them)
            if self._last is None or seg in self._seen or i in self._armed or not torch.is_grad_enabled():
                return
            ts = _grad_tensors(out)
            self._armed[i] = ts
            for t in ts:
                t.register_hook(lambda _g: self._close(seg))

        return hook

    def _arm_left(self, i: int):
        def hook(_module, _args, _out):
            for t in self._armed.get(i) or ():
                t.register_hook(self._left)
            if i in self._armed:
                self._armed[i] = []  # armed for this step; the tensors are the autograd graph's

        return hook

    def start_step(self) -> None:
        self._ticker.start()
        self._stall_from = None
        self._last = time.perf_counter()
        self._stall_at_left = self._ticker.stalled()
        self._seen.clear()
        self._armed.clear()
        self._post_armed.clear()
        self.steps += 1

    def after_backward(self) -> None:
        """After ``loss.backward()``: the time since the last mark (the end of the backward: the root's
        reduce-scatter, FSDP's final callback waiting every reduce-scatter) counts as a collective
        (only the time this process was stopped in it counts)."""
        if self._last is not None:
            self._stall_from = self._stall_at_left
            self._left()

    @contextlib.contextmanager
    def grad_reduce(self):
        """Context manager around the step's gradient all-reduce: closes the ``reduce`` segment on
        entry, restarts the clock on exit."""
        self._close(self._reduce)
        try:
            yield
        finally:
            self._left()

    def pause(self) -> None:
        """Stop the stall clock's thread (joined) until the next :meth:`start_step`."""
        self._ticker.stop()

    def end_step(self) -> None:
        """After the optimizer step: closes the ``optimizer`` segment; nothing counts until the next
        :meth:`start_step` (logging, evaluation and saves have collectives of their own)."""
        self._close(self._optim)
        self._last = None
        self._armed.clear()

    def row(self) -> list[float]:
        """This rank's row of the ``(world, segments)`` block, zeros elsewhere (for a MAX all-reduce)."""
        n = len(self.segments)
        out = [0.0] * (self.world_size * n)
        out[self.rank * n : (self.rank + 1) * n] = self.sums
        return out

    def report(self, block: list[float]) -> dict | None:
        """From the all-reduced block (``world * segments`` values): the attribution since the last log
        step (:func:`attribute`), then start counting afresh."""
        n = len(self.segments)
        per_rank = [block[r * n : (r + 1) * n] for r in range(self.world_size)]
        rep = attribute(per_rank, self.segments, self.steps)
        if rep is not None and self._warmup:
            rep["warmup"] = True
        self.sums, self.steps, self._warmup = [0.0] * n, 0, False
        return rep

    def remove(self) -> None:
        """Remove the hooks and stop the stall clock's thread (joined)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._ticker.stop()


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


__all__ = [
    "PHASES", "REPORT_MIN_S", "REPORT_PCT", "StragglerProbe", "attribute", "describe", "inject_slow_rank",
    "named", "where",
]  # fmt: skip
