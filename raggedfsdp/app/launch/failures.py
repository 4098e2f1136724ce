"""A failed job in one line: the root-cause rank and its error (every rank's report in a log file).

Used by the launchers (``raggedfsdp train``, ``bench``, ``wrap-bench``: :mod:`raggedfsdp.app.launch.launcher`)
on torchrun's ``ChildFailedError`` and by their workers (:mod:`raggedfsdp.app.launch.worker`, the bench
workers), which report their error with :func:`report_rank_failure` (torchrun's error file, plus the
ranks the error blames) and, when their launcher reports the root cause (:data:`REPORTED_ENV`), print
no one-line error of their own: a failed job ends with exactly one ``[rank R/W] error: ...`` line,
the root cause's. torchrun's own log lines (``Sending
process ... closing signal``, ``failed (exitcode: 1)``) go to ``OUT/launcher.log``
(:func:`capture_torchrun_logs`), its failure table and every rank's traceback to ``OUT/failure.log``
(:func:`write_failure_log`).
"""

from __future__ import annotations

import json
import logging
import os
import time

__all__ = [
    "ONE_LINE", "PEER_FAILURE_HINTS", "REPORTED_ENV", "STOPPED_CODES", "capture_torchrun_logs", "culprits_of",
    "failure_report", "interruption", "one_line", "record_failure", "report_rank_failure", "write_failure_log",
]  # fmt: skip

#: Set (to "1") by a launcher that prints the root cause's error line itself, for its ranks.
REPORTED_ENV = "RAGGEDFSDP_LAUNCHER_REPORTS"

# Substrings of collective errors that are consequences of a failure elsewhere.
PEER_FAILURE_HINTS = ("closed by peer", "reset by peer", "Timed out", "Broken pipe", "Connection refused")

# Errors the trainer explains in their message: one line, no traceback (still recorded for torchrun).
ONE_LINE = (
    "FaultError", "NonFiniteError", "DivergenceError", "CheckpointError", "DataError", "HangError", "ResourceError",
)  # fmt: skip


def one_line(failure) -> str:
    """A failed rank's error in one line: the exception (not its traceback), exit code or signal."""
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message") or "<N/A>"
    elif failure.exitcode < 0:
        msg = f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
        if failure.signal_name() == "SIGKILL":
            msg += ", e.g. by the out-of-memory killer"
    elif failure.exitcode in STOPPED_CODES and not has_error_file(failure):
        msg = f"stopped by {STOPPED_CODES[failure.exitcode]} (exit code {failure.exitcode})"
    elif not has_error_file(failure):
        msg = f"exited with code {failure.exitcode} without recording an error"
    return str(msg)


# Exit codes of a rank that stopped on a signal (train/watchdog.py: 128 + signum).
STOPPED_CODES = {129: "SIGHUP", 130: "SIGINT", 143: "SIGTERM"}


def _signal_of(failure) -> int:
    """The signal number a rank stopped on (its own handler's ``128 + signum`` exit, or killed by
    SIGTERM/SIGINT/SIGHUP), else 0."""
    if failure.exitcode in STOPPED_CODES:
        return failure.exitcode - 128
    if failure.exitcode < 0 and failure.signal_name() in ("SIGTERM", "SIGINT", "SIGHUP"):
        return -failure.exitcode
    return 0


def interruption(err, closed_pids=()) -> tuple[int, int] | None:
    """``(rank, signum)`` when a job (a torchrun ``ChildFailedError``) ended because a rank got a
    signal, else ``None`` (a real failure: :func:`failure_report`).

    An interruption: every failed rank either stopped on a signal (its handler's ``128 + signum``
    exit, or killed by SIGTERM/SIGINT/SIGHUP, e.g. by torchrun after the first rank ended) or
    recorded a collective error caused by a peer going away (:data:`PEER_FAILURE_HINTS`), and at
    least one stopped on a signal. Which rank got it, whatever the race between the ranks' exits and
    torchrun's SIGTERM to the rest: the ranks named by a recorded ``Interrupted``
    (:func:`record_failure` culprits: every rank knows them from the step's all-reduce), else those
    among those torchrun did not stop itself (``closed_pids``: the pids of its ``Sending process PID
    closing signal`` records, :func:`capture_torchrun_logs`; none known: every rank counts) the first
    that exited through its own handler (``128 + signum``), else the first killed by the signal. No
    such rank (every signal was torchrun's closing of the others, e.g. after a peer's collective timed
    out on a hung rank): not an interruption."""
    failures = sorted(err.failures.items(), key=lambda rf: (rf[1].timestamp, rf[0]))
    if not failures:
        return None
    for _, f in failures:
        if _signal_of(f) == 0 and not (
            isinstance(f.message, dict) and any(h in one_line(f) for h in PEER_FAILURE_HINTS)
        ):
            return None
    signalled = [(r, f) for r, f in failures if _signal_of(f)]
    if not signalled:
        return None
    named = sorted(_blamed(failures))
    if named:
        sig = next((_signal_of(f) for r, f in signalled if r in named), _signal_of(signalled[0][1]))
        return named[0], sig
    closed = set(closed_pids)
    external = [(r, f) for r, f in signalled if f.pid not in closed]
    if not external:  # every signal was torchrun's closing of the rest: a failure elsewhere (e.g. a hang)
        return None
    own = [(r, f) for r, f in external if f.exitcode in STOPPED_CODES]
    rank, f = (own or external)[0]
    return rank, _signal_of(f)


