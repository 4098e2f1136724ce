"""The ``--out`` folder of a run: run id, lock, fresh/resume policy, and the one-time resume check.

``OUT/run.json`` holds the run id (a random hex string) of the run that owns ``OUT``; each checkpoint
manifest carries the id of the run that saved it (:mod:`raggedfsdp.app.checkpoint.integrity`). A fresh
run (no ``--resume``) into an ``OUT`` that already holds a run is refused unless ``--job.overwrite
true``. An exclusive ``fcntl.flock`` on ``OUT/.lock`` (held by the launcher, or by rank 0 under a
bare torchrun) stops a second job from using the same ``OUT``; the kernel drops it when the holder
dies, so a crash never leaves a stale lock.

:func:`prepare` is every check a run needs before it starts, done once per process: the config is
validated for the world size, the data source checked, and on rank 0 the ``--out`` policy applied,
an explicit ``--resume PATH`` resolved and SHA-256-verified, and the lock taken. The launcher
(``raggedfsdp train``) prepares first and hands its results to the ranks by environment variables:
:data:`LOCK_HELD_ENV` (it holds the lock) and :data:`RESUME_VERIFIED_ENV` (the step folder it
verified), so a launched job hashes an explicit checkpoint once, not once per process.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raggedfsdp.app.checkpoint.dcp import config_hash, resolve_resume
from raggedfsdp.app.checkpoint.integrity import read_manifest, step_candidates

__all__ = [
    "LOCK_FILE",
    "LOCK_HELD_ENV",
    "RESUME_VERIFIED_ENV",
    "RUN_FILE",
    "OutLock",
    "PreparedRun",
    "check_out_dir",
    "default_out",
    "new_run_id",
    "prepare",
    "read_run_id",
    "recover_run_file",
    "start_run",
    "write_run_file",
]

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
LOCK_HELD_ENV = "RAGGEDFSDP_OUT_LOCK_HELD"  # set by the launcher that holds OUT/.lock
RESUME_VERIFIED_ENV = "RAGGEDFSDP_RESUME_VERIFIED"  # set by the launcher that verified --resume PATH


def new_run_id() -> str:
    return secrets.token_hex(6)


def read_run_id(out: Path) -> str | None:
    try:
        return json.loads((out / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def _run_file_problem(out: Path) -> str | None:
    """None when ``OUT/run.json`` names a run id, else why not (``missing``, ``unreadable (...)``)."""
    path = out / RUN_FILE
    if not path.exists():
        return "missing"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"unreadable ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str) or not data["run_id"]:
        return "unreadable (no run_id in it)"
    return None


def recover_run_file(out: Path, ckpt_folder: Path, *, overwrite: bool = False) -> str | None:
    """``--resume auto`` with ``OUT/run.json`` missing or unreadable: rank 0, before
    the launch, under the ``OUT`` lock. Returns a note for the user, or None when there was nothing to do.

    Without a run id, ``--resume auto`` would take every checkpoint in ``OUT`` for another run's,
    start from step 0 and overwrite ``metrics.jsonl``. Instead: when every ``step-N`` manifest under
    ``ckpt_folder`` carries the same run id, that run is the one to continue: ``run.json`` is written
    again with it (an unreadable one is kept as ``run.json.unreadable``). When they carry several, a
    ``ValueError`` names them and the ``--resume PATH`` that continues each (the run that saved a step
    folder is the one its manifest names). With no checkpoint to continue but a ``metrics.jsonl``
    that a fresh start would overwrite, a ``ValueError`` unless ``overwrite`` (``--job.overwrite true``)."""
    problem = _run_file_problem(out)
    if problem is None:
        return None
    owners: dict[str, list[Path]] = {}
    for _, path in step_candidates(ckpt_folder):  # newest first
        owner = (read_manifest(path) or {}).get("run_id")
        if isinstance(owner, str) and owner:
            owners.setdefault(owner, []).append(path)
    where = out / RUN_FILE
    if not owners:
        if (out / "metrics.jsonl").exists() and not overwrite:
            raise ValueError(
                f"--resume auto: {where} is {problem} and no checkpoint of a run is under {ckpt_folder}, "
                f"so this would start from step 0 and overwrite {out / 'metrics.jsonl'}; start over with "
                "--job.overwrite true, or choose another --out"
            )
        return None
    if len(owners) > 1:
        runs = "; ".join(f"run {r}: {', '.join(p.name for p in ps)}" for r, ps in owners.items())
        raise ValueError(
            f"--resume auto: {where} is {problem} and the checkpoints under {ckpt_folder} belong to "
            f"{len(owners)} runs ({runs}); nothing was changed: continue one with --resume PATH, e.g. "
            f"--resume {next(iter(owners.values()))[0]}"
        )
    ((run_id, paths),) = owners.items()
    if where.exists():
        os.replace(where, out / (RUN_FILE + ".unreadable"))
    write_run_file(out, run_id, recovered_from=str(paths[0]))
    kept = f" (the unreadable one kept as {RUN_FILE}.unreadable)" if problem != "missing" else ""
    return (
        f"--resume auto: {where} was {problem}; continuing run {run_id}, named by the manifests of its "
        f"checkpoints ({', '.join(p.name for p in paths)}), and wrote {RUN_FILE} again{kept}"
    )


def write_run_file(out: Path, run_id: str, **extra: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "created": time.time(), **extra}, indent=1))
    os.replace(tmp, out / RUN_FILE)


def default_out() -> str:
    """A fresh ``outputs/run-...`` folder: a timestamp (launcher, single process) or, under a bare
    torchrun, its run id (the same on every rank)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return os.path.join("outputs", f"run-torchrun-{run[:12]}")
    base = os.path.join("outputs", time.strftime("run-%Y%m%d-%H%M%S"))
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


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

    def __getstate__(self) -> dict[str, Any]:  # a copy on another rank (a broadcast) holds nothing
        return {"path": self.path, "_fd": None}

    def acquire(self) -> OutLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
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
            try:  # the holder removes the file on release: lock only the file that is still there
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove ``OUT/.lock`` (still holding it, so no one locks a file on its way out) and unlock."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


