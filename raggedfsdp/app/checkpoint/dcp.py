"""Checkpoints of a training run with torch.distributed.checkpoint (DCP), loadable at any world size.

Layout: ``<checkpoint.folder>/step-N/`` is one DCP checkpoint (``.metadata`` plus one ``.distcp``
file per rank that saved it) and a ``meta.json`` written by rank 0 for humans (step, world size,
config hash, run id, the full config) and a ``manifest.json`` (size + SHA-256 of every file and the
run id; see ``checkpoint/integrity.py``). A step folder is written as ``step-N.tmp`` and renamed when every
rank has finished and the manifest is written, so a folder named ``step-N`` is always complete, and a
load verifies it first (a flipped byte, a truncated or missing shard is an error, or is skipped by
``--resume auto``). Loads are strict (``load_checkpoint``): every key and shape must match.

Contents (one DCP state dict):

- ``model``: ``get_model_state_dict`` of the sharded model (RaggedShard / Shard DTensors; each rank
  writes only its own pieces, and a load re-shards to the loading world size);
- ``optim``: ``get_optimizer_state_dict`` (AdamW ``exp_avg``/``exp_avg_sq``/``step``, sharded like
  the parameters, plus the param groups);
- ``train``: ``step`` (the last completed optimizer step), ``lr`` (the LR used at that step),
  ``seed``.

Nothing else is needed for an exact resume: the learning rate is a pure function of the step (see
``lr_schedule.lr_at``), the data order is a pure function of ``(seed, step)`` (see
``data.BatchSampler``), and training uses no random numbers after the model init (no dropout), so
there is no RNG state to restore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from raggedfsdp.app.checkpoint.integrity import (
    file_digest,
    own_step_folders,
    pick_resume,
    read_manifest,
    step_mismatch,
    verify_step_folder,
    write_manifest,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "config_hash",
    "latest_step_folder",
    "load_checkpoint",
    "open_step_folder",
    "resolve_resume",
    "save_checkpoint",
    "saved_model_shapes",
    "short_error",
    "step_folders",
]

_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incomplete, corrupt); the message names the path."""


