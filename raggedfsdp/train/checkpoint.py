"""Checkpoints of a training run with torch.distributed.checkpoint (DCP), loadable at any world size.

Layout: ``<checkpoint.folder>/step-N/`` is one DCP checkpoint (``.metadata`` plus one ``.distcp``
file per rank that saved it) and a ``meta.json`` written by rank 0 for humans (step, world size,
config hash). A step folder is written as ``step-N.tmp`` and renamed when every rank has finished,
so a folder named ``step-N`` is always complete.

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
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "config_hash",
    "latest_step_folder",
    "load_checkpoint",
    "resolve_resume",
    "save_checkpoint",
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


def _check_step_folder(path: Path) -> Path:
    """``path`` if it is a readable DCP checkpoint, else a ``CheckpointError`` naming it."""
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
    if "train.step" not in keys or not any(k.startswith("model.") for k in keys):
        raise CheckpointError(f"not a raggedfsdp train checkpoint: {path} (no train.step / model.* entries)")
    return path


def resolve_resume(resume: str, folder: str | os.PathLike) -> Path | None:
    """The step folder to resume from, or None to start fresh.

    ``resume``: ``""`` (no resume), ``"auto"`` (newest complete ``step-N`` under ``folder``, None if
    there is none), a ``step-N`` folder, or a folder of ``step-N`` folders (its newest). Raises
    ``CheckpointError`` naming the path when it is missing, empty or corrupt.
    """
    if not resume:
        return None
    if resume == "auto":
        latest = latest_step_folder(folder)
        return _check_step_folder(latest) if latest is not None else None
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"not a checkpoint: {path} (a file; expected a step-N folder)")
    if (path / ".metadata").exists():
        return _check_step_folder(path)
    latest = latest_step_folder(path)
    if latest is None:
        raise CheckpointError(
            f"not a checkpoint: {path} (no DCP .metadata file and no complete step-N folders inside)"
        )
    return _check_step_folder(latest)


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
) -> Path:
    """Save ``step-N`` under ``folder`` (collective: every rank calls it); prune to ``keep_latest``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    root = Path(folder)
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    start = time.perf_counter()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    sd = _state_dict(model, optimizer)
    sd["train"] = {
        "step": torch.tensor(step, dtype=torch.int64),
        "lr": torch.tensor(lr, dtype=torch.float64),
        "seed": torch.tensor(seed, dtype=torch.int64),
    }
    dcp.save(sd, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's files are written before the folder gets its final name
    if rank == 0:
        with open(tmp / "meta.json", "w") as fh:
            json.dump({"step": step, "lr": lr, "seed": seed, **meta, "saved_at": time.time()}, fh, indent=2)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_latest > 0:
            for _, old in step_folders(root)[:-keep_latest]:
                shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s (%.2fs)", final, time.perf_counter() - start)
    dist.barrier()
    return final


def _short(e: BaseException) -> str:
    """The root error of a (possibly multi-rank) DCP failure, in one line."""
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception}
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        if isinstance(inner, tuple):  # (exception, traceback frames)
            inner = inner[0]
        text = f"{type(inner).__name__}: {inner}".rstrip(": ") if str(inner) else type(inner).__name__
        return f"{text} on rank {rank} (a truncated or corrupt file?)".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]


def load_checkpoint(path: str | os.PathLike, *, model, optimizer) -> dict[str, float | int]:
    """Load ``path`` into the (sharded) model and optimizer at the current world size (collective).

    Returns ``{"step", "lr", "seed"}`` of the checkpoint. Errors name the path.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = _state_dict(model, optimizer)  # also materialises the (empty) optimizer state to load into
    sd["train"] = {
        "step": torch.tensor(0, dtype=torch.int64),
        "lr": torch.tensor(0.0, dtype=torch.float64),
        "seed": torch.tensor(0, dtype=torch.int64),
    }
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot load checkpoint {path}: {_short(e)}") from e
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    return {k: v.item() for k, v in sd["train"].items()}
