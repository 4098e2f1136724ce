"""Persistent training memory per rank for ZeRO stages 0-3, from a parameter count or from shapes.

Pure arithmetic: nothing is allocated, no process group, no GPU. The source of the stage
definitions is ZeRO (Rajbhandari et al., 2020, section 5) as the seed lesson on DP/ZeRO/FSDP
computes it:

==========  ====================  ===================  =====================
stage       model weights         gradients            optimizer state
==========  ====================  ===================  =====================
0 (DDP)     replicated            replicated           replicated
1           replicated            replicated           sharded
2           replicated            sharded              sharded
3 (FSDP)    sharded               sharded              sharded
==========  ====================  ===================  =====================

"Optimizer state" is everything the optimizer keeps per parameter, including an fp32 master copy
when the model weights are kept in a lower precision. With the default mixed-precision recipe
(bf16 weights and grads, fp32 master + two fp32 AdamW moments = 2 + 2 + 12 = 16 bytes/parameter)
a 27e9-parameter model holds 432 GB of persistent state; on 64 ranks stage 1 needs
``4 * 27e9 + 12 * 27e9 / 64`` = 113 GB per rank, stage 2 ``2 * 27e9 + 14 * 27e9 / 64`` = 59.9 GB and
stage 3 ``16 * 27e9 / 64`` = 6.75 GB (decimal GB, 1 GB = 1e9 bytes).

Sharded state with known shapes: a sharded tensor is not ``numel / M`` per rank but the planner's
shard size ``S`` of its FSDP unit (:func:`raggedfsdp.planner.plan_layout`: equal shards, whole
blocks, alignment), summed over units -- the same layout ``raggedfsdp.fully_shard`` allocates, so the
figure includes its real padding. With a bare parameter count the shard is ``ceil(P / M)``.

HSDP (``replicate > 1``): the ``world_size`` ranks form ``replicate`` groups of
``M = world_size / replicate`` ranks; sharded state is split over ``M`` (each replica keeps a copy).

Not included (they are transient, not persistent): activations, the unsharded parameters and
gradients of the FSDP units in flight (see :attr:`MemoryEstimate.working_bytes` for an estimate),
communication buffers, allocator fragmentation and the CUDA context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raggedfsdp.app.sizing.archs import Unit
from raggedfsdp.app.sizing.modelplan import resolve_unit_blocks
from raggedfsdp.app.train.optimizer_table import OPTIMIZER_TABLE, OptimizerSpec
from raggedfsdp.planner.planner import plan_layout
from raggedfsdp.planner.policy import DEFAULT_BLOCK, make_policy

__all__ = [
    "RECIPES",
    "MemoryEstimate",
    "Recipe",
    "StageMemory",
    "estimate_memory",
    "format_bytes",
    "format_report",
]

GB = 1e9  # decimal gigabyte, as the lesson and cloud vendors count


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each persistent state, and what they are.

    ``param`` is the model's working weights (what forward reads), ``grad`` the gradients, and
    ``optim`` everything the optimizer keeps (fp32 master weights included) -- what ZeRO-1 shards.
    """

    name: str
    param: float
    grad: float
    optim: float
    description: str
    param_dtype: str = "bf16"

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optim


def _optimizer_recipe(spec: OptimizerSpec) -> Recipe:
    """bf16 params + grads, fp32 master weights + the optimizer's own state (``--recipe <optimizer>``)."""
    total = 2 + 2 + 4 + spec.state_bytes
    return Recipe(
        spec.name,
        2,
        2,
        4 + spec.state_bytes,
        f"bf16 params + grads, fp32 master, {spec.state_note} ({total:.4g} B/param)",
    )


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("mixed", 2, 2, 12, "bf16 params + grads, fp32 master + 2 fp32 AdamW moments (16 B/param)"),
        Recipe("bf16", 2, 2, 4, "pure bf16: bf16 params, grads and 2 AdamW moments, no master (8 B/param)"),
        Recipe(
            "fp32",
            4,
            4,
            8,
            "fp32 params + grads + 2 fp32 AdamW moments, no separate master (16 B/param; "
            "raggedfsdp train's default --param-dtype fp32)",
            param_dtype="fp32",
        ),
        # one per optimizer of the job except adamw (= "mixed")
        *(_optimizer_recipe(s) for s in OPTIMIZER_TABLE.values() if s.name != "adamw"),
    )
}


