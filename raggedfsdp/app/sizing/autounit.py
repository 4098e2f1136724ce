"""Choose the FSDP unit size: the fewest decoder layers per unit whose whole-model padding meets a target.

With one unit per decoder layer, block granularity has an arithmetic floor at large FSDP sizes
(``docs/planner.md``): once a unit's big tensors each span two or more shards, ``S`` must be a
multiple of the lcm of their block sizes, and that step can be as large as ``E/M`` itself. A unit
of ``K`` layers has ``K`` times the elements per rank while the lcm step stays the same, so the
rounding loss shrinks -- at the price of all-gathering ``K`` layers at once (memory trade-off in
``docs/planner.md``).

:func:`choose_unit_size` tries ``K = 1, 2, ...`` (layers per unit, or hybrid super-blocks per unit)
and returns the smallest ``K`` whose planned whole-model padding is ``<= target``. The embedding and
head units stay separate, as in ``unit="layer"``. Each ``K`` is first screened with the order-free
lower bound (:func:`~raggedfsdp.planner.planner.lower_bound_from_items`, computed from the distinct
``(numel, granularity)`` pairs of each group of layers, without planning): a ``K`` whose bound is
already above the target is skipped, and when no ``K`` meets the target the minimum bound over all
``K`` is reported -- if it is above the target, no ``K`` can meet it, whatever the order or planner.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from raggedfsdp.app.sizing.archs import _req, layers_per_unit, load_config, model_units
from raggedfsdp.app.sizing.modelplan import ModelPlan, as_policy, plan_model, resolve_unit_blocks
from raggedfsdp.planner.planner import lower_bound_from_items
from raggedfsdp.planner.policy import BlockSpec, Policy

DEFAULT_TARGET = 0.03


@dataclass(frozen=True)
class UnitTry:
    """One ``K`` looked at: its order-free bound and, if planned, the planner's padding (ratios)."""

    k: int
    bound_ratio: float
    padding_ratio: float | None  # None: not planned (its bound already rules it out)


@dataclass(frozen=True)
class UnitChoice:
    """Result of :func:`choose_unit_size`.

    ``k`` is the chosen number of base blocks (layers, or super-blocks for ``base="superblock"``)
    per unit: the smallest meeting the target, or -- when none does (``met`` False) -- the one with
    the least planned padding. ``plan`` is the whole-model plan at ``k``; ``unit`` the equivalent
    explicit spec (``"layers:N"``) for :func:`~raggedfsdp.app.sizing.archs.model_units` and the CLI.
    ``min_bound_ratio`` is the smallest order-free bound over ``K = 1 .. max_k`` (at
    ``min_bound_k``): above ``target`` it proves that no ``K`` can meet it.
    """

    k: int
    base: str
    layers_per_unit: int
    unit: str
    target: float
    met: bool
    plan: ModelPlan
    max_k: int
    min_bound_ratio: float
    min_bound_k: int
    tries: tuple[UnitTry, ...]
    seconds: float

    @property
    def padding_ratio(self) -> float:
        return self.plan.padding_ratio

    def summary(self) -> str:
        """One line: the chosen ``K`` and padding, or why the target is out of reach."""
        what = "layers" if self.base == "layer" else f"{self.base}s"
        t = f"{100 * self.target:g}%"
        if self.met:
            prev = next((x for x in self.tries if x.k == self.k - 1), None)
            why = ""
            if prev is not None:
                got = "bound" if prev.padding_ratio is None else "plan"
                val = prev.bound_ratio if prev.padding_ratio is None else prev.padding_ratio
                why = f"; K={self.k - 1}: {got} {100 * val:.3f}%"
            return (
                f"unit auto: K={self.k} {what} per unit (--unit {self.unit}) is the smallest K with padding "
                f"<= {t}: {100 * self.padding_ratio:.3f}%{why}"
            )
        proof = (
            f"order-free bound over every K >= {100 * self.min_bound_ratio:.3f}% (K={self.min_bound_k}), "
            f"so no K can reach {t}"
            if self.min_bound_ratio > self.target
            else f"smallest order-free bound {100 * self.min_bound_ratio:.3f}% (K={self.min_bound_k}) is not "
            f"above {t}: not proven unreachable"
        )
        return (
            f"unit auto: no K in 1..{self.max_k} {what} per unit reaches padding <= {t}; best K={self.k} "
            f"(--unit {self.unit}): {100 * self.padding_ratio:.3f}%; {proof}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "base": self.base,
            "layers_per_unit": self.layers_per_unit,
            "unit": self.unit,
            "target": self.target,
            "met": self.met,
            "padding_ratio": self.padding_ratio,
            "max_k": self.max_k,
            "min_bound_ratio": self.min_bound_ratio,
            "min_bound_k": self.min_bound_k,
            "search_seconds": self.seconds,
            "tries": [[x.k, x.bound_ratio, x.padding_ratio] for x in self.tries],
        }


def _base_of(cfg: dict, base: str) -> str:
    if base != "auto":
        return base
    try:
        layers_per_unit(cfg, "superblock")
    except ValueError:
        return "layer"
    return "superblock"


