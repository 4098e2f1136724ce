"""Planning with expert parallelism (EP): which FSDP group each parameter is sharded over, shapes only.

torchtitan's layout, as ``raggedfsdp.app.models.apply_ep`` + ``apply_fsdp(experts_mesh=)`` build it: the
``world_size = M`` data-parallel ranks form ``M / ep`` groups of ``ep`` EP ranks; each EP rank keeps
``E / ep`` whole experts of every MoE layer, and FSDP shards

- the routed experts (an EP rank's ``E/ep`` of them) over the ``M / ep`` ranks holding the same experts
  (``dp_shard_mod_ep``), one FSDP unit ``<layer>.experts`` per MoE layer;
- every other parameter (attention, router, shared experts, norms, embeddings) over all ``M`` ranks.

So EP caps the FSDP group of the experts (the paper's "cross-node EP to cap the FSDP collective group
size", veScale-FSDP section 6) and shrinks the experts a rank all-gathers by ``ep``. Expert tensors are
recognised by name: a fused stack ``...experts.<name>`` whose dim 0 is the expert count (gpt-oss
``gate_up_proj (E, H, 2I)``, our MoE's ``w1 (E, D, F)``), or separate experts ``...experts.<j>.<...>``
(mixtral, qwen-moe, deepseek; ``shared_experts`` are not routed experts).

Single-device reference: the plan of the EP-local units is :func:`raggedfsdp.planner.plan_model` on
them, so every per-unit figure is the planner's own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from raggedfsdp.app.sizing.archs import Shape, Unit
from raggedfsdp.app.sizing.modelplan import ModelPlan, plan_model

__all__ = ["EPPlan", "plan_model_ep", "split_units_for_ep"]

_SEPARATE = re.compile(r"(?:^|\.)experts\.(\d+)\.")
_FUSED = re.compile(r"(?:^|\.)experts\.[^.]+$")


def _n_experts(unit: Unit) -> int | None:
    """Routed experts of ``unit`` (None: not an MoE unit)."""
    ids = {int(m.group(1)) for n, _ in unit.params if (m := _SEPARATE.search(n))}
    if ids:
        return max(ids) + 1
    lead = {s[0] for n, s in unit.params if _FUSED.search(n) and len(s) >= 2}
    if len(lead) > 1:
        raise ValueError(
            f"unit {unit.name}: fused expert stacks disagree on the expert count: {sorted(lead)}"
        )
    return lead.pop() if lead else None


def split_units_for_ep(units: Sequence[Unit], ep: int) -> tuple[list[Unit], list[Unit]]:
    """``(units without routed experts, one EP-local experts unit per MoE unit)`` for EP size ``ep``.

    The experts unit of ``u`` is named ``f"{u.name}.experts"`` and holds what EP rank 0 keeps: fused
    stacks with dim 0 divided by ``ep``, separate experts ``0 .. E/ep - 1`` (every EP rank's unit has the
    same shapes). ``ep=1`` returns the units unchanged and no experts unit.

    Raises:
        ValueError: ``ep < 1``, no MoE unit while ``ep > 1``, or an expert count not divisible by ``ep``.
    """
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r}: the expert-parallel size must be an int >= 1")
    if ep == 1:
        return list(units), []
    dense, experts = [], []
    for u in units:
        E = _n_experts(u)
        if E is None:
            dense.append(u)
            continue
        if E % ep:
            raise ValueError(
                f"--ep {ep}: unit {u.name} has {E} experts, not divisible by {ep}; pick a divisor of {E}"
            )
        keep_e = E // ep
        rest: list[tuple[str, Shape]] = []
        mine: list[tuple[str, Shape]] = []
        for n, s in u.params:
            if (m := _SEPARATE.search(n)) is not None:
                if int(m.group(1)) < keep_e:
                    mine.append((n, s))
            elif _FUSED.search(n) and len(s) >= 2 and s[0] == E:
                mine.append((n, (keep_e, *s[1:])))
            else:
                rest.append((n, s))
        dense.append(Unit(u.name, tuple(rest)))
        experts.append(Unit(f"{u.name}.experts", tuple(mine)))
    if not experts:
        raise ValueError(f"--ep {ep}: the model has no routed experts to split (a dense model: use --ep 1)")
    return dense, experts


@dataclass(frozen=True)
class EPPlan:
    """The two plans of a model under EP: ``dense`` over ``world_size`` ranks, ``experts`` over
    ``world_size / ep`` (``None`` when ``ep == 1``)."""

    world_size: int
    ep: int
    dense: ModelPlan
    experts: ModelPlan | None

    @property
    def experts_group(self) -> int:
        """FSDP group size of the expert units (``dp_shard_mod_ep``)."""
        return self.world_size // self.ep

    @property
    def shard_numel(self) -> int:
        """Elements one rank holds, padding included (the sum of its shards over all units)."""
        return sum(u.layout.shard_size for p in self.plans for u in p.units)

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (every EP rank's experts counted once)."""
        return self.dense.numel + (self.experts.numel * self.ep if self.experts is not None else 0)

    @property
    def plans(self) -> tuple[ModelPlan, ...]:
        return (self.dense,) if self.experts is None else (self.dense, self.experts)

    def layer_all_gather(self, layer: str) -> tuple[int, int]:
        """``(ours, FSDP2)`` elements all-gathered for one layer (its unit, plus its experts unit under EP).

        Ours: ``m * shard_size`` per unit (one flat buffer of equal shards). FSDP2: every tensor's dim 0
        padded to a multiple of ``m`` (``fsdp2_padding``), ``m`` the unit's FSDP group size.
        """
        ours = fsdp2 = 0
        for plan in self.plans:
            for u in plan.units:
                if u.name in (layer, f"{layer}.experts"):
                    ours += plan.world_size * u.layout.shard_size
                    fsdp2 += u.layout.total_numel + u.fsdp2_padding
        return ours, fsdp2

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "ep": self.ep,
            "experts_group": self.experts_group,
            "shard_numel": self.shard_numel,
            "dense": self.dense.to_dict(tensors=False),
            "experts": None if self.experts is None else self.experts.to_dict(tensors=False),
        }


def plan_model_ep(units: Sequence[Unit], world_size: int, ep: int = 1, **plan_kw) -> EPPlan:
    """Plan ``units`` with EP size ``ep`` (see the module docstring); ``plan_kw`` go to ``plan_model``.

    Raises:
        ValueError: as :func:`split_units_for_ep`, or ``ep`` not dividing ``world_size``.
    """
    if isinstance(ep, int) and ep >= 1 and world_size % ep:
        raise ValueError(
            f"--ep {ep} must divide --world-size {world_size} (the world is (world/ep) x ep ranks); "
            f"use one of {[d for d in range(1, world_size + 1) if world_size % d == 0][:10]}"
        )
    dense, experts = split_units_for_ep(units, ep)
    dplan = plan_model(dense, world_size, **plan_kw)
    eplan = plan_model(experts, world_size // ep, **plan_kw) if experts else None
    return EPPlan(world_size, ep, dplan, eplan)
