"""Run torchrun in-process so that a failed job ends with one line (``raggedfsdp train``, ``bench``,
``wrap-bench``).

:func:`run_reported` calls torch's own launcher (``torch.distributed.run``) with the given torchrun
arguments and tells the ranks (:data:`~raggedfsdp.app.launch.failures.REPORTED_ENV`) that it prints the
root cause's error itself, so they print no one-line error of their own (their workers report with
:func:`~raggedfsdp.app.launch.failures.report_rank_failure`). When a rank fails the job ends with one line
on stderr, ``PROG: [rank R/W] error: Type: message (every rank's report: OUT/failure.log)``; above it
only the traceback of an unexpected error (once, lines tagged ``[rank R/W]``). ``OUT/failure.log``
holds torchrun's rank-tagged failure table and every rank's traceback, ``OUT/launcher.log`` torchrun's
own log lines (both created only when there is something to write).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from raggedfsdp.app.launch.failures import (
    REPORTED_ENV,
    capture_torchrun_logs,
    failure_report,
    interruption,
    write_failure_log,
)

__all__ = ["default_report_dir", "run_reported"]


def default_report_dir(name: str) -> str:
    """A fresh ``raggedfsdp-NAME-YYYYmmdd-HHMMSS-PID`` path in the system's temporary folder (not
    created: :func:`run_reported` creates it only when there is something to write)."""
    import tempfile
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(tempfile.gettempdir(), f"raggedfsdp-{name}-{stamp}-{os.getpid()}")


def run_reported(
    torchrun_argv: list[str],
    *,
    prog: str,
    world_size: int,
    out_dir: str | os.PathLike,
    tag: str = "",
    what: str = "job",
    on: str = "",
    resume_hint: str = "",
    rendezvous: tuple[str, int] | None = None,
) -> int:
    """Launch ``torchrun_argv`` (torchrun's own arguments, e.g. ``["--standalone", "--nproc-per-node=2",
    "--module", "raggedfsdp.app.bench.worker", ...]``) in this process; returns the exit code.

    0: every rank succeeded. 128 + signum: the launcher was interrupted (Ctrl-C, SIGTERM, SIGHUP,
    forwarded to the ranks by torchrun): one line ``PROG: interrupted by SIGNAL`` plus ``resume_hint``;
    or a rank got a signal (:func:`~raggedfsdp.app.launch.failures.interruption`; the other ranks
    stopped with it, cleanly or killed by torchrun, whatever the race): one line
    ``PROG: [rank R/W] terminated by SIGTERM (exit code 143)`` plus ``resume_hint``, always 143 for
    a SIGTERM (130 SIGINT, 129 SIGHUP). Otherwise a rank failed: the one last line above
    (the root cause: :func:`~raggedfsdp.app.launch.failures.failure_report`), the full report written to
    ``out_dir/failure{tag}.log`` (``tag``: e.g. ``.node1`` for one node of several; if it cannot be
    written, the failure table goes to stderr instead), exit code 1, or 2 when the root cause is a
    checkpoint that cannot be loaded. ``what`` names the job in the report's header (``job``,
    ``bench``), ``on`` its place (`` (node 1 of 2)``). ``rendezvous``: ``(endpoint, timeout_s)`` of a
    multi-node start (:func:`_watch_rendezvous`: a bounded wait, and Ctrl-C works during it). Call it
    on the launching process only; it leaves no environment variable or logging handler behind.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed import DistNetworkError
    from torch.distributed.run import parse_args, run

    out_dir = Path(out_dir)
    stop_watch = _watch_rendezvous(prog, rendezvous) if rendezvous else None
    os.environ[REPORTED_ENV] = "1"
    closed_pids: set[int] = set()  # the ranks torchrun itself stopped (interruption)
    restore_logs = capture_torchrun_logs(out_dir / f"launcher{tag}.log", closed_pids)
    try:
        run(parse_args(torchrun_argv))
    except DistNetworkError as e:  # node 0's store cannot listen (the port taken since the pre-check)
        from raggedfsdp.app.launch.env import port_in_use

        print(
            f"{prog}: error: {port_in_use(rendezvous[0], e) if rendezvous else e}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    except SignalException as e:  # Ctrl-C / SIGTERM / SIGHUP to the launcher: forwarded to the ranks
        name = signal.Signals(e.sigval).name
        print(f"{prog}: interrupted by {name}{resume_hint}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        stop = interruption(e, closed_pids)
        if stop is not None:  # a rank got a signal (the others stopped with it): one line, 128 + signum
            rank, signum = stop
            name = signal.Signals(signum).name
            print(
                f"{prog}: [rank {rank}/{world_size}] terminated by {name} (exit code {128 + signum}){on}"
                f"{resume_hint}",
                file=sys.stderr,
                flush=True,
            )
            return 128 + signum
        report = out_dir / f"failure{tag}.log"
        summary, last_line = failure_report(e, world_size, details=str(report), prog=prog)
        try:
            write_failure_log(report, e, f"the {world_size}-rank {what} failed{on}\n{summary}", last_line)
        except OSError as err:  # OUT not writable any more: the table goes to stderr instead
            print(f"{summary}\n(cannot write {report}: {err})", file=sys.stderr)
            last_line = failure_report(e, world_size, prog=prog)[1]
        print(last_line, file=sys.stderr, flush=True)
        return 2 if "CheckpointError: cannot load" in last_line else 1
    finally:
        if stop_watch is not None:
            stop_watch()
        restore_logs()
        os.environ.pop(REPORTED_ENV, None)  # a launcher called in-process leaves nothing behind
    return 0


def _children() -> bool:
    """Whether this process has a child (a rank started by torchrun; Linux /proc, else True)."""
    me = str(os.getpid())
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as fh:
                        if fh.read().rsplit(")", 1)[1].split()[1] == me:
                            return True
                except (OSError, IndexError):
                    continue
    except OSError:
        return True
    return False


def _watch_rendezvous(prog: str, rendezvous: tuple[str, int]):
    """Bound a multi-node start's wait for the rendezvous; returns ``stop()``.

    torchrun's wait for node 0's store is C++ (a ``TCPStore`` connect/handshake): it ignored Ctrl-C
    (Python's handler runs only when the main thread gets back to Python) and, against a port held
    by another program, outlived its own timeout. A thread watches until this launcher's ranks
    exist: a signal (seen through ``signal.set_wakeup_fd``, written by the C-level handler at once)
    ends the process with one line and ``128 + signum``; so does ``timeout_s + 30`` s without ranks
    (exit 1, naming the endpoint and the likely causes). Main thread only (``set_wakeup_fd``)."""
    import select
    import threading
    import time

    endpoint, timeout_s = rendezvous
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: no watch
        os.close(r)
        os.close(w)
        return lambda: None
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s + 30
        while not done.is_set():
            ready, _, _ = select.select([r], [], [], 0.5)
            if done.is_set() or _children():
                return
            if ready:
                data = os.read(r, 64)
                sig = next((b for b in data if b in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)), 0)
                if sig:
                    name = signal.Signals(sig).name
                    print(f"{prog}: interrupted by {name} while waiting for the rendezvous at {endpoint}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    os._exit(128 + sig)
            if time.monotonic() > deadline:
                print(
                    f"{prog}: error: no rendezvous at {endpoint} within {timeout_s + 30:g} s: is node 0 "
                    "started with the same --rdzv-endpoint, is that port free on node 0 (not held by "
                    "another program) and reachable from here (a firewall)?",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    thread = threading.Thread(target=watch, name="raggedfsdp-rendezvous-watch", daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join(timeout=2)
        try:
            signal.set_wakeup_fd(old_fd)
        except ValueError:
            pass
        os.close(r)
        os.close(w)

    return stop
