"""The training job's optimizers (the names and layouts of ``train/optimizer_table.py``), each with the
layout it needs.

``--optimizer.name`` (``--optim``) picks both the optimizer and the ``shard_placement_fn`` given to
``fully_shard``, so a user never has to know about granularity:

========== ======================================= ==========================================
name       optimizer                               layout (``shard_placement_fn``)
========== ======================================= ==========================================
adamw      ``torch.optim.AdamW`` (foreach)         default (element-wise optimizer)
muon       ``raggedfsdp.optim.Muon``: matrices;    default: owners gather split matrices
           AdamW for embeddings, head, norms       (2 all-to-alls per step)
adamw8bit  ``raggedfsdp.optim.AdamW8bit``          ``AdamW8bit.shard_placement_fn`` (32x32 tiles)
shampoo    ``raggedfsdp.optim.Shampoo`` (blocks of  ``Shampoo.shard_placement_fn`` (whole
           128x128, roots every 10 steps, AdamW    128-row bands)
           grafting; AdamW for vectors)
========== ======================================= ==========================================

Muon runs Newton-Schulz in bfloat16 on accelerators and in float32 on CPU (see ``_ns_dtype``). It uses
``adjust_lr_fn="match_rms_adamw"`` (Moonlight, arXiv 2502.16982: the update's RMS matches
AdamW's) so it shares ``optimizer.lr`` / ``optimizer.weight_decay`` with AdamW; embeddings and the
output head decay, norm gains do not (as for AdamW).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raggedfsdp.app.train.optimizer_table import OPTIMIZER_TABLE


def shard_placement_fn_for(name: str):
    """The ``fully_shard`` block policy optimizer ``name`` needs (``None``: the default layout), from
    :data:`~raggedfsdp.app.train.optimizer_table.OPTIMIZER_TABLE`."""
    layout = OPTIMIZER_TABLE[name].layout
    if layout is None:
        return None
    import raggedfsdp.optim

    return getattr(raggedfsdp.optim, layout).shard_placement_fn


def _ns_dtype(params) -> torch.dtype:
    """bfloat16 Newton-Schulz (torch.optim.Muon's choice) on accelerators; float32 on CPU, where bf16
    GEMMs are ~18x slower than fp32 ones (measured: a 128x352 Newton-Schulz, 1 thread, 205 vs 12 ms)."""
    devs = {p.device.type for p in params}
    return torch.float32 if devs <= {"cpu"} else torch.bfloat16


def build_optimizer(o: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``o.name`` (an ``OptimizerConfig``) over ``model``'s parameters.

    Groups: decayed params first (matrices, embeddings), then ``ndim < 2`` params without decay;
    for Muon the hidden matrices form a leading ``algorithm="muon"`` group.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (o.beta1, o.beta2)
    if o.name == "muon":
        from raggedfsdp.optim import Muon, muon_param_groups

        groups = muon_param_groups(
            model, lr=o.lr, weight_decay=o.weight_decay, adamw_lr=o.lr, adamw_betas=betas, adamw_eps=o.eps
        )
        muon = next((g for g in groups if g["algorithm"] == "muon"), {"params": []})
        rest = [p for g in groups if g["algorithm"] == "adamw" for p in g["params"]]
        adamw = {"algorithm": "adamw", "lr": o.lr, "betas": betas, "eps": o.eps}
        return Muon(
            [
                dict(muon, algorithm="muon"),
                dict(adamw, params=[p for p in rest if p.ndim >= 2], weight_decay=o.weight_decay),
                dict(adamw, params=[p for p in rest if p.ndim < 2], weight_decay=0.0),
            ],
            lr=o.lr,
            weight_decay=o.weight_decay,
            adjust_lr_fn="match_rms_adamw",
            ns_dtype=_ns_dtype(params),
        )
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if o.name == "adamw8bit":
        from raggedfsdp.optim import AdamW8bit

        return AdamW8bit(groups, lr=o.lr, betas=betas, eps=o.eps)
    if o.name == "shampoo":
        from raggedfsdp.optim import Shampoo

        return Shampoo(groups, lr=o.lr, betas=betas, eps=o.eps)
    return torch.optim.AdamW(groups, lr=o.lr, betas=betas, eps=o.eps, foreach=True)


def apply_hparams(optimizer: torch.optim.Optimizer, o: Any) -> None:
    """Re-apply the config's hyperparameters after a checkpoint load (the config is the source of
    truth; the LR is set every step). Muon's own Newton-Schulz ``eps`` is left alone."""
    groups = optimizer.param_groups
    adam_groups = [g for g in groups if g.get("algorithm", "adamw") == "adamw"]
    for g in groups:
        if g.get("algorithm") == "muon":
            g.update(weight_decay=o.weight_decay)
    for g, wd in zip(adam_groups, (o.weight_decay, 0.0)):
        g.update(weight_decay=wd, betas=(o.beta1, o.beta2), eps=o.eps)
