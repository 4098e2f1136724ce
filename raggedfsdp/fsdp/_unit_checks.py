"""One-time checks of a unit's parameters, outside its runtime (``FSDPParamGroup``): the padding
warning at ``fully_shard`` and the resharding of a parameter registered in place of a sharded one."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._common import FSDPParam
from raggedfsdp.placement import RaggedShard
from raggedfsdp.planner import padding_vs_fsdp2

PADDING_WARN_EXCESS = 0.03  # warn when a unit pads this fraction of its elements more than FSDP2 would
_padding_warned: set = set()


def warn_padding(layout, fsdp_params) -> None:
    """Warn once per unit (on global rank 0) when its layout pads ``PADDING_WARN_EXCESS`` of its
    elements more than torch's ``fully_shard`` would (its dim-0 padding): blocks never cut by a rank
    boundary (a block policy: rows, tiles, Shampoo bands) cost memory at large world sizes. The
    default (element granularity, no ``shard_placement_fn``) pads at most ``align`` elements per
    rank and never warns: padding the alignment alone causes (a tiny unit) is not counted. Local."""
    import warnings

    import torch.distributed as dist

    ours, ref = padding_vs_fsdp2(layout)
    lay = layout  # the collective alignment alone (no block) pads each segment to m x align elements
    chunk = lay.world_size * lay.align
    seg = [0] * len(lay.segment_spans)
    for i, e in enumerate(lay.numels):
        seg[lay.segment_of(i)] += e
    aligned = sum(-(-e // chunk) * chunk - e for e in seg) / max(lay.total_numel, 1)
    key = tuple(fp.fqn for fp in fsdp_params)
    if ours - max(ref, aligned) <= PADDING_WARN_EXCESS or key in _padding_warned:
        return
    _padding_warned.add(key)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    coarse = sorted(fsdp_params, key=lambda fp: -fp.granularity)[:3]
    blocks = ", ".join(f"{fp.fqn!r} {tuple(fp.shape)} ({fp.granularity} elements)" for fp in coarse)
    names = ", ".join(key[:4]) + (f", ... ({len(key)} params)" if len(key) > 4 else "")
    warnings.warn(
        f"raggedfsdp.fully_shard: the FSDP unit of {names} pads {ours:.1%} of its "
        f"{layout.total_numel} elements on {layout.world_size} ranks (torch's fully_shard: "
        f"{ref:.1%}) because no rank boundary may cut a block; its largest blocks: {blocks}. Only "
        "structure-aware optimizers need blocks (AdamW8bit, Shampoo: their shard_placement_fn). For "
        "AdamW, SGD and raggedfsdp.optim.Muon leave shard_placement_fn unset (the default, element "
        "granularity, pads least); otherwise give blocks only to the parameters that need them, or "
        "shard over fewer ranks (HSDP: a 2-D mesh)",
        stacklevel=4,
    )


def reshard_replacement(new: torch.Tensor, fp: FSDPParam) -> nn.Parameter:
    """``new`` (a full plain tensor, or a DTensor on the unit's 1-D mesh) as an ``nn.Parameter`` DTensor
    with ``fp``'s spec; ``ValueError`` if that is not possible (see
    ``FSDPParamGroup.adopt_registered_params``). Collective for a DTensor (``full_tensor()``)."""
    mesh, placements = fp.spec.mesh, tuple(fp.spec.placements)
    plain_ok = not isinstance(new, DTensor) and fp.tp_spec is None
    dtensor_ok = isinstance(new, DTensor) and new.device_mesh == mesh
    if new.shape != fp.sharded.shape or mesh.ndim != 1 or not (plain_ok or dtensor_ok):
        what = (
            f"a DTensor with placements {tuple(new.placements)} on {new.device_mesh}"
            if isinstance(new, DTensor)
            else f"a {type(new).__name__} of shape {tuple(new.shape)}"
        )
        raise ValueError(
            f"raggedfsdp: {what} was registered in place of the sharded parameter {fp.fqn!r} (shape "
            f"{tuple(fp.sharded.shape)}, placements {placements}); register a full tensor of that shape "
            "or a DTensor on the parameter's own mesh (e.g. distribute_tensor(full, p.device_mesh, "
            "p.placements), or load through DCP)"
        )
    with torch.no_grad():
        full = new.full_tensor() if isinstance(new, DTensor) else new.detach()
        (pl,) = placements
        if isinstance(pl, RaggedShard):
            local = pl.shard_full(full, mesh.get_local_rank())
        elif pl.is_replicate():
            local = full.clone()
        else:  # not a placement raggedfsdp gives a 1-D unit's params
            raise ValueError(f"raggedfsdp: cannot reshard {fp.fqn!r} to placement {pl}")
        out = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=fp.sharded.shape, stride=fp.sharded.stride()
        )
    return nn.Parameter(out, requires_grad=new.requires_grad)