@dataclass(frozen=True)
class StageMemory:
    """Persistent bytes per rank of one ZeRO stage."""

    stage: int
    params: float
    grads: float
    optim: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "params_bytes": self.params,
            "grads_bytes": self.grads,
            "optim_bytes": self.optim,
            "total_bytes": self.total,
        }


@dataclass(frozen=True)
class MemoryEstimate:
    """Result of :func:`estimate_memory`; all sizes in bytes (floats: 8-bit scales are fractional)."""

    num_params: int
    world_size: int
    replicate: int
    recipe: Recipe
    shard_numel: int
    """Elements of one rank's shard, summed over units (padding included)."""
    padding_numel: int
    """``M * shard_numel - num_params``: padding elements over one shard group (TP: over the ``M x tp``
    ranks of one FSDP group per TP rank, ``tp * (M * shard_numel - TP-local numel)``)."""
    stages: tuple[StageMemory, ...]
    shapes_known: bool
    working_bytes: float = 0.0
    """ZeRO-3 transient estimate: the two largest units unsharded (one computing, one prefetched),
    weights and gradients, at ``recipe.param``/``recipe.grad`` bytes per element. 0 without shapes."""
    units: tuple[tuple[str, int, int], ...] = field(default=())
    """``(unit name, numel, shard size)`` per unit when shapes are known."""
    ep: int = 1
    """Expert-parallel size: ``<layer>.experts`` units are sharded over ``shard_world / ep`` ranks."""
    tp: int = 1
    """Tensor-parallel size: every unit holds TP-local shapes, sharded over ``shard_world`` ranks."""

    @property
    def shard_world(self) -> int:
        """The FSDP group size ``world / (replicate x tp)``."""
        return self.world_size // (self.replicate * self.tp)

    @property
    def padding_ratio(self) -> float:
        """Padding / the elements the shards of one ``shard_world x tp`` slice hold (their sum)."""
        held = self.shard_world * self.tp * self.shard_numel
        return self.padding_numel / held if held else 0.0

    @property
    def total_bytes(self) -> float:
        """Persistent state of one model copy (no padding): ``num_params * recipe.total``."""
        return self.num_params * self.recipe.total

    def stage(self, k: int) -> StageMemory:
        return self.stages[k]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_params": self.num_params,
            "world_size": self.world_size,
            "replicate": self.replicate,
            "shard_world": self.shard_world,
            "ep": self.ep,
            "experts_shard_world": self.shard_world // self.ep,
            "tp": self.tp,
            "recipe": self.recipe.name,
            "bytes_per_param": {
                "params": self.recipe.param,
                "grads": self.recipe.grad,
                "optim": self.recipe.optim,
                "total": self.recipe.total,
            },
            "total_bytes": self.total_bytes,
            "shapes_known": self.shapes_known,
            "shard_numel": self.shard_numel,
            "padding_numel": self.padding_numel,
            "padding_ratio": self.padding_ratio,
            "zero3_working_bytes": self.working_bytes,
            "stages": [s.to_dict() for s in self.stages],
        }


