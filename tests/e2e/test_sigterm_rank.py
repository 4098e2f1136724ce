"""SIGTERM to one rank of a running ``raggedfsdp train`` (issue 41 item 9): the exit code and the last
line raced (1 or 143; "another rank failed" vs "interrupted"), depending on whether the signalled rank
or torchrun's SIGTERM to the others ended first. Now, every time: exit code 143 and one last line
``raggedfsdp train: [rank 1/2] terminated by SIGTERM (exit code 143)``. The run is repeated at
several moments (while starting up, and at a few points of training) to cross the race's sides.
The reference is the test's own choice of rank and signal. Subprocess ``python -m raggedfsdp.app.cli``
(this worktree's code via PYTHONPATH)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of rank ``rank``: a child of the launcher process with ``RANK=rank`` in its environment."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler (``SigCgt`` in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def _steps_logged(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's pid in /proc")
@pytest.mark.parametrize("when", ["imports", "startup", "step2", "step5", "step9"])
def test_sigterm_to_one_rank_ends_with_one_line_and_143(tmp_path, when):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.Popen(
        [sys.executable, "-m", "raggedfsdp.app.cli", "train", "--nproc", "2", "--model", "debug",
         "--steps", "400", "--batch-size", "4", "--seq-len", "32", "--data.max_bytes", "200000",
         "--log-every", "1", "--out", str(out)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        pid = None
        while pid is None and time.monotonic() < deadline and p.poll() is None:
            pid = _rank_pid(p.pid, 1)
            time.sleep(0.05)
        assert pid is not None, "rank 1 never started"
        if (
            when == "imports"
        ):  # before its handler (Python start-up): killed outright, peers stopped by torchrun
            time.sleep(0.2)
        elif when == "startup":  # once its handler is installed (SigCgt), i.e. during checks/rendezvous/build
            while not _catches_sigterm(pid) and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.01)
        else:
            n = int(when.removeprefix("step"))
            while _steps_logged(out) < n and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.02)
        os.kill(pid, signal.SIGTERM)
        killed = time.monotonic()
        _, err = p.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = err.strip().splitlines()
    assert p.returncode == 143, lines[-6:]
    assert re.fullmatch(
        r"raggedfsdp train: \[rank 1/2\] terminated by SIGTERM \(exit code 143\).*", lines[-1]
    ), lines[-6:]
    assert not any("error:" in line for line in lines), [x for x in lines if "error:" in x]
    assert took < 60, took


@pytest.mark.core
def test_only_torchruns_own_closing_signals_are_not_an_interruption(tmp_path):
    """The classification itself (``launch.failures.interruption``) on torchrun's failure records: a
    collective that timed out on a hung rank, which torchrun then stopped with SIGTERM (its pid in the
    launcher's ``closing signal`` records), is a failure, not "rank 2 terminated"; the same SIGTERM
    from outside is an interruption naming that rank; a recorded ``Interrupted`` names its ranks."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from raggedfsdp.app.launch.failures import interruption

    def failure(rank, exitcode, message=None, culprits=None):
        path = tmp_path / f"error_{rank}_{exitcode}.json"
        if message is not None:
            extra = {
                "py_callstack": message,
                "timestamp": "100",
                **({"culprits": culprits} if culprits else {}),
            }
            path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))

    hang = ChildFailedError("w", {0: failure(0, 1, "RuntimeError: Timed out waiting"), 2: failure(2, -15)})
    assert interruption(hang, closed_pids={1002}) is None
    assert interruption(hang, closed_pids=()) == (2, 15)
    raced = ChildFailedError("w", {0: failure(0, -15), 1: failure(1, 143)})
    assert interruption(raced, closed_pids={1000}) == (1, 15)
    clean = ChildFailedError(
        "w", {r: failure(r, 143, "Interrupted: interrupted by SIGTERM", [1]) for r in (0, 1)}
    )
    assert interruption(clean, closed_pids=()) == (1, 15)
    real = ChildFailedError("w", {0: failure(0, 1, "ValueError: real problem"), 1: failure(1, 143)})
    assert interruption(real) is None