def has_error_file(failure) -> bool:
    return bool(failure.error_file) and failure.error_file != "<N/A>"


def is_consequence(failure) -> bool:
    """A rank stopped by torchrun, or one whose collective failed because a peer went away."""
    if isinstance(failure.message, dict):  # the rank recorded an exception: judge by its message
        return any(h in one_line(failure) for h in PEER_FAILURE_HINTS)
    if failure.exitcode in STOPPED_CODES:
        return True
    return failure.exitcode < 0 and failure.signal_name() in ("SIGTERM", "SIGINT")


def record_failure(e: BaseException, culprits=()) -> None:
    """Record ``e`` in torchrun's error file (``TORCHELASTIC_ERROR_FILE``; nothing without torchrun),
    with ``culprits`` (the ranks at fault, e.g. ``FaultError.culprits``) in its ``extraInfo``, so that
    the launcher names a culprit rank whichever rank exits first (:func:`failure_report`)."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(e)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not culprits or not path:
        return
    try:  # torchrun's format: {"message": {"message": ..., "extraInfo": {"py_callstack", "timestamp"}}}
        with open(path) as fh:
            data = json.load(fh)
        data["message"]["extraInfo"]["culprits"] = sorted(int(r) for r in culprits)
        with open(path + ".tmp", "w") as fh:
            json.dump(data, fh)
        os.replace(path + ".tmp", path)
    except (OSError, ValueError, KeyError, TypeError):  # another format: the timestamps decide
        pass


def culprits_of(failure) -> tuple[int, ...]:
    """The ranks a failed rank's recorded error blames (:func:`record_failure`), or ``()``."""
    msg = failure.message
    if not isinstance(msg, dict):
        return ()
    return tuple(int(r) for r in (msg.get("extraInfo") or {}).get("culprits") or ())


def _root(failures):
    """``(rank, failure, message, blamed)`` of the root cause among ``failures`` (sorted by time):
    ``failure`` is the record its message comes from (the blamed rank's own, else the one naming it)."""
    blamed = sorted(_blamed(failures))
    if blamed:  # ranks at fault named by a recorded error: the first with its own record
        own = [(r, f) for r, f in failures if r in blamed]
        recorded = [(r, f) for r, f in own if isinstance(f.message, dict)]
        if recorded:
            return recorded[0][0], recorded[0][1], one_line(recorded[0][1]), True
        rank = own[0][0] if own else blamed[0]  # stopped (or on another node) before it recorded
        naming = next(f for _, f in failures if rank in culprits_of(f))
        return rank, naming, one_line(naming), True
    rank, failure = next(((r, f) for r, f in failures if not is_consequence(f)), failures[0])
    return rank, failure, one_line(failure), False


def _blamed(failures) -> set[int]:
    return {r for _, f in failures for r in culprits_of(f)}


def failure_report(
    err, world_size: int, *, details: str | None = None, prog: str = "raggedfsdp train"
) -> tuple[str, str]:
    """``(summary, last_line)`` for a failed job (a torchrun ``ChildFailedError``).

    ``summary`` is torchrun's rank-tagged failure table with each traceback replaced by its one-line
    error (every traceback is in the ``error_file`` listed). The root cause is a rank that a recorded
    error names as at fault (:func:`record_failure`: e.g. the rank whose loss was NaN, whichever rank
    exited first), else the first failure that is not a consequence of another (a rank torchrun
    stopped, or a collective that lost its peer), so a rank that timed out in the same second as the
    real failure is not blamed. ``last_line`` names that rank and its error and is meant to be
    printed last, after ``prog:``; ``details``: where the full report is (a file), named at its end.
    """
    import copy

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failures = sorted(err.failures.items(), key=lambda rf: rf[1].timestamp)  # stable: rank order on ties
    root_rank, root, root_msg, blamed = _root(failures)
    short = {}
    for rank, failure in sorted(failures, key=lambda rf: rf[0] != root_rank):  # the root first
        f = copy.copy(failure)
        f.message = one_line(failure)
        short[rank] = f
    if root_rank in short:
        short[root_rank].timestamp = min(f.timestamp for f in short.values())  # shown as the root cause
    summary = ChildFailedError(err.name, short).format_msg()
    consequence = not blamed and is_consequence(root)
    if details is not None:
        where = f"every rank's report: {details}"
    elif isinstance(root.message, dict) and has_error_file(root):
        above = "" if consequence or root_msg.split(":")[0] in ONE_LINE else "above and "
        where = f"traceback {above}in {root.error_file}"
    else:
        where = "see its output above"
    last_line = f"{prog}: [rank {root_rank}/{world_size}] error: {root_msg} ({where})"
    if consequence:
        last_line += "; this usually means another rank failed or hung first"
    return summary, last_line


