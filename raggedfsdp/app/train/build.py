"""Building the training run's model: its meshes, tensor / expert parallelism, compile, and FSDP.

:class:`raggedfsdp.app.train.trainer.Trainer` calls :func:`build_parallel_model` once, at build time; every
rank must call it (``init_device_mesh`` and ``fully_shard`` are collective). The model families and the
FSDP unit vocabulary are ``raggedfsdp.app.models``'; this module maps ``[model]``, ``[fsdp]`` and
``[parallel]`` onto them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp.app.models import (
    apply_compile,
    apply_ep,
    apply_fsdp,
    apply_tp,
    build_model,
    build_model_config,
    make_mp_policy,
    parse_dtype,
)
from raggedfsdp.app.train.config import TrainConfig
from raggedfsdp.app.train.optimizers import shard_placement_fn_for

logger = logging.getLogger(
    "raggedfsdp.app.train.trainer"
)  # the trainer's logger: the same log lines as before

__all__ = ["build_parallel_model", "meshes"]


def meshes(cfg: TrainConfig, device: torch.device, world_size: int):
    """``(dp mesh, tp mesh or None)``: 1-D ``("dp",)`` without TP / HSDP, else the 3-D
    ``(dp_replicate, dp_shard, tp)`` mesh's dp part (``(dp_replicate, dp_shard)`` for HSDP) and its tp dim."""
    par = cfg.parallel
    if par.tp == 1 and par.dp_replicate == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",)), None
    shard = par.dp_shard(world_size)
    mesh = init_device_mesh(
        device.type, (par.dp_replicate, shard, par.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    dp = mesh["dp_replicate", "dp_shard"] if par.dp_replicate > 1 else mesh["dp_shard"]
    return dp, (mesh["tp"] if par.tp > 1 else None)


def build_parallel_model(cfg: TrainConfig, device: torch.device, world_size: int):
    """Collective: ``(model, model config)`` with the model built, initialised from ``job.seed`` (or
    ``model.init_from``'s safetensors) and sharded: TP DTensors on ``"tp"`` (``--parallel.tp``), experts
    over ``"ep"`` (``--parallel.ep``), then FSDP over the data-parallel dims (``--fsdp.*``).
    ``model.init_device = "meta"`` builds on the meta device and materialises after ``fully_shard``."""
    t = cfg.training
    model_cfg = build_model_config(cfg.model.name, cfg.model.flavor, **cfg.model_overrides())
    ep = cfg.parallel.ep
    tp_mesh = None
    ep_kw: dict[str, Any] = {}
    if ep > 1:  # (dp, ep): experts over "ep", their FSDP over "dp", everything else over both
        world_mesh = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))
        mesh = world_mesh["dp", "ep"]._flatten("dp_ep")
        ep_kw["experts_mesh"] = world_mesh["dp"]
    else:
        mesh, tp_mesh = meshes(cfg, device, world_size)  # (dp_replicate, dp_shard, tp) with --parallel.*
    mp_policy = make_mp_policy(
        cfg.fsdp.backend, param_dtype=cfg.fsdp.param_dtype, reduce_dtype=cfg.fsdp.reduce_dtype
    )
    fsdp_kw = dict(
        backend=cfg.fsdp.backend,
        mp_policy=mp_policy,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        shard_placement_fn=shard_placement_fn_for(cfg.optimizer.name),
        unit=cfg.fsdp.unit,
        all_gather_dtype=cfg.fsdp.all_gather_dtype,
        **ep_kw,
    )
    if cfg.model.init_device == "meta":
        with torch.device("meta"):
            model = build_model(cfg.model.name, cfg.model.flavor, **cfg.model_overrides())
        if tp_mesh is not None:
            apply_tp(model, tp_mesh)
        if t.compile:  # per block, before fully_shard (the FSDP hooks stay eager)
            apply_compile(model)
        apply_fsdp(model, mesh, **fsdp_kw)
        model.to_empty(device=device)
        model.init_weights(cfg.job.seed)
    else:
        model = build_model(cfg.model.name, cfg.model.flavor, **cfg.model_overrides())
        model.init_weights(cfg.job.seed)
        model.to(device)
        if tp_mesh is not None:
            apply_tp(model, tp_mesh)  # TP DTensors on "tp", then FSDP over the dp dims (Note [FSDP x TP])
        if ep > 1:
            apply_ep(model, world_mesh["ep"])
        if t.compile:
            apply_compile(model)
        apply_fsdp(model, mesh, **fsdp_kw)
    if cfg.fsdp.reduce_scatter_wire_dtype != "none":  # gradients travel in bf16, summed in reduce_dtype
        model.set_reduce_scatter_wire_dtype(parse_dtype(cfg.fsdp.reduce_scatter_wire_dtype))
    if cfg.model.init_from:  # HF safetensors: each rank reads its own pieces (convert.py)
        from raggedfsdp.app.checkpoint.hf import load_hf_weights

        load_hf_weights(model, cfg.model.init_from)
        logger.info("loaded the initial weights from %s (Hugging Face safetensors)", cfg.model.init_from)
    return model, model_cfg