def format_bytes(n: float) -> str:
    """Decimal units, 3 significant figures: ``113 GB``, ``59.9 GB``, ``6.75 GB``, ``432 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"estimate_memory: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"estimate_memory: {name} must be >= {minimum}, got {value}")
    return value


def estimate_memory(
    num_params: float | None = None,
    *,
    units: Sequence[Unit] | None = None,
    world_size: int,
    recipe: str | Recipe = "mixed",
    replicate: int = 1,
    policy: Any = None,
    align: int | None = None,
    ep: int = 1,
    tp: int = 1,
) -> MemoryEstimate:
    """Persistent memory per rank for ZeRO stages 0, 1, 2 and 3.

    Args:
        num_params: parameter count (e.g. ``27e9``; must be a whole number). Give this or ``units``.
        units: FSDP units with shapes (:func:`raggedfsdp.app.sizing.archs.model_units`, or
            :func:`raggedfsdp.app.models.model_units` for the built-in models): sharded state is then the
            planner's per-rank shard of each unit (``order="best"``, default ``element`` blocks), padding
            included, exactly what ``raggedfsdp.fully_shard`` allocates.
        world_size: data-parallel ranks (all of them, replicas included).
        recipe: a :data:`RECIPES` name or a :class:`Recipe`.
        replicate: HSDP replica groups; must divide ``world_size`` (1: plain FSDP/ZeRO).
        policy: block policy for the planner (a block spec such as ``"row"`` or ``"rows:32"``, or an
            ``orig_param_policy``); default ``element`` (fully_shard's default, ``DEFAULT_BLOCK``).
        align: shard-size multiple in elements; default 16 bytes at the narrowest of the recipe's
            param dtype and fp32, as ``fully_shard`` does (4 for fp32, 8 with bf16).
        ep: expert-parallel size (needs ``units``; :mod:`raggedfsdp.app.sizing.ep`): each rank keeps 1/ep of
            every MoE layer's routed experts, sharded over ``M / ep`` ranks (their units are reported
            as ``<layer>.experts``); everything else over ``M``. ``num_params`` stays the whole model's.
        tp: tensor-parallel size (needs ``units`` of a dense model; :mod:`raggedfsdp.app.sizing.tp`): every
            matrix is split over ``tp`` ranks (Megatron column / row), the FSDP group is
            ``M = world_size / (replicate x tp)`` and the planner plans the TP-local shapes over it; a block
            spec is defined on the global shape (``row``: one row of the TP-local tensor). ``num_params``
            stays the whole model's; stages 0-2 hold one TP rank's replica.

    Returns:
        A :class:`MemoryEstimate` (bytes per rank per stage, padding, a ZeRO-3 working-set estimate).

    Raises:
        ValueError: neither or both of ``num_params``/``units``, a non-whole or negative count,
            ``world_size < 1``, ``replicate`` not dividing ``world_size``, an unknown recipe, ``ep > 1``
            without ``units``, not dividing ``M``, or on a model without routed experts, ``tp > 1`` without
            ``units``, with ``ep > 1`` (EP x TP is not supported), ``replicate x tp`` not dividing
            ``world_size``, or a matrix with no TP rule / a dim not divisible by ``tp``.
        TypeError: a non-integer ``world_size``/``replicate``.
    """
    world_size = _check_int("world_size", world_size, 1)
    replicate = _check_int("replicate", replicate, 1)
    if world_size % replicate:
        raise ValueError(
            f"estimate_memory: replicate={replicate} must divide world_size={world_size} (HSDP groups "
            f"of world_size / replicate ranks); use a divisor such as {_divisors(world_size)}"
        )
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"estimate_memory: unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
        recipe = RECIPES[recipe]
    if (num_params is None) == (units is None):
        raise ValueError("estimate_memory: give exactly one of num_params (a count) or units (shapes)")
    ep = _check_int("ep", ep, 1)
    tp = _check_int("tp", tp, 1)
    global_numel = None
    if tp > 1:
        from raggedfsdp.app.sizing.tp import split_units_for_tp, tp_fsdp_group

        if units is None:
            raise ValueError(
                "estimate_memory: tp > 1 needs units (shapes: --model), not a bare parameter count"
            )
        if ep > 1:
            raise ValueError(
                f"estimate_memory: tp={tp} with ep={ep}: EP x TP is not supported "
                "(raggedfsdp.app.models.apply_tp has no expert TP plan); estimate one of them"
            )
        tp_fsdp_group(world_size, tp, replicate)
        global_numel = sum(u.numel for u in units)
        units = split_units_for_tp(units, tp)
    m = world_size // (replicate * tp)
    unit_rows: list[tuple[str, int, int]] = []
    working = 0.0
    groups = [(units, m)]
    if ep > 1:
        from raggedfsdp.app.sizing.ep import split_units_for_ep

        if units is None:
            raise ValueError(
                "estimate_memory: ep > 1 needs units (shapes: --model), not a bare parameter count"
            )
        if m % ep:
            raise ValueError(
                f"estimate_memory: ep={ep} must divide the FSDP group size {m} (world / replicate)"
            )
        dense, experts = split_units_for_ep(units, ep)
        groups = [(dense, m), (experts, m // ep)]
    if units is not None:
        if align is None:
            align = 8 if recipe.param_dtype == "bf16" else 4
        pol = make_policy(policy or DEFAULT_BLOCK) if policy is None or isinstance(policy, str) else policy
        cache: dict = {}
        plans: dict[tuple, int] = {}
        gathered = []  # (elements all-gathered, unit row)
        count = 0
        for group_units, g in groups:
            for u in group_units:
                shapes = tuple(s for _, s in u.params)
                if (shapes, g) not in plans:
                    grans, _, _ = resolve_unit_blocks(u, pol, cache)
                    numels = [math.prod(s) for s in shapes]
                    plans[shapes, g] = plan_layout(
                        numels, grans, g, align=align, order="best", shapes=shapes
                    ).shard_size
                unit_rows.append((u.name, u.numel, plans[shapes, g]))
                gathered.append(g * plans[shapes, g])
                count += u.numel * (m // g)  # an experts unit: every EP rank holds its own 1/ep
        shard = sum(s for _, _, s in unit_rows)
        biggest = sorted(gathered, reverse=True)[:2]
        working = sum(biggest) * (recipe.param + recipe.grad)
    else:
        if isinstance(num_params, float):
            if not (num_params >= 0 and num_params.is_integer()):
                raise ValueError(
                    f"estimate_memory: num_params must be a whole number >= 0, got {num_params!r}"
                )
            num_params = int(num_params)
        count = _check_int("num_params", num_params, 0)
        shard = -(-count // m)
    # EP: a rank's replica has 1/ep of the experts; TP: a rank's replica is TP-local
    full = float(count if ep == 1 and tp == 1 else sum(n for _, n, _ in unit_rows))
    padding = m * shard - count
    if global_numel is not None:  # every TP rank's shards over its FSDP group, minus the model
        padding, count = tp * padding, global_numel
    sh = float(shard)
    r = recipe
    stages = (
        StageMemory(0, full * r.param, full * r.grad, full * r.optim),
        StageMemory(1, full * r.param, full * r.grad, sh * r.optim),
        StageMemory(2, full * r.param, sh * r.grad, sh * r.optim),
        StageMemory(3, sh * r.param, sh * r.grad, sh * r.optim),
    )
    return MemoryEstimate(
        num_params=count,
        world_size=world_size,
        replicate=replicate,
        recipe=r,
        shard_numel=shard,
        padding_numel=padding,
        stages=stages,
        shapes_known=units is not None,
        working_bytes=working,
        units=tuple(unit_rows),
        ep=ep,
        tp=tp,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:8]


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def format_report(est: MemoryEstimate, *, label: str = "") -> str:
    """The text table of ``raggedfsdp estimate-memory``."""
    r = est.recipe
    m = est.shard_world
    hsdp = f" (HSDP: {est.replicate} replicas x {m} ranks)" if est.replicate > 1 else ""
    if est.ep > 1:
        hsdp += f", EP {est.ep} (routed experts sharded over {m // est.ep} ranks, the rest over {m})"
    if est.tp > 1:
        hsdp += f", TP {est.tp} (TP-local shapes sharded over FSDP groups of {m} ranks)"
    src = f"{label}: " if label else ""
    lines = [
        f"{src}{est.num_params:,} params ({_count(est.num_params)}), world size {est.world_size}{hsdp}",
        f"recipe {r.name}: {r.description}",
        f"persistent state, one copy: {format_bytes(est.total_bytes)} "
        f"({r.total:g} B/param x {est.num_params:,})",
    ]
    if est.shapes_known:
        pad = est.padding_ratio
        lines.append(
            f"planner shards: {est.shard_numel:,} elements per rank over {len(est.units)} units, "
            f"padding {est.padding_numel:,} elements ({100 * pad:.3f}%)"
        )
    lines.append(f"{'stage':<12} {'params':>10} {'grads':>10} {'optimizer':>10} {'total/rank':>11}")
    names = {0: "0 (DDP)", 1: "1", 2: "2", 3: "3 (FSDP)"}
    for s in est.stages:
        lines.append(
            f"{'ZeRO-' + names[s.stage]:<12} {format_bytes(s.params):>10} {format_bytes(s.grads):>10} "
            f"{format_bytes(s.optim):>10} {format_bytes(s.total):>11}"
        )
    if est.shapes_known:
        lines.append(
            f"ZeRO-3 working set (not included): ~{format_bytes(est.working_bytes)} for the two largest "
            "units unsharded (weights + grads); activations come on top"
        )
    else:
        lines.append("shapes unknown: shards are ceil(P / M), no planner padding (pass --model for it)")
    return "\n".join(lines)