def config_hash(cfg_dict: dict[str, dict[str, Any]]) -> str:
    """A short hash of the settings that define the optimisation (not output, logging or checkpoint
    options), to tell whether a resumed run uses the same config."""
    keep = {k: v for k, v in cfg_dict.items() if k not in ("job", "metrics", "checkpoint", "debug")}
    keep["seed"] = cfg_dict.get("job", {}).get("seed")
    blob = json.dumps(keep, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def step_folders(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete ``step-N`` folders under ``folder`` (those with DCP's ``.metadata``), sorted by N."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / ".metadata").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_step_folder(folder: str | os.PathLike) -> Path | None:
    found = step_folders(folder)
    return found[-1][1] if found else None


def _check_step_folder(path: Path, *, train_state: bool = True) -> Path:
    """``path`` if it is a readable DCP checkpoint, else a ``CheckpointError`` naming it.
    ``train_state``: it must also hold ``train.step`` (a ``raggedfsdp train`` save), not only ``model.*``."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"not a checkpoint: {path} (no DCP .metadata file; expected a step-N folder written by "
            "raggedfsdp train, or a folder of them)"
        )
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 (any unpickling error means a corrupt file)
        raise CheckpointError(
            f"corrupt checkpoint: {path}/.metadata cannot be read ({type(e).__name__}: {e})"
        ) from None
    keys = set(meta.state_dict_metadata)
    if (train_state and "train.step" not in keys) or not any(k.startswith("model.") for k in keys):
        raise CheckpointError(f"not a raggedfsdp train checkpoint: {path} (no train.step / model.* entries)")
    return path


def resolve_resume(
    resume: str,
    folder: str | os.PathLike,
    *,
    run_id: str | None = None,
    verify: bool = True,
    notes: list[str] | None = None,
) -> Path | None:
    """The step folder to resume from, or None to start fresh.

    ``resume``: ``""`` (no resume), ``"auto"`` (the newest ``step-N`` under ``folder`` saved by run
    ``run_id`` that verifies against its manifest; None if there is none), a ``step-N`` folder, or a
    folder of ``step-N`` folders (its newest). An explicit path must verify (``verify``). Raises
    ``CheckpointError`` naming the path and the problem. ``notes`` collects what auto skipped.
    """
    if not resume:
        return None
    if resume == "auto":
        path, skipped = pick_resume(Path(folder), run_id) if verify else (latest_step_folder(folder), [])
        if notes is not None:
            notes.extend(skipped)
        return _check_step_folder(path) if path is not None else None
    return open_step_folder(resume, verify=verify)


_UNFINISHED_RE = re.compile(r"^step-(\d+)\.tmp$")


def open_step_folder(
    path: str | os.PathLike,
    *,
    verify: bool = True,
    unchecked: str = "--checkpoint.verify false",
    train_state: bool = True,
) -> Path:
    """The step folder an explicit checkpoint path names, checked as every command that reads one
    checks it (``train --resume PATH``, ``convert``).

    ``path``: a ``step-N`` folder, or a folder of them (its newest complete one). Refused with a
    ``CheckpointError`` (one line naming the path and the cause, then a fix): a path that does not
    exist or is a file; an unfinished save (``step-N.tmp``: interrupted before its final rename,
    whether or not its files look complete); no DCP ``.metadata``, or one that cannot be read; no
    ``model.*`` entries (and no ``train.step`` when ``train_state``); with ``train_state``, a
    ``step-N`` folder whose manifest says another step (:func:`integrity.step_mismatch`); and, when
    ``verify``, any file
    that does not match the folder's ``manifest.json`` (missing, extra, truncated, or failing its
    SHA-256: :func:`raggedfsdp.app.checkpoint.integrity.verify_step_folder`). ``unchecked`` is the flag
    the message offers to skip that last check.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint: {path} (a file; expected a step-N folder)")
    if _UNFINISHED_RE.match(path.name):
        done = path.with_name(path.name.removesuffix(".tmp"))
        newest = latest_step_folder(path.parent)
        fix = f"use {newest}" if newest is not None else "no complete step-N folder is next to it"
        raise CheckpointError(
            f"unfinished save: {path} (interrupted before its rename to {done.name}; its files may be "
            f"incomplete): {fix}"
        )
    if not (path / ".metadata").exists():
        latest = latest_step_folder(path)
        if latest is None:
            raise CheckpointError(
                f"not a checkpoint: {path} (no DCP .metadata file and no complete step-N folders inside)"
            )
        path = latest
    _check_step_folder(path, train_state=train_state)
    mismatch = step_mismatch(path) if train_state else None  # resumed, its step would be another
    if mismatch is not None:
        raise CheckpointError(
            f"wrong step folder: {path}: {mismatch}; rename it to step-{read_manifest(path)['step']} "
            "or resume another step-N"
        )
    if verify:
        problem = verify_step_folder(path)
        if problem is not None:
            raise CheckpointError(
                f"corrupt checkpoint: {path}: {problem} (use an older step-N, or {unchecked} to load it "
                "unchecked)"
            )
    return path


def _state_dict(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def save_checkpoint(
    folder: str | os.PathLike,
    step: int,
    *,
    model,
    optimizer,
    lr: float,
    seed: int,
    keep_latest: int,
    meta: dict[str, Any],
    run_id: str = "",
    writer_factory: Callable[[Path], Any] | None = None,
) -> Path:
    """Save ``step-N`` under ``folder`` (collective: every rank calls it); prune to ``keep_latest``.

    The files are hashed into ``manifest.json`` (see ``checkpoint/integrity.py``) before the folder gets its
    final name; pruning deletes only older checkpoints of ``run_id``, never the one just written.
    Any failure (a full disk, a permission error) raises ``CheckpointError`` on every rank with one
    line naming the cause, the path and the rank. ``writer_factory``: ``folder -> StorageWriter`` in
    place of DCP's ``FileSystemWriter`` (the trainer hands in the test-only fault writer of
    ``train/faults.py`` when ``RAGGEDFSDP_FAULT`` asks for ``enospc``, ``eacces`` or ``slowsave``).

    Interrupted saves: nothing is visible under ``step-N`` until every file is written and hashed
    (``step-N.tmp`` is renamed last), so a rank killed mid-save (a second Ctrl-C, SIGKILL, a power
    cut) leaves only ``step-N.tmp``, which ``--resume auto`` never considers; the next save of that
    step deletes it.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(folder)
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    start = time.perf_counter()
    box: list[Any] = [None]
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            box[0] = _os_error(e)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(f"cannot save checkpoint {final}: {box[0]} on rank 0")
    sd = _state_dict(model, optimizer)
    sd["train"] = {
        "step": torch.tensor(step, dtype=torch.int64),
        "lr": torch.tensor(lr, dtype=torch.float64),
        "seed": torch.tensor(seed, dtype=torch.int64),
    }
    try:
        dcp.save(sd, storage_writer=(writer_factory or _writer)(tmp))
    except (Exception, CheckpointException) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot save checkpoint {final}: {_short(e, load=False)}") from e
    # Hash the shard files in parallel (file i on rank i % W), then rank 0 writes the manifest.
    names = [sorted(p.name for p in tmp.glob("*.distcp")) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine: dict[str, Any] = {n: file_digest(tmp / n) for i, n in enumerate(names[0]) if i % world == rank}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    box = [None]
    if rank == 0:
        try:
            files = {k: v for part in gathered for k, v in part.items()}
            with open(tmp / "meta.json", "w") as fh:
                json.dump(
                    {"step": step, "lr": lr, "seed": seed, "run_id": run_id, **meta, "saved_at": time.time()},
                    fh,
                    indent=2,
                )
            for name in (".metadata", "meta.json"):
                files[name] = file_digest(tmp / name)
            write_manifest(tmp, run_id=run_id, step=step, files=files)
            if final.exists():
                owner = (read_manifest(final) or {}).get("run_id")
                if owner is not None and owner != run_id:  # another run's: keep it, out of the way
                    aside = root / f"{final.name}.run-{owner}"
                    os.replace(final, aside)
                    logger.warning("moved run %s's checkpoint %s to %s (not pruned)", owner, final, aside)
                else:
                    shutil.rmtree(final)
            os.replace(tmp, final)
            if keep_latest > 0:
                own = [p for s, p in own_step_folders(root, run_id) if s != step]
                for old in own[: max(0, len(own) - (keep_latest - 1))]:
                    shutil.rmtree(old, ignore_errors=True)
            logger.info("saved checkpoint %s (%.2fs)", final, time.perf_counter() - start)
        except OSError as e:
            box[0] = _os_error(e)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(f"cannot save checkpoint {final}: {box[0]} on rank 0")
    return final


def _os_error(e: OSError) -> str:
    """``No space left on device: '/path'`` (errno text and file name, one line)."""
    text = e.strerror or str(e)
    return f"{text}: {e.filename!r}" if e.filename else text


def _writer(path: Path):
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(path))


def short_error(e: BaseException, load: bool = True) -> str:
    """The root error of a (possibly multi-rank) DCP failure, in one line (``CheckpointException``, a
    ``BaseException``, holds each rank's; ``load``: hint at a truncated or corrupt file)."""
    return _short(e, load)


def _short(e: BaseException, load: bool = True) -> str:
    """The root error of a (possibly multi-rank) DCP failure, in one line."""
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception}
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        if isinstance(inner, tuple):  # (exception, traceback frames)
            inner = inner[0]
        if isinstance(inner, OSError):
            text = _os_error(inner)
        else:
            text = f"{type(inner).__name__}: {inner}".rstrip(": ") if str(inner) else type(inner).__name__
        hint = " (a truncated or corrupt file?)" if load and not isinstance(inner, OSError) else ""
        return f"{text} on rank {rank}{hint}".splitlines()[0]
    if isinstance(e, OSError):
        return _os_error(e)
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _flat_tensors(tree: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    """``{dotted key: global shape}`` of the tensors in a nested state dict (DCP's key scheme)."""
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tuple(tree.shape)  # a DTensor's shape is its global shape
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat_tensors(v, f"{prefix}.{k}"))
    return out


def compare_keys(
    want: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]
) -> tuple[list[str], list[str], list[str]]:
    """``(missing, unexpected, mismatched)``: keys in ``want`` only, in ``saved`` only, other shape."""
    missing = sorted(set(want) - set(saved))
    unexpected = sorted(set(saved) - set(want))
    mismatched = sorted(
        f"{k} (checkpoint {list(saved[k])}, model {list(want[k])})"
        for k in set(want) & set(saved)
        if saved[k] != want[k]
    )
    return missing, unexpected, mismatched


def saved_model_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{"model.<fqn>": global shape}`` of a step folder's model tensors, from its DCP ``.metadata``
    only (no tensor is read). Local; raises what reading the metadata raises."""
    from torch.distributed.checkpoint import FileSystemReader

    return _saved_tensors(FileSystemReader(str(path)).read_metadata(), ("model.",))


def _saved_tensors(metadata, prefixes: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k: tuple(m.size)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and k.startswith(prefixes)
    }


def _listing(title: str, keys: list[str], limit: int = 12) -> str:
    if not keys:
        return ""
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return f"{title} ({len(keys)}): {', '.join(keys[:limit])}{more}"


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model,
    optimizer,
    allow_partial: bool = False,
    config_diff: list[str] | None = None,
) -> dict[str, float | int]:
    """Load ``path`` into the (sharded) model and optimizer at the current world size (collective).

    Strict by default: the checkpoint must hold exactly the model's tensor keys with the same
    global shapes, and the optimizer's state keys, else ``CheckpointError`` lists every missing,
    unexpected and mismatched key (with shapes) and ``config_diff`` (the config fields that differ).
    ``allow_partial``: load the model keys that match, keep the others as initialised, and load the
    optimizer state only if all of it matches; what was and was not loaded is logged.
    Returns ``{"step", "lr", "seed"}`` of the checkpoint. Errors name the path.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = _state_dict(model, optimizer)  # also materialises the (empty) optimizer state to load into
    saved = _saved_tensors(FileSystemReader(str(path)).read_metadata(), ("model.", "optim.state."))
    model_keys = _flat_tensors(sd["model"], "model")
    want = {**model_keys, **_flat_tensors(sd["optim"].get("state", {}), "optim.state")}
    missing, unexpected, mismatched = compare_keys(want, saved)
    load_optim = True
    if missing or unexpected or mismatched:
        report = "; ".join(
            filter(
                None,
                [
                    _listing("missing from the checkpoint", missing),
                    _listing("unexpected in the checkpoint", unexpected),
                    _listing("shape mismatch", mismatched),
                    _listing("config differs", config_diff or []),
                ],
            )
        )
        if not allow_partial:
            matching = len(model_keys) - len(set(missing) | {m.split(" ")[0] for m in mismatched})
            partial = (
                ", or pass --checkpoint.allow_partial true to load only the matching keys"
                if matching > 0
                else "; no model tensor of it matches, so --checkpoint.allow_partial cannot help"
            )
            raise CheckpointError(
                f"checkpoint {path} does not match the model: {report} (resume with the config it "
                f"was saved with{partial})"
            )
        bad = set(missing) | {m.split(" ")[0] for m in mismatched}
        keep = [k for k in model_keys if k not in bad]
        load_optim = not any(k.startswith("optim.") for k in bad | set(unexpected))
        sd["model"] = {k: v for k, v in sd["model"].items() if f"model.{k}" in keep}
        logger.warning(
            "--checkpoint.allow_partial: loading %d of %d model tensors from %s (%s); optimizer state %s",
            len(keep),
            len(model_keys),
            path,
            report,
            "loaded" if load_optim else "NOT loaded (starts fresh)",
        )
        if not load_optim:
            del sd["optim"]
    sd["train"] = {
        "step": torch.tensor(0, dtype=torch.int64),
        "lr": torch.tensor(0.0, dtype=torch.float64),
        "seed": torch.tensor(0, dtype=torch.int64),
    }
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot load checkpoint {path}: {_short(e)}") from e
    set_model_state_dict(model, sd["model"], options=StateDictOptions(strict=not allow_partial))
    if load_optim:
        set_optimizer_state_dict(model, optimizer, sd["optim"])
    return {k: v.item() for k, v in sd["train"].items()}