@dataclass
class PreparedRun:
    """What :func:`prepare` found: the run's folders, the explicit ``--resume`` step folder (resolved
    and, unless ``--checkpoint.verify false``, verified; None for a fresh run or ``--resume auto``)
    and the ``OUT/.lock`` this process holds (None on ranks > 0 or when the launcher holds it)."""

    out: Path
    ckpt_folder: Path
    resume_path: Path | None = None
    lock: OutLock | None = None
    notes: list[str] = field(default_factory=list)  # for the user (e.g. a recovered run.json)


def _resume_mark(cfg) -> dict[str, str]:
    c = cfg.checkpoint
    return {"out": str(Path(cfg.job.out).resolve()), "resume": c.resume, "verify": str(c.verify)}


def prepare(cfg, world_size: int, *, rank: int = 0, check_out: bool = True, validate: bool = True,
            check_data: bool = True, check_model: bool = False) -> PreparedRun:  # fmt: skip
    """Every check of a run before it starts, once per process; raises ``ValueError`` (one line: the
    option, the value, the fix) or ``OSError`` (``--out`` not writable).

    All ranks: ``cfg.validate(world_size)`` (unless ``validate=False``), then an empty ``--out``
    becomes :func:`default_out` (set in ``cfg.job.out``), and ``cfg.check_data()`` (unless
    ``check_data=False``). Rank 0 with ``check_out``: the ``--out`` policy
    (:func:`check_out_dir`), an explicit ``--resume PATH`` resolved and verified against its manifest
    (``checkpoint.dcp.resolve_resume``; taken without re-hashing from :data:`RESUME_VERIFIED_ENV`
    when the launcher already did it for the same ``--out`` and ``--resume``), and ``OUT/.lock``
    acquired and held by the returned :class:`PreparedRun` (unless :data:`LOCK_HELD_ENV` says the
    launcher holds it), then for ``--resume auto`` a missing or unreadable ``OUT/run.json`` recovered
    or refused (:func:`recover_run_file`; its note in ``PreparedRun.notes``). With ``check_model``
    (the launcher and the worker; a ``Trainer`` built directly reports it at the load), the
    checkpoint to resume (the explicit one, or the run's newest) must hold this model
    (``check_resume_model``). ``--model.init_from`` must name a safetensors folder (all ranks). A
    launcher (``raggedfsdp train``) prints the notes and calls :func:`hand_to_workers` next.
    """
    if validate:
        cfg.validate(world_size=world_size)
    if not cfg.job.out:  # a fresh folder per run (validate refused --resume auto without --out)
        cfg.job.out = default_out()
    _check_init_from(cfg.model.init_from)
    if check_data:
        try:
            cfg.check_data()
        except ValueError as e:  # a DataError (one line, recorded by a rank)
            from raggedfsdp.app.train.data import DataError

            raise DataError(str(e)) from None
    c = cfg.checkpoint
    run = PreparedRun(Path(cfg.job.out), Path(c.resolved_folder(cfg.job.out)))
    if rank != 0 or not check_out:
        return run
    check_out_dir(cfg.job.out, str(run.ckpt_folder), resume=c.resume, overwrite=cfg.job.overwrite)
    if c.resume and c.resume != "auto":
        mark = json.loads(os.environ.get(RESUME_VERIFIED_ENV) or "{}")
        if mark.get("path") and {k: mark.get(k) for k in _resume_mark(cfg)} == _resume_mark(cfg):
            run.resume_path = Path(mark["path"])
        else:
            run.resume_path = resolve_resume(c.resume, run.ckpt_folder, verify=c.verify)
            if check_model:  # before the lock: a refusal leaves no OUT behind
                _check_resume_model(cfg, run.resume_path)
    if os.environ.get(LOCK_HELD_ENV) != str(run.out.resolve()):
        run.lock = OutLock(cfg.job.out).acquire()  # held by this process until the run ends
    try:
        if c.resume == "auto":
            note = recover_run_file(run.out, run.ckpt_folder, overwrite=cfg.job.overwrite)
            if note:
                run.notes.append(note)
            if check_model:
                _check_resume_model(cfg, _newest_own_step(run))
    except BaseException:
        if run.lock is not None:
            run.lock.release()
        raise
    return run


