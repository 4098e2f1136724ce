"""Is this checkpoint this run's model and config? Checked before the launch (``run_dir.prepare``) and
at the load (``run_checkpoints``): the one place both read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from raggedfsdp.app.train.config import TrainConfig

__all__ = ["check_resume_model", "config_diff"]


def check_resume_model(cfg: TrainConfig, path: Path) -> None:
    """Before the launch: ``ValueError`` when the step folder ``path`` holds another
    model than ``cfg`` builds, one line, the cause first: how many model tensors differ, the first one,
    the model fields whose saved value differs, and the fix (``--checkpoint.allow_partial true`` only when
    some tensors match). Compares the global shapes of the model's state dict, built on the meta device
    (no memory, no process group), with the checkpoint's DCP metadata; the load repeats the full check
    (optimizer state included) on every rank. Nothing is checked with ``--checkpoint.allow_partial``,
    or when the model cannot be built here (the load reports it)."""
    from raggedfsdp.app.checkpoint.dcp import compare_keys, saved_model_shapes
    from raggedfsdp.app.models import build_model

    if cfg.checkpoint.allow_partial:
        return
    try:
        with torch.device("meta"):
            model = build_model(cfg.model.name, cfg.model.flavor, **cfg.model_overrides())
        want = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
        saved = saved_model_shapes(path)
    except Exception:  # noqa: BLE001 - the in-rank load check still runs
        return
    missing, unexpected, mismatched = compare_keys(want, saved)
    if not (missing or unexpected or mismatched):
        _check_resume_optimizer(cfg, path)
        return
    counts = [
        f"{len(mismatched)} of this model's {len(want)} tensors have another shape" if mismatched else "",
        f"{len(missing)} of this model's {len(want)} tensors are not in it" if missing else "",
        f"{len(unexpected)} of its tensors are not in this model" if unexpected else "",
    ]
    first = [
        *mismatched,
        *(f"{k} (not in the checkpoint)" for k in missing),
        *(f"{k} (not in the model)" for k in unexpected),
    ][0]
    fields = [d for d in config_diff(cfg, path) if d.startswith("model.")]
    differs = f"; saved with {', '.join(fields)}" if fields else ""
    matching = len(want) - len(missing) - len(mismatched)
    fix = f", or --checkpoint.allow_partial true to load the {matching} that match" if matching > 0 else ""
    raise ValueError(
        f"--resume: {path} holds another model: {', '.join(filter(None, counts))} (e.g. {first}){differs}; "
        f"resume it with the model it was saved with, or start a new run with another --out{fix}"
    )


def _check_resume_optimizer(cfg: TrainConfig, path: Path) -> None:
    """Before the launch: ``ValueError`` when ``path/meta.json`` records another optimizer than
    ``--optim`` (its state has other keys: the load would refuse it on every rank after the launch)."""
    try:
        saved = json.loads((path / "meta.json").read_text())["config"]["optimizer"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    now = cfg.optimizer.name
    if saved != now:
        raise ValueError(
            f"--resume: {path} was saved with --optim {saved} and this run uses --optim {now}: "
            f"the {saved} state cannot be loaded into {now}; resume with --optim {saved}, start a new "
            f"run with another --out, or pass --checkpoint.allow_partial true to load the model "
            f"weights only ({now} starts with fresh state)"
        )


def config_diff(cfg: TrainConfig, path: Path) -> list[str]:
    """``"section.key: saved -> now"`` for the training-relevant fields that differ from the
    config recorded in ``path/meta.json`` (empty when it records none)."""
    try:
        saved = json.loads((path / "meta.json").read_text()).get("config") or {}
    except (OSError, ValueError):
        return []
    now = cfg.to_dict()
    diff = []
    for sec in ("model", "training", "optimizer", "fsdp", "data"):
        for key, value in now.get(sec, {}).items():
            if key in saved.get(sec, {}) and saved[sec][key] != value:
                diff.append(f"{sec}.{key}: {saved[sec][key]!r} -> {value!r}")
    return diff
