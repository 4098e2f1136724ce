"""Checkpoint integrity and run identity: manifests, verification, the ``--out`` lock and policy.

Manifest: every ``step-N/`` folder ends with ``manifest.json`` (written last, before the folder is
renamed from ``step-N.tmp``)::

    {"format": 1, "run_id": "3f9c...", "step": N,
     "files": {".metadata": {"bytes": 1234, "sha256": "..."}, "__0_0.distcp": {...}, ...}}

The ``.distcp`` files are hashed by the ranks in parallel (file ``i`` of the sorted listing by rank
``i % W``) right after DCP wrote them, and rank 0 writes the manifest. :func:`verify_step_folder`
re-checks every listed file's size and SHA-256 and that no ``.distcp`` file is missing or extra; it
is run by the launcher for an explicit ``--resume PATH`` (a one-line error before any rank starts)
and by rank 0 of the job (the result is broadcast) before every load.

Run identity: ``OUT/run.json`` holds the run id (a random hex string) of the run that owns ``OUT``;
each manifest carries the id of the run that saved it. ``--resume auto`` considers only checkpoints
of the run recorded in ``OUT/run.json``, newest first, and takes the first that verifies (naming the
ones it skipped and why); pruning (``checkpoint.keep_latest``) deletes only the run's own
checkpoints. A fresh run (no ``--resume``) into an ``OUT`` that already holds a run is refused
unless ``--job.overwrite true``. An exclusive ``fcntl.flock`` on ``OUT/.lock`` (held by the launcher,
or by rank 0 under a bare torchrun) stops a second job from using the same ``OUT``; the kernel drops
it when the holder dies, so a crash never leaves a stale lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "OutLock",
    "check_out_dir",
    "file_digest",
    "new_run_id",
    "pick_resume",
    "read_manifest",
    "read_run_id",
    "verify_step_folder",
    "write_manifest",
]

MANIFEST = "manifest.json"
RUN_FILE = "run.json"
LOCK_FILE = ".lock"
LOCK_HELD_ENV = "RAGGEDFSDP_OUT_LOCK_HELD"  # set by the launcher that holds OUT/.lock
_STEP_RE = re.compile(r"^step-(\d+)$")


def new_run_id() -> str:
    return secrets.token_hex(6)


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes", "sha256"}`` of one file (streamed)."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def write_manifest(folder: Path, *, run_id: str, step: int, files: dict[str, dict[str, Any]]) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": 1, "run_id": run_id, "step": step, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def verify_step_folder(folder: Path) -> str | None:
    """None if ``folder`` matches its manifest, else the first problem found (one line)."""
    man = read_manifest(folder)
    if man is None:
        why = "missing" if not (folder / MANIFEST).exists() else "unreadable"
        return f"{MANIFEST} {why} (an incomplete save, or not written by raggedfsdp train)"
    files = man["files"]
    on_disk = {p.name for p in folder.glob("*.distcp")}
    extra = sorted(on_disk - set(files))
    if extra:
        return f"file(s) not in the manifest: {', '.join(extra)}"
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, the manifest says {want['bytes']} (truncated?)"
        if file_digest(path)["sha256"] != want["sha256"]:
            return f"{name} fails its SHA-256 check (corrupted on disk)"
    return None


def step_candidates(folder: Path) -> list[tuple[int, Path]]:
    """``step-N`` folders under ``folder`` (complete or not), newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def pick_resume(folder: Path, run_id: str | None) -> tuple[Path | None, list[str]]:
    """``(newest step folder of run_id that verifies, notes)`` for ``--resume auto``.

    ``notes``: one line per checkpoint skipped (a corrupt one of this run, with the reason) and one
    line for the other runs' checkpoints that were ignored. ``step-N.tmp`` folders (a save that was
    interrupted before its final rename) are never candidates; a note names them."""
    notes, foreign = [], []
    unfinished = sorted(p.name for p in folder.glob("step-*.tmp")) if folder.is_dir() else []
    if unfinished:
        notes.append(
            f"--resume auto: ignoring unfinished save(s) {', '.join(unfinished)} (interrupted while being "
            "written; never resumed from, deleted by the next save of that step)"
        )
    for _, path in step_candidates(folder):
        man = read_manifest(path)
        owner = man.get("run_id") if man else None
        if man is not None and owner != run_id:
            foreign.append(f"{path.name} (run {owner})")
            continue
        if run_id is None:
            foreign.append(f"{path.name} (no run id)")
            continue
        problem = verify_step_folder(path)
        if problem is None:
            return path, notes + _foreign_note(foreign)
        notes.append(f"--resume auto: skipping {path}: {problem}")
    return None, notes + _foreign_note(foreign)


def _foreign_note(foreign: list[str]) -> list[str]:
    if not foreign:
        return []
    return [f"--resume auto: ignoring checkpoints of other runs: {', '.join(foreign)}"]


def own_step_folders(folder: Path, run_id: str) -> list[tuple[int, Path]]:
    """This run's complete ``step-N`` folders, oldest first (what pruning may delete)."""
    found = []
    for step, path in step_candidates(folder):
        man = read_manifest(path)
        if man is not None and man.get("run_id") == run_id:
            found.append((step, path))
    return sorted(found)


def read_run_id(out: Path) -> str | None:
    try:
        return json.loads((out / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def write_run_file(out: Path, run_id: str, **extra: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "created": time.time(), **extra}, indent=1))
    os.replace(tmp, out / RUN_FILE)


def check_out_dir(out: str, ckpt_folder: str, *, resume: str, overwrite: bool) -> None:
    """Pre-launch policy check of ``--out`` (reads only). ``ValueError`` with the fix."""
    o = Path(out)
    if resume:
        return
    held = []
    if (o / RUN_FILE).exists():
        held.append(f"run {read_run_id(o)}")
    if (o / "metrics.jsonl").exists():
        held.append("metrics.jsonl")
    steps = [p.name for _, p in step_candidates(Path(ckpt_folder))]
    if steps:
        held.append("checkpoints " + ", ".join(sorted(steps)))
    if held and not overwrite:
        raise ValueError(
            f"--out {out} already holds a run ({'; '.join(held)}); continue it with --resume auto, "
            "start a new run in it with --job.overwrite true (other runs' checkpoints are kept and "
            "ignored), or choose another --out"
        )


class OutLock:
    """An exclusive, non-blocking ``flock`` on ``OUT/.lock`` (released when the process exits)."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.path = Path(out) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> OutLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise ValueError(
                f"--out {self.path.parent} is in use by another job ({holder}); wait for it to end "
                "or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