def choose_unit_size(
    model: str | dict,
    world_size: int,
    *,
    policy: Policy | BlockSpec | str | None = None,
    target: float = DEFAULT_TARGET,
    align: int = 1,
    order: str = "default",
    max_k: int | None = None,
    base: str = "auto",
    search_best: bool = True,
) -> UnitChoice:
    """The smallest number ``K`` of layers (or super-blocks) per FSDP unit with padding ``<= target``.

    Args:
        model: built-in name, ``config.json`` path or config dict (as :func:`model_units`).
        world_size, policy, align, order: as :func:`~raggedfsdp.app.sizing.modelplan.plan_model`.
        target: whole-model padding ratio to reach (padding / padded buffer elements).
        max_k: largest ``K`` tried (default: every base block in one unit).
        base: ``"layer"``, ``"superblock"`` (hybrid models: ``K`` counts super-blocks of
            ``full_attention_interval`` layers) or ``"auto"`` (super-blocks for hybrids, else layers).
        search_best: when no ``K`` meets the target, find the ``K`` with the least planned padding
            (planning ``K`` in order of their bounds until no bound can beat the best); ``False``:
            settle for the best ``K`` already planned (or the one with the least bound) -- enough to
            learn *whether* a target is reachable.

    Returns:
        A :class:`UnitChoice`. ``K`` is minimal: every smaller ``K`` was planned (or its bound was
        already above the target) and missed the target. Units hold ``K`` consecutive base blocks
        from the first layer (the last unit may hold fewer); embedding and head units are separate.

    Cost: one O(distinct pairs) bound per distinct group of blocks and ``K``, and one
    :func:`plan_model` for each ``K`` whose bound is within the target (usually one or two).

    Raises:
        ValueError: bad ``world_size``/``target``/``max_k``/``base``, or a bad model (as
            :func:`model_units`); ``BlockError`` for a block that does not fit a tensor.
    """
    t0 = time.perf_counter()
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not target >= 0:
        raise ValueError(f"target={target!r} must be a padding ratio >= 0 (e.g. 0.03)")
    cfg = load_config(model) if isinstance(model, str) else dict(model)
    base = _base_of(cfg, base)
    if base not in ("layer", "superblock"):
        raise ValueError(f"base={base!r} must be 'layer', 'superblock' or 'auto'")
    per = layers_per_unit(cfg, base)
    n_blocks = -(-_req(cfg, "num_hidden_layers") // per)
    if max_k is None:
        max_k = n_blocks
    if max_k < 1:
        raise ValueError(f"max_k={max_k} must be >= 1")
    max_k = min(max_k, n_blocks)
    pol = as_policy(policy)
    m = world_size

    # Per base block: total elements and distinct (numel, granularity) pairs; identical blocks share an id.
    units = model_units(cfg, base)
    edges, blocks = [units[0], units[-1]], units[1:-1]
    cache: dict = {}
    sig_ids: dict[tuple[int, frozenset], int] = {}
    sigs: list[tuple[int, frozenset]] = []
    block_ids = []
    for u in blocks:
        grans = resolve_unit_blocks(u, pol, cache)[0]
        numels = [math.prod(s) for _, s in u.params]
        key = frozenset((e, g) for e, g in zip(numels, grans) if e > 0)
        full = (sum(numels), key)
        if full not in sig_ids:
            sig_ids[full] = len(sigs)
            sigs.append(full)
        block_ids.append(sig_ids[full])
    edge_total = edge_pad = 0
    for u in edges:
        grans = resolve_unit_blocks(u, pol, cache)[0]
        numels = [math.prod(s) for _, s in u.params]
        e = sum(numels)
        edge_total += e
        edge_pad += m * lower_bound_from_items(e, zip(numels, grans), m, align) - e
    total = edge_total + sum(sigs[i][0] for i in block_ids)

    group_bound: dict[tuple[int, ...], int] = {}

    def bound_ratio(k: int) -> float:
        pad = edge_pad
        for start in range(0, len(block_ids), k):
            ids = tuple(block_ids[start : start + k])
            b = group_bound.get(ids)
            if b is None:
                e = sum(sigs[i][0] for i in ids)
                items = frozenset().union(*(sigs[i][1] for i in set(ids)))
                b = group_bound[ids] = m * lower_bound_from_items(e, items, m, align) - e
            pad += b
        return pad / (total + pad) if total + pad else 0.0

    def plan(k: int) -> ModelPlan:
        us = units if k == 1 else model_units(cfg, f"layers:{k * per}")  # K = 1: the base units themselves
        return plan_model(us, m, policy=pol, align=align, order=order)

    bounds = {k: bound_ratio(k) for k in range(1, max_k + 1)}
    plans: dict[int, ModelPlan] = {}
    chosen = None
    for k in range(1, max_k + 1):
        if bounds[k] <= target:
            plans[k] = plan(k)
            if plans[k].padding_ratio <= target:
                chosen = k
                break
    met = chosen is not None
    if not met:
        # Least planned padding over all K: visit K by bound; stop once no bound can beat the best.
        by_bound = sorted(bounds, key=lambda k: (bounds[k], k))
        visit = by_bound if search_best else (sorted(plans) or by_bound[:1])
        best = None
        for k in visit:
            if best is not None and search_best:
                rb = plans[best].padding_ratio
                if bounds[k] > rb or (bounds[k] == rb and k > best):
                    break
            if k not in plans:
                plans[k] = plan(k)
            r = plans[k].padding_ratio
            if best is None or r < plans[best].padding_ratio or (r == plans[best].padding_ratio and k < best):
                best = k
        chosen = best
    kb = min(bounds, key=lambda k: (bounds[k], k))
    tries = tuple(
        UnitTry(k, bounds[k], plans[k].padding_ratio if k in plans else None) for k in sorted(bounds)
    )  # every K has a bound; only K within the target (or needed for the best) was planned
    return UnitChoice(
        k=chosen,
        base=base,
        layers_per_unit=chosen * per,
        unit=f"layers:{chosen * per}",
        target=target,
        met=met,
        plan=plans[chosen],
        max_k=max_k,
        min_bound_ratio=bounds[kb],
        min_bound_k=kb,
        tries=tries,
        seconds=time.perf_counter() - t0,
    )
