"""Structure-aware optimizers on RaggedShard parameters (veScale-FSDP section 5; docs/optim.md).

* :class:`Muon` -- distributed Muon: one Newton-Schulz per matrix per step on one owner rank.
* :class:`AdamW8bit` -- block-wise 8-bit AdamW with per-tile scales local to each rank.
* :class:`Shampoo` -- block-diagonal Shampoo with AdamW grafting, whole blocks on their owner rank.
* :func:`muon_param_groups` -- matrices to Muon, the rest to AdamW.
* :func:`clip_grad_norm_` / :func:`get_total_norm` -- gradient clipping over parameters on different meshes.
* :mod:`raggedfsdp.optim.reference` -- single-device reference implementations (test oracles);
  the kernels they share with the distributed optimizers live in ``_newton_schulz`` and ``_quant``.
"""

from raggedfsdp.optim._newton_schulz import ns_flops
from raggedfsdp.optim.adamw8bit import AdamW8bit, tile_placement_fn
from raggedfsdp.optim.clip import clip_grad_norm_, get_total_norm
from raggedfsdp.optim.muon import Muon
from raggedfsdp.optim.param_groups import muon_param_groups
from raggedfsdp.optim.shampoo import Shampoo, shampoo_placement_fn

__all__ = [
    "AdamW8bit",
    "Muon",
    "Shampoo",
    "clip_grad_norm_",
    "get_total_norm",
    "muon_param_groups",
    "ns_flops",
    "shampoo_placement_fn",
    "tile_placement_fn",
]
