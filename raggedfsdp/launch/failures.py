"""A failed job in a few lines: each rank's error in one line and the root-cause rank.

Used by the launchers (``raggedfsdp train``, ``raggedfsdp bench``) on torchrun's ``ChildFailedError``
and by the worker (:mod:`raggedfsdp.launch.worker`), which prints its own error once.
"""

from __future__ import annotations

__all__ = ["ONE_LINE", "PEER_FAILURE_HINTS", "STOPPED_CODES", "failure_report", "one_line"]

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


def has_error_file(failure) -> bool:
    return bool(failure.error_file) and failure.error_file != "<N/A>"


def is_consequence(failure) -> bool:
    """A rank stopped by torchrun, or one whose collective failed because a peer went away."""
    if isinstance(failure.message, dict):  # the rank recorded an exception: judge by its message
        return any(h in one_line(failure) for h in PEER_FAILURE_HINTS)
    if failure.exitcode in STOPPED_CODES:
        return True
    return failure.exitcode < 0 and failure.signal_name() in ("SIGTERM", "SIGINT")


def failure_report(err, world_size: int) -> tuple[str, str]:
    """``(summary, last_line)`` for a failed job (a torchrun ``ChildFailedError``).

    ``summary`` is torchrun's rank-tagged failure table with each traceback replaced by its one-line
    error (the root-cause rank printed its traceback to stderr once; every traceback is also in the
    ``error_file`` listed). The root cause is the first failure that is not a consequence of another
    (a rank torchrun stopped, or a collective that lost its peer), so a rank that timed out in the
    same second as the real failure is not blamed. ``last_line`` names that rank and its error and is
    meant to be printed last.
    """
    import copy

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failures = sorted(err.failures.items(), key=lambda rf: rf[1].timestamp)  # stable: rank order on ties
    root_rank, root = next(((r, f) for r, f in failures if not is_consequence(f)), failures[0])
    short = {}
    for rank, failure in [(root_rank, root)] + [(r, f) for r, f in failures if r != root_rank]:
        f = copy.copy(failure)
        f.message = one_line(failure)
        short[rank] = f
    short[root_rank].timestamp = min(f.timestamp for f in short.values())  # shown as the root cause
    summary = ChildFailedError(err.name, short).format_msg()
    consequence = is_consequence(root)
    if isinstance(root.message, dict) and has_error_file(root):
        above = "" if consequence or one_line(root).split(":")[0] in ONE_LINE else "above and "
        where = f"traceback {above}in {root.error_file}"
    else:
        where = "see its output above"
    last_line = f"raggedfsdp train: [rank {root_rank}/{world_size}] error: {one_line(root)} ({where})"
    if consequence:
        last_line += "; this usually means another rank failed or hung first"
    return summary, last_line
