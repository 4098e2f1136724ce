"""The training run's checkpoint hooks: which step folder to resume, loading it, saving a step.

:class:`raggedfsdp.app.train.trainer.Trainer` calls these at its lifecycle points (build: resume; the loop:
save at ``checkpoint.interval``, at the last step and on an interrupt). The files themselves (DCP step
folders, manifests, verification) are ``raggedfsdp.app.checkpoint``'s; this module only maps the run's
config onto them. Nothing here is collective except :func:`load_run_checkpoint` and
:func:`save_run_checkpoint` (every rank calls them, as ``torch.distributed.checkpoint`` requires).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from raggedfsdp.app.checkpoint.dcp import CheckpointError, load_checkpoint, resolve_resume, save_checkpoint
from raggedfsdp.app.train import run_dir
from raggedfsdp.app.train.config import TrainConfig
from raggedfsdp.app.train.optimizers import apply_hparams
from raggedfsdp.app.train.resume_check import config_diff

logger = logging.getLogger(
    "raggedfsdp.app.train.trainer"
)  # the trainer's logger: the same log lines as before

__all__ = [
    "config_change_notice",
    "load_run_checkpoint",
    "pick_resume",
    "save_run_checkpoint",
]


def pick_resume(cfg: TrainConfig, run: run_dir.PreparedRun, ckpt_folder: Path, run_id: str) -> Path | None:
    """Rank 0 only: the step folder to resume, or ``None`` for a fresh start.

    An explicit ``--resume PATH`` was resolved and verified once, by ``run_dir.prepare`` (its
    ``resume_path``); ``--resume auto`` picks this run's newest readable step folder. Raises
    :class:`CheckpointError` when every checkpoint of the run is unreadable (starting over would overwrite
    ``metrics.jsonl`` and the old step folders) unless ``--job.overwrite true``."""
    if cfg.checkpoint.resume != "auto":
        return run.resume_path
    notes: list[str] = []
    path = resolve_resume(
        cfg.checkpoint.resume, ckpt_folder, run_id=run_id, verify=cfg.checkpoint.verify, notes=notes
    )
    skipped = [n.split("skipping ", 1)[1] for n in notes if n.startswith("--resume auto: skipping ")]
    if path is None and skipped and not cfg.job.overwrite:
        # every checkpoint of this run is unreadable: starting over would overwrite
        # metrics.jsonl and the old step folders, so refuse
        raise CheckpointError(
            f"--resume auto: no readable checkpoint of run {run_id} under {ckpt_folder}: "
            f"{'; '.join(skipped)}; nothing was changed (resume one with --resume PATH after "
            "repairing it, or start again from step 0 with --job.overwrite true, which overwrites "
            "metrics.jsonl and same-numbered step folders)"
        )
    for note in notes:
        logger.warning("%s", note)
    return path


def config_change_notice(cfg: TrainConfig, path: Path, config_hash: str) -> str | None:
    """The one line a resume prints when ``path`` was saved with another config (its recorded hash
    differs from ``config_hash``), naming the fields that differ (:func:`config_diff`); ``None`` when
    the config is the same or the checkpoint records no hash."""
    try:
        saved_hash = json.loads((path / "meta.json").read_text()).get("config_hash")
    except (OSError, ValueError):
        return None
    if saved_hash is None or saved_hash == config_hash:
        return None
    fields = ", ".join(config_diff(cfg, path)) or "fields not recorded"
    return (
        f"checkpoint {path} was saved with another config ({fields}; hash {saved_hash}, now {config_hash}): "
        "resuming anyway, the losses from here on differ from the original run's"
    )


def load_run_checkpoint(
    path: Path,
    cfg: TrainConfig,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config_hash: str,
    world_size: int,
) -> int:
    """Collective: load ``path`` into ``model`` / ``optimizer`` (any saved world size) and return its
    step (the last completed one). The config stays the source of truth for hyperparameters; a
    different seed or config hash is a warning, not an error."""
    start = time.perf_counter()
    state = load_checkpoint(
        path,
        model=model,
        optimizer=optimizer,
        allow_partial=cfg.checkpoint.allow_partial,
        config_diff=config_diff(cfg, path),
    )
    # The config is the source of truth for hyperparameters (the LR is set every step).
    apply_hparams(optimizer, cfg.optimizer)
    step = int(state["step"])
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if int(state["seed"]) != cfg.job.seed and rank0:  # one line for the job, not one per rank
        logger.warning(
            "checkpoint %s was saved with seed %d, this run uses seed %d: the data order differs "
            "from the original run",
            path,
            int(state["seed"]),
            cfg.job.seed,
        )
    notice = config_change_notice(cfg, path, config_hash)
    if notice and rank0:
        logger.warning("%s", notice)
    logger.info(
        "resumed from %s: step %d (saved lr %.3e), now at world size %d (%.2fs)",
        path,
        step,
        state["lr"],
        world_size,
        time.perf_counter() - start,
    )
    return step


def save_run_checkpoint(
    ckpt_folder: Path,
    step: int,
    lr: float,
    cfg: TrainConfig,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config_hash: str,
    world_size: int,
    run_id: str,
    writer_factory=None,
) -> Path:
    """Collective: write step ``step`` under ``ckpt_folder`` (``checkpoint.dcp.save_checkpoint``) with
    the run's meta (world size, config and its hash, total steps, backend) and return its folder."""
    return save_checkpoint(
        ckpt_folder,
        step,
        model=model,
        optimizer=optimizer,
        lr=lr,
        seed=cfg.job.seed,
        keep_latest=cfg.checkpoint.keep_latest,
        meta={
            "world_size": world_size,
            "config_hash": config_hash,
            "total_steps": cfg.training.steps,
            "backend": cfg.fsdp.backend,
            "config": cfg.to_dict(),
        },
        run_id=run_id,
        writer_factory=writer_factory,
    )
