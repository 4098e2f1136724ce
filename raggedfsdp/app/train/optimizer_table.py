"""The one table of the job's optimizers: what ``--optim`` accepts, the layout each needs, and the
bytes per parameter that ``estimate-memory --recipe <name>`` counts for it.

The job (``train/optimizers.py``: building, ``shard_placement_fn``), the config's checks and help
(``train/config_schema.py``), the memory estimator (``sizing/memory_estimate.py``) and the
``estimate-memory`` command read from here; ``tests/unit/test_optimizer_table.py`` checks that each
reader lists every name and that the byte counts match the optimizers' real state. Imports no torch
(``raggedfsdp --help`` must not).
"""

from __future__ import annotations

from dataclasses import dataclass

# 8-bit block-wise AdamW: one uint8 per element per moment + one fp32 absmax per 32x32 tile and moment
# (raggedfsdp.optim.AdamW8bit's tiles).
ADAMW8BIT_BLOCK = 32 * 32
# Shampoo's statistics: L, R and their inverse roots, each B x B fp32 per B x B block (full blocks).
SHAMPOO_BLOCK = 128


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer of the job.

    ``layout``: the ``fully_shard`` block policy it needs: ``None`` (the default element layout) or
    the name of the optimizer class whose ``shard_placement_fn`` gives it. ``state_bytes``: bytes per
    parameter the optimizer keeps besides the fp32 master weights (its moments / statistics), for
    the estimator's mixed-precision recipe of the same name.
    """

    name: str
    summary: str
    layout: str | None
    state_bytes: float
    state_note: str


OPTIMIZER_TABLE: dict[str, OptimizerSpec] = {
    s.name: s
    for s in (
        OptimizerSpec(
            "adamw",
            "torch.optim.AdamW",
            None,
            8,
            "2 fp32 AdamW moments",
        ),
        OptimizerSpec(
            "muon",
            "raggedfsdp.optim.Muon + AdamW for embeddings/head/norms",
            None,
            4,
            "1 fp32 Muon momentum",
        ),
        OptimizerSpec(
            "adamw8bit",
            "raggedfsdp.optim.AdamW8bit, 32x32-tile layout",
            "AdamW8bit",
            2 * (1 + 4 / ADAMW8BIT_BLOCK),
            f"2 uint8 AdamW moments with one fp32 scale per {ADAMW8BIT_BLOCK} elements",
        ),
        OptimizerSpec(
            "shampoo",
            "raggedfsdp.optim.Shampoo, 128-row-band layout",
            "Shampoo",
            8 + 4 * 4,
            f"2 fp32 grafting moments + L, R and their inverse roots per {SHAMPOO_BLOCK}x{SHAMPOO_BLOCK} "
            "block",
        ),
    )
}

OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZER_TABLE)


def optimizer_help() -> str:
    """``--optim``'s help: every name with its summary."""
    return " | ".join(f"{s.name} ({s.summary})" for s in OPTIMIZER_TABLE.values()) + "; also picks the layout"


__all__ = ["ADAMW8BIT_BLOCK", "OPTIMIZER_NAMES", "OPTIMIZER_TABLE", "OptimizerSpec", "optimizer_help"]
