"""Parameter groups for Muon: hidden matrices to Muon, everything else to AdamW (dion / Moonlight
practice)."""

from __future__ import annotations

from torch import nn


def muon_param_groups(
    model: nn.Module,
    *,
    lr: float = 0.02,
    weight_decay: float = 0.1,
    adamw_lr: float = 3e-4,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.0,
    head_names: tuple[str, ...] = ("output", "lm_head"),
) -> list[dict]:
    """Split ``model``'s trainable parameters into a Muon group and an AdamW group for :class:`Muon`.

    Muon gets the 2-D weights and 3-D expert stacks ``(E, d, h)`` of hidden layers. AdamW
    (``algorithm="adamw"``) gets embeddings (``nn.Embedding`` weights), the output head (a module
    whose name ends with one of ``head_names``, or a weight tied to an embedding), norms, biases and
    every other parameter. Works on plain and on ``fully_shard``-ed models (global shapes are used).

    Returns:
        ``[{"params": [...], "algorithm": "muon", "lr", "weight_decay"},
        {"params": [...], "algorithm": "adamw", "lr", "betas", "eps", "weight_decay"}]``; an empty
        group is dropped.
    """
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head_ids = set()
    for name, mod in model.named_modules():
        if name and name.split(".")[-1] in head_names:
            head_ids.update(id(p) for p in mod.parameters(recurse=False))
    muon, adamw = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim in (2, 3) and id(p) not in embed_ids and id(p) not in head_ids:
            muon.append(p)
        else:
            adamw.append(p)
    groups = [
        {"params": muon, "algorithm": "muon", "lr": lr, "weight_decay": weight_decay},
        {
            "params": adamw,
            "algorithm": "adamw",
            "lr": adamw_lr,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        },
    ]
    return [g for g in groups if g["params"]]