def _check_resume_model(cfg, path: Path | None) -> None:
    """Another model's checkpoint is refused before the launch (``resume_check.check_resume_model``)."""
    if path is not None:
        from raggedfsdp.app.train.resume_check import check_resume_model

        check_resume_model(cfg, path)


def _newest_own_step(run: PreparedRun) -> Path | None:
    """The newest ``step-N`` (with DCP metadata) of the run in ``OUT/run.json``: what ``--resume auto``
    will most likely load (the trainer verifies and may fall back to an older one)."""
    run_id = read_run_id(run.out)
    for _, path in step_candidates(run.ckpt_folder):
        if (path / ".metadata").is_file() and (read_manifest(path) or {}).get("run_id") == run_id:
            return path
    return None


def _check_init_from(path: str) -> None:
    """``--model.init_from`` must name a folder of ``*.safetensors`` files: refused before the launch,
    one line, not after the ranks have started."""
    if not path:
        return
    p = Path(path)
    if not p.exists():
        why = "not found"
    elif not p.is_dir():
        why = "is a file, not a folder"
    elif not any(p.glob("*.safetensors")):
        why = "holds no *.safetensors file"
    else:
        return
    raise ValueError(
        f"--model.init_from {path}: {why} (expected a Hugging Face safetensors folder, e.g. one written by "
        "raggedfsdp convert --to safetensors)"
    )


def hand_to_workers(cfg, run: PreparedRun) -> None:
    """Set the environment the launched ranks inherit: this process holds ``OUT/.lock``
    (:data:`LOCK_HELD_ENV`) and has verified the explicit ``--resume`` step folder
    (:data:`RESUME_VERIFIED_ENV`), so their :func:`prepare` neither re-locks nor re-hashes."""
    os.environ[LOCK_HELD_ENV] = str(run.out.resolve())
    if run.resume_path is not None:
        os.environ[RESUME_VERIFIED_ENV] = json.dumps({**_resume_mark(cfg), "path": str(run.resume_path)})
    else:
        os.environ.pop(RESUME_VERIFIED_ENV, None)


def start_run(cfg, run: PreparedRun) -> str:
    """Rank 0, once the run is prepared: the run id (kept from ``OUT/run.json`` on a resume, taken
    from the manifest of an explicit ``--resume`` step folder, else new), written to ``OUT/run.json``
    with the config hash."""
    c = cfg.checkpoint
    run_id = read_run_id(run.out) if c.resume else None
    if run.resume_path is not None:  # continue the run that saved the given checkpoint
        man = read_manifest(run.resume_path)
        run_id = (man or {}).get("run_id") or run_id
    run_id = run_id or new_run_id()
    write_run_file(run.out, run_id, config_hash=config_hash(cfg.to_dict()))
    return run_id
