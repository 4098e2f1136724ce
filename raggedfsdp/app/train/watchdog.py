"""Interrupts, parent death and hung ranks: what keeps one stuck or signalled rank from losing work or
holding the job for the whole process-group timeout.

**Interrupts** (:class:`Interrupts`): SIGINT, SIGTERM and SIGHUP set a flag; the trainer folds the
flag into its per-step fused all-reduce (``guard.StepGuard``), so every rank sees the same signal at
the same step boundary, saves a checkpoint if ``checkpoint.on_interrupt`` (and checkpointing is on),
prints one line and exits ``128 + signum`` (130, 143, 129). torchrun starts each rank in its own
session, so a Ctrl-C reaches the launcher, which forwards it to every rank. A rank that has had a
signal pending for ``GRACE_S`` and makes no progress (no mark for ``max(GRACE_S, 3 x`` the typical
time between marks), e.g. it is stuck, or waits in a collective for a peer that is gone) exits at
once with ``128 + signum``, abandoning the step; a rank inside a checkpoint save is never cut off
(torchrun's SIGKILL after 30 s is the last resort).

**Parent death**: each rank asks the kernel for SIGTERM when its launcher dies
(``prctl(PR_SET_PDEATHSIG)``, Linux); the watchdog thread also polls the parent pid (other systems,
and a parent that died before the ``prctl``). A rank whose launcher is gone exits within
its next step boundary, or after ``GRACE_S`` when it cannot get there: no orphans.

**Hangs** (:class:`Watchdog`): the trainer marks progress (every micro-step, eval batch, checkpoint
save) with a step and a phase (``train``, ``eval``, ``save``) once its step loop begins (start-up and
checkpoint loads are not watched). Saves are watched too (:meth:`Watchdog.watching`), with the longest
limit that still names the hung rank before a waiting peer's collective times out (``0.6 x
job.pg_timeout_s``), since a save makes no marks while DCP writes; DCP's file writing
(``torch/distributed/checkpoint/filesystem.py``) is this rank's own work, not a collective. A thread checks
every ``interval_s``: if there was no progress for ``timeout_s``
(``Watchdog.effective_timeout``: at most ``job.hang_timeout_s``, at most ``max(30 s, 20 x`` the slowest
recent step``)`` once steps were seen, and always ``0.6 x job.pg_timeout_s`` or less, so that the hung
rank fires before a waiting peer's collective times out; time during which torch.compile was seen
compiling on the main thread counts as progress, and one compile may last :func:`compile_timeout`,
since a first compiling step takes a minute on a small CPU box) and
this rank's main thread is *not* inside a
collective (its innermost
Python frame is not in ``torch/distributed`` or ``raggedfsdp/fsdp|buffer``), this rank is the hung
one: it prints its main thread's Python stack and one line naming itself, the step and the frame,
records the error for torchrun and exits 1. Its peers, which wait in a collective, are not blamed;
torchrun stops them. Each rank also publishes a heartbeat in the job's TCPStore, so a rank that
waits in a collective while a peer's heartbeat has stopped (a frozen process: SIGSTOP, a C call
holding the GIL) names that peer. A job paused as a whole (a suspended batch job or VM: SIGSTOP of every
rank, then SIGCONT) is not a hang: each rank's thread sees the gap between two of its own ticks and
neither counts it as idle time nor judges its peers' (equally old) heartbeats until they had time to
beat again (:meth:`Watchdog._was_stopped`). A rank waiting in a collective while every peer also waits (a
mismatched collective) is left to the process-group timeout. Source of the idea: torch's NCCL
watchdog / flight recorder (``TORCH_NCCL_ENABLE_MONITORING``), which names the rank that never
issued a collective.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback

__all__ = [
    "GRACE_S", "HangError", "Interrupted", "Interrupts", "NoWatchdog", "Watchdog", "in_collective", "set_parent_death_signal",
]  # fmt: skip

GRACE_S = 2.0
MIN_HANG_S = 30.0  # the adaptive hang timeout: max(MIN_HANG_S, STEP_FACTOR x the slowest recent step)
STEP_FACTOR = 20.0
PG_FRACTION = 0.6  # the hang timeout never exceeds this fraction of the process-group timeout
PAUSE_S = 5.0  # a gap this long (at least 10 intervals) between two watchdog ticks: this process was stopped
_LOCAL_IO_PATHS = (
    os.path.join("torch", "distributed", "checkpoint", "filesystem.py"),
)  # not waiting on peers
# torch.compile's compiler on the main thread's stack (not the compiled code running): dynamo's frame
# conversion (forward graphs) and inductor's compile_fx (AOT autograd compiles the backward lazily, at
# the first backward); a first compiling step takes 47-60 s on 2 CPU cores
_COMPILE_PATHS = (
    os.path.join("torch", "_dynamo", "convert_frame.py"),
    os.path.join("torch", "_inductor", "compile_fx.py"),
)
_COLLECTIVE_PATHS = (
    os.path.join("torch", "distributed") + os.sep,
    os.path.join("raggedfsdp", "fsdp") + os.sep,
    os.path.join("raggedfsdp", "buffer") + os.sep,
)


class HangError(RuntimeError):
    """A rank made no progress for ``job.hang_timeout_s`` outside a collective."""


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return False


def in_collective(frame) -> bool:
    """True if the innermost Python frame is communication code (the thread waits on peers); DCP's
    file writes (``_LOCAL_IO_PATHS``) are not."""
    if frame is None:
        return False
    path = frame.f_code.co_filename
    return any(p in path for p in _COLLECTIVE_PATHS) and not any(p in path for p in _LOCAL_IO_PATHS)


def compiling(frame, depth: int = 2000) -> bool:
    """True if torch.compile is compiling on this stack (a frame of ``_COMPILE_PATHS`` among the
    innermost ``depth``; a compile's stack is ~100 frames deep): long legitimate work without progress
    marks, not a hang. The watchdog checks it at every tick and counts the time it saw a compile as
    progress: the gaps between compiles (the forward's graph is compiled, runs, then the backward's is
    compiled) are short, but come after a long time without marks."""
    while frame is not None and depth > 0:
        path = frame.f_code.co_filename
        if any(p in path for p in _COMPILE_PATHS):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def compile_timeout(timeout_s: float, pg_timeout_s: float) -> float:
    """The hang limit while compiling: ``job.pg_timeout_s`` (a peer that finished compiling first waits
    in a collective for at most that long), never less than ``job.hang_timeout_s``; 0 when off."""
    return 0.0 if timeout_s <= 0 else max(timeout_s, pg_timeout_s)


def _where(frame) -> str:
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class Interrupted(Exception):
    """Raised on every rank at the step boundary after a SIGINT/SIGTERM/SIGHUP (exit 128 + signum)."""

    def __init__(self, signum: int, message: str, ranks=()) -> None:
        super().__init__(message)
        self.signum = signum
        self.culprits = tuple(sorted(int(r) for r in ranks))  # the ranks that got the signal


class NoWatchdog:
    """The trainer's stand-in when no ``Watchdog`` is given (no hang detection)."""

    step = 0

    def arm(self) -> None:
        pass

    def progress(self, where: str, step: int | None = None, phase: str | None = None) -> None:
        pass

    def paused(self, where: str):
        return contextlib.nullcontext()

    def watching(self, phase: str, where: str):
        return contextlib.nullcontext()


class Interrupts:
    """SIGINT/SIGTERM/SIGHUP -> ``self.signum`` (the first one), read at step boundaries."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, tag: str, *, announce: bool) -> None:
        self.tag, self.announce = tag, announce
        self.signum = 0
        self.at = 0.0

    def install(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        """Back to the default actions (a failing rank: a launcher's SIGTERM should end it now)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)

    def _handler(self, signum, frame) -> None:
        if self.signum == 0:
            self.signum, self.at = signum, time.monotonic()
            if self.announce:
                print(
                    f"{self.tag} got {signal.Signals(signum).name}: stopping at the next step boundary",
                    file=sys.stderr,
                    flush=True,
                )
        elif time.monotonic() - self.at > GRACE_S:  # asked again: give up on the clean stop
            print(
                f"{self.tag} got {signal.Signals(signum).name} again: exiting now",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)


class Watchdog:
    """Background hang detector + heartbeat + parent-death poll (see the module docstring)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        tag: str,
        timeout_s: float,
        interrupts: Interrupts | None = None,
        store=None,
        interval_s: float = 0.5,
        pg_timeout_s: float = 0.0,
    ) -> None:
        self.rank, self.world_size, self.tag = rank, world_size, tag
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.pg_timeout_s = pg_timeout_s  # 0: unknown (no cap)
        self._steps: list[float] = []  # durations of the recent steps (start to next start), newest last
        self._step_start: float | None = None
        self.interrupts = interrupts
        self.store = store
        self.parent = os.getppid()
        self.where = "start-up"
        self.phase = "start-up"
        self.step = 0
        self._last = time.monotonic()
        self._paused = 1  # start-up (corpus, model init, checkpoint load) is not watched: arm()
        self._gap = 0.0
        self._tick_at: tuple[float, float] | None = None  # (monotonic, wall) of the previous tick
        self._compiled_at = -float("inf")  # monotonic time a tick last saw torch.compile compiling
        self._compile_since: float | None = None  # when the compile seen at the last tick began
        self._resumed_at = -float("inf")  # monotonic time of the end of the last stop of this process
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="raggedfsdp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def progress(self, where: str, step: int | None = None, phase: str | None = None) -> None:
        """Called by the trainer's main thread whenever it gets on (cheap: a few assignments);
        ``phase``: ``train``, ``eval``, ... (None: unchanged), named in a hang report."""
        now = time.monotonic()
        if not self._paused and self.phase != "save":  # typical time between marks
            self._gap = 0.8 * self._gap + 0.2 * (now - self._last)
        self._last = now
        self.where = where
        if phase is not None:
            self.phase = phase
        if step is not None:
            if step != self.step:  # a new step began: the previous one's duration (with eval, saves)
                if self._step_start is not None:
                    self._steps = [*self._steps[-19:], now - self._step_start]
                self._step_start = now
            self.step = step

    def effective_timeout(self, phase: str | None = None) -> tuple[float, str]:
        """``(seconds, why)``: the hang timeout now. ``job.hang_timeout_s`` is the most; once steps
        were seen, at most ``max(MIN_HANG_S, STEP_FACTOR x`` the slowest of the last 20``)``; and always
        below the process-group timeout (``PG_FRACTION x job.pg_timeout_s``), so that the hung rank is
        named before a waiting peer's collective times out and gets the blame."""
        t, why = self.timeout_s, f"job.hang_timeout_s={self.timeout_s:g}"
        if t <= 0:
            return 0.0, "off"
        if (
            phase or self.phase
        ) == "save" and self.pg_timeout_s > 0:  # no marks while DCP writes: the longest safe limit
            return (
                PG_FRACTION * self.pg_timeout_s,
                f"in a save: {PG_FRACTION:g} x job.pg_timeout_s={self.pg_timeout_s:g}",
            )
        if self._steps:
            adaptive = max(MIN_HANG_S, STEP_FACTOR * max(self._steps))
            if adaptive < t:
                slow = max(self._steps)
                t, why = (
                    adaptive,
                    f"{STEP_FACTOR:g} x the slowest recent step {slow:.2f}s, at least {MIN_HANG_S:g}s",
                )
        if self.pg_timeout_s > 0 and PG_FRACTION * self.pg_timeout_s < t:
            t, why = (
                PG_FRACTION * self.pg_timeout_s,
                f"{PG_FRACTION:g} x job.pg_timeout_s={self.pg_timeout_s:g}",
            )
        return t, why

    def arm(self) -> None:
        """Start hang detection (the trainer calls it when its step loop begins)."""
        self.progress("training loop")
        self._paused = max(0, self._paused - 1)

    @contextlib.contextmanager
    def watching(self, phase: str, where: str):
        """Hang detection inside a long phase without marks (a checkpoint save: ``phase="save"``),
        with that phase's limit (:meth:`effective_timeout`); a pending signal never cuts it off."""
        before = self.phase
        self.progress(where, phase=phase)
        try:
            yield
        finally:
            self.progress(f"after {where}", phase=before)

    @contextlib.contextmanager
    def paused(self, where: str):
        """No hang detection inside (long legitimate work on some ranks: checkpoint I/O, hashing)."""
        self.progress(where)
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.progress(f"after {where}")

    # -- the thread ------------------------------------------------------------------------------

    def _main_frame(self):
        return sys._current_frames().get(self._main)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 (the watchdog must never kill a healthy job)
                print(f"{self.tag} watchdog: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def launcher_gone(self) -> bool:
        """True once this process's parent (torchrun's agent, which hosts the job's store) has died."""
        return os.getppid() != self.parent

    def _was_stopped(self, now: float, wall: float) -> bool:
        """True on the first tick after this whole process was stopped: a paused batch
        job or VM (SIGSTOP of the process group, then SIGCONT) is not a hang. The thread ticks every
        ``interval_s``, so a gap of ``PAUSE_S`` (and at least 10 intervals) between two ticks, by the
        monotonic or the wall clock (a suspended VM may stop one of them), means nothing of this process
        ran: the gap is not counted as idle time, and peers' heartbeats are not judged for as long again
        (:meth:`_frozen_peer`: all ranks resume together and publish fresh ones within an interval).
        A peer stopped alone still is named: its own thread cannot tick, the others see no gap."""
        prev, self._tick_at = self._tick_at, (now, wall)
        if prev is None:
            return False
        gap = max(now - prev[0], wall - prev[1])
        if gap < max(PAUSE_S, 10 * self.interval_s):
            return False
        self._last += max(0.0, now - prev[0])  # the stopped time is not idle time
        self._resumed_at = now
        print(
            f"{self.tag} watchdog: this process did not run for {gap:.1f}s (the job was paused or "
            "suspended?); not counted as a hang",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _tick(self) -> None:
        now = time.monotonic()
        if self._was_stopped(now, time.time()):
            return
        frame = self._main_frame()
        comp = compiling(frame)  # torch.compile's compiler at work: progress, not a hang
        if comp:  # a new compile unless the last tick saw this one and no mark came since it began
            seen = now - self._compiled_at <= 2 * self.interval_s + 0.5
            if self._compile_since is None or not seen or self._last > self._compile_since:
                self._compile_since = now
            self._compiled_at = now
        waiting = in_collective(frame) and not comp
        if self.launcher_gone():
            self.store = None  # its store died with it: no heartbeat (a store call prints a C++ stack)
            if self.interrupts is not None and self.interrupts.signum == 0:
                self.interrupts._handler(signal.SIGTERM, None)  # launcher gone, no PDEATHSIG seen
        ints = self.interrupts
        idle = now - max(self._last, self._compiled_at)  # time compiling is not idle time
        pending = ints is not None and ints.signum and not self._paused and now - ints.at > GRACE_S
        pending = pending and self.phase != "save"  # a save is never cut off (see Interrupts)
        if pending and idle > max(GRACE_S, 3 * self._gap):  # not getting on to the step boundary
            name = signal.Signals(ints.signum).name
            state = "waiting in a collective (a peer is gone?)" if waiting else "stuck"
            print(
                f"{self.tag} {name}: no progress for {idle:.1f}s, {state} at {_where(frame)}: "
                "exiting without a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + ints.signum)
        if self.store is not None:
            beat = {
                "t": time.time(),
                "step": self.step,
                "where": self.where,
                "phase": self.phase,
                "waiting": waiting,
                "idle": idle,
            }
            try:
                self.store.set(f"hb{self.rank}", json.dumps(beat))
            except Exception:  # noqa: BLE001 (the launcher's store is gone: no more heartbeats)
                self.store = None
        limit, why = self.effective_timeout()
        if comp and limit > 0 and not self._paused:  # one compile may take its own, longer, limit
            limit = compile_timeout(self.timeout_s, self.pg_timeout_s)
            why = f"compiling (torch.compile): job.pg_timeout_s={self.pg_timeout_s:g}, at least {why}"
            idle = now - self._compile_since
        if limit <= 0 or self._paused:
            return
        if waiting:  # judge the peers by their heartbeats: the limit outside a save (see _frozen_peer)
            if idle < min(limit, self.effective_timeout("train")[0]):
                return
        elif idle < limit:
            return
        if not waiting:
            self._fail(
                self.rank,
                f"rank {self.rank} made no progress for {idle:.1f}s (hang timeout {limit:g}s: {why}) "
                f"at step {self.step}, phase: {self.phase} (last: {self.where}); its main thread is at "
                f"{_where(frame)}, not in a collective, so the other ranks are waiting for it",
                frame,
            )
        frozen = self._frozen_peer() if self.store is not None else None
        if frozen is not None:
            r, age, beat = frozen
            self._fail(
                r,
                f"rank {r} stopped responding: no heartbeat for {age:.1f}s (last at step {beat.get('step')}, "
                f"phase: {beat.get('phase', '?')}, {beat.get('where')}); rank {self.rank} has waited "
                f"{idle:.1f}s in a collective at {_where(frame)} (its step {self.step}, phase: {self.phase})",
                None,
            )

    def _frozen_peer(self):
        if time.monotonic() - self._resumed_at < max(PAUSE_S, 10 * self.interval_s):
            return None  # just resumed from a stop: the peers' heartbeats are as old as the stop
        now = time.time()
        for r in range(self.world_size):
            if r == self.rank or not self.store.check([f"hb{r}"]):
                continue
            beat = json.loads(self.store.get(f"hb{r}"))
            age = now - beat["t"]
            # a peer's heartbeat comes from its watchdog thread, which ticks through a long save too:
            # none for the limit outside a save means its process stopped (a rank
            # frozen in a save was judged by the save's longer limit, 0.6 x pg_timeout_s)
            if age > max(self.effective_timeout("train")[0], 4 * self.interval_s):
                return r, age, beat
        return None

    def _fail(self, culprit: int, message: str, frame) -> None:
        from raggedfsdp.app.launch.failures import REPORTED_ENV, record_failure

        if frame is not None:
            stack = "".join(traceback.format_stack(frame)).rstrip("\n").splitlines()
            print(
                "\n".join(f"{self.tag} {line}" for line in ["main thread's Python stack:", *stack]),
                file=sys.stderr,
            )
        err = HangError(message)
        if os.environ.get(REPORTED_ENV) != "1":  # else the launcher prints it, last
            print(f"{self.tag} error: HangError: {message}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        with contextlib.suppress(Exception):
            record_failure(err, (culprit,))
        os._exit(1)


def heartbeat_store():
    """A client of the job's TCPStore (torchrun's), namespaced per run; None without torchrun."""
    if "MASTER_ADDR" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import datetime

    import torch.distributed as dist

    try:
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=30),
        )
    except Exception:  # noqa: BLE001 (heartbeats are an extra; hang detection still works)
        return None
    run = os.environ["TORCHELASTIC_RUN_ID"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"raggedfsdp/hb/{run}/{restart}/", base)
