"""Checkpoint integrity: manifests, verification, and picking the step folder to resume from.

Manifest: every ``step-N/`` folder ends with ``manifest.json`` (written last, before the folder is
renamed from ``step-N.tmp``)::

    {"format": 1, "run_id": "3f9c...", "step": N,
     "files": {".metadata": {"bytes": 1234, "sha256": "..."}, "__0_0.distcp": {...}, ...}}

The ``.distcp`` files are hashed by the ranks in parallel (file ``i`` of the sorted listing by rank
``i % W``) right after DCP wrote them, and rank 0 writes the manifest. :func:`verify_step_folder`
re-checks every listed file's size and SHA-256 and that no ``.distcp`` file is missing or extra. An
explicit ``--resume PATH`` is verified once per job, by ``train/run_dir.prepare`` (in the launcher,
a one-line error before any rank starts; under a bare torchrun on rank 0), and ``--resume auto``'s
pick verifies its candidates once on rank 0 (the result is broadcast).

Run identity: each manifest carries the id of the run that saved it (``OUT/run.json``, the ``--out``
lock and the fresh/resume policy are in :mod:`raggedfsdp.app.train.run_dir`). ``--resume auto``
(:func:`pick_resume`) considers only checkpoints of the run recorded in ``OUT/run.json``, newest
first, and takes the first that verifies (naming the ones it skipped and why); pruning
(``checkpoint.keep_latest``) deletes only the run's own checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "file_digest",
    "pick_resume",
    "read_manifest",
    "step_mismatch",
    "verify_step_folder",
    "write_manifest",
]

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d+)$")


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


def step_mismatch(folder: Path) -> str | None:
    """One line when the ``step-N`` folder ``folder`` holds another step's checkpoint (its manifest
    says step M != N: copied or renamed by hand), else None (also for a folder
    without a manifest or not named ``step-N``)."""
    m = _STEP_RE.match(folder.name)
    man = read_manifest(folder)
    if m is None or man is None or not isinstance(man.get("step"), int) or man["step"] == int(m.group(1)):
        return None
    return (
        f"{folder.name} holds the checkpoint of step {man['step']} (its {MANIFEST} says step "
        f"{man['step']}: copied or renamed by hand?)"
    )


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
        problem = verify_step_folder(path) or step_mismatch(path)
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