def capture_torchrun_logs(path, closed_pids: set | None = None):
    """Send torchrun's own log records (``torch.distributed.elastic.*``, ``torch.distributed.run``:
    ``Sending process N closing signal SIGTERM``, ``failed (exitcode: 1) local_rank: 1 ...``) to the
    file ``path`` (created at the first record) instead of stderr; ``closed_pids`` (a set) collects
    the pids torchrun sends its closing signal to (:func:`interruption`). Returns ``undo()``, which
    restores the loggers (a launcher called in-process, e.g. by tests, leaves nothing behind)."""
    handler = _LazyFileHandler(path, delay=True)
    if closed_pids is not None:

        def note_closed(record) -> bool:
            if str(record.msg).startswith("Sending process %s closing signal") and record.args:
                closed_pids.add(int(record.args[0]))
                _kill_if_stopped(int(record.args[0]))
            return True

        handler.addFilter(note_closed)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logs = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    before = [log.propagate for log in logs]
    for log in logs:
        log.addHandler(handler)
        log.propagate = False  # not to torch's stderr handler

    def undo() -> None:
        for log, prop in zip(logs, before):
            log.removeHandler(handler)
            log.propagate = prop
        handler.close()

    return undo


def _kill_if_stopped(pid: int) -> None:
    """SIGKILL ``pid`` if it is stopped (SIGSTOP: state ``T`` in /proc/PID/stat; Linux only).

    torchrun closes the other ranks with SIGTERM and waits 30 s before SIGKILL; a stopped rank (a
    rank frozen in a save) cannot act on SIGTERM, so the job's end waited those
    30 s. Called as torchrun logs its closing signal, i.e. once the job is already ending."""
    import signal

    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError, ValueError):
        pass


class _LazyFileHandler(logging.FileHandler):
    """A ``FileHandler`` that creates the file, and its folder, at the first record (none: nothing)."""

    def _open(self):
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()


def write_failure_log(path, err, summary: str, last_line: str) -> None:
    """Write a failed job's full report to ``path``: the last line, the rank-tagged failure table
    (``summary``) and each failed rank's exit code, error file and traceback (copied: torchrun's
    error files live in a temporary folder)."""
    parts = [time.strftime("%Y-%m-%d %H:%M:%S"), last_line, "", summary, ""]
    for rank, f in sorted(err.failures.items()):
        tb = ""
        if isinstance(f.message, dict):
            tb = (f.message.get("extraInfo") or {}).get("py_callstack") or ""
        parts += [
            f"--- rank {rank} (local rank {f.local_rank}, pid {f.pid}): exit code {f.exitcode}; "
            f"{one_line(f)}",
            f"error file: {f.error_file}",
            tb.rstrip() or "(no traceback recorded)",
            "",
        ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write("\n".join(parts))


def report_rank_failure(e: BaseException, rank: int, world_size: int, tag: str) -> int:
    """A rank's failure, as every raggedfsdp worker reports it (train, bench, wrap-bench); returns 1.

    The error (with its traceback and the ranks it blames, ``e.culprits``) goes to torchrun's error
    file (:func:`record_failure`). Under a launcher that prints the root cause's one line last
    (:data:`REPORTED_ENV`) a rank prints only the traceback of an unexpected error (lines tagged
    ``tag``); under a bare torchrun (or one process) it also prints its one-line error. An error of
    the :data:`ONE_LINE` kinds prints no traceback, nor does a collective that failed because a peer
    went away (:data:`PEER_FAILURE_HINTS`). Call it from the ``except`` block (it formats the
    exception being handled)."""
    import sys
    import traceback

    culprits = getattr(e, "culprits", ())
    if culprits and rank not in culprits:
        time.sleep(1.0)  # let a culprit rank record first (its message names its own tensors)
    record_failure(e, culprits)  # no-op without torchrun's TORCHELASTIC_ERROR_FILE
    reported = os.environ.get(REPORTED_ENV) == "1"
    peer = world_size > 1 and any(s in str(e) for s in PEER_FAILURE_HINTS)
    lines = [] if reported else [f"{tag} error: {type(e).__name__}: {e}"]
    if type(e).__name__ in ONE_LINE:
        pass
    elif peer:
        if not reported:
            lines.append(
                f"{tag} (this usually means another rank failed or hung first; see the root cause below)"
            )
    else:
        tb = traceback.format_exc().rstrip("\n").splitlines()
        lines = [f"{tag} {line}" for line in tb] + lines
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
    return 1
