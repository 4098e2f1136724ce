"""Planning with tensor parallelism (TP): the TP-local shape of every parameter, shapes only.

The TP plan is Megatron-LM's column / row split (Shoeybi et al. 2019, section 3) as
``raggedfsdp.app.models.apply_tp`` and torchtitan's ``parallelize_llama`` apply it, recognised by name in
both vocabularies (Hugging Face and ``raggedfsdp.app.models``):

============================================  ==========================  =========================
parameter (last module name)                  TP placement                TP-local shape
============================================  ==========================  =========================
``q_proj k_proj v_proj gate_proj up_proj``    colwise ``Shard(0)``        ``(out / tp, in)``,
``wq wk wv w1 w3`` (+ their biases)                                       bias ``(out / tp,)``
``o_proj down_proj wo w2``                    rowwise ``Shard(1)``        ``(out, in / tp)``, bias whole
``embed_tokens tok_embeddings``               rowwise embedding           ``(vocab / tp, dim)``
``lm_head output``                            colwise ``Shard(0)``        ``(vocab / tp, dim)``
any vector (norms, q/k norms, sinks)          ``Replicate()``             unchanged
============================================  ==========================  =========================

Any other matrix -- routed experts, routers, MLA's low-rank projections,
Gated DeltaNet -- has no TP rule here and raises ``ValueError`` (as ``apply_tp``, whose plan is the
dense Llama's): EP x TP is not supported; use ``--ep`` for MoE models.

FSDP x TP then plans, shards and all-gathers each TP-local tensor over the ``world / (tp x replicate)``
ranks of its FSDP group (Note [FSDP x TP] in ``raggedfsdp/fsdp/_tp.py``), the block of a block spec being
defined on the global shape (``raggedfsdp.planner.granularity_for_local``): a unit returned here carries
the global shapes in ``Unit.global_shapes`` for that check.

Single-device reference: ``tests/unit/test_plan_tp.py`` compares these shapes and the plans with what
``apply_tp`` + ``fully_shard`` really allocate on a fake process group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from raggedfsdp.app.sizing.archs import Shape, Unit
from raggedfsdp.app.sizing.modelplan import ModelPlan, plan_model

__all__ = ["plan_model_tp", "split_units_for_tp", "tp_fsdp_group", "tp_split_dim"]

_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv", "w1", "w3")
_ROWWISE = ("o_proj", "down_proj", "wo", "w2")
_VOCAB = ("embed_tokens", "tok_embeddings", "lm_head", "output")
_EXPERTS = re.compile(r"(?:^|\.)(?:experts|shared_experts?|block_sparse_moe)\.")


def tp_split_dim(name: str, shape: Sequence[int]) -> int | None:
    """The dim TP splits of parameter ``name`` (``None``: replicated over TP). Pure.

    Raises:
        ValueError: a matrix with no TP rule (routed experts, routers, MLA, linear attention), naming it.
    """
    parts = name.split(".")
    mod, leaf = (parts[-2] if len(parts) >= 2 else ""), parts[-1]
    if len(shape) < 2:
        if leaf == "bias" and mod in _COLWISE and not _EXPERTS.search(name):
            return 0
        return None
    if len(shape) == 2 and leaf == "weight" and not _EXPERTS.search(name):
        if mod in _COLWISE or mod in _VOCAB:
            return 0
        if mod in _ROWWISE:
            return 1
    raise ValueError(
        f"--tp: no tensor-parallel rule for parameter {name!r} of shape {tuple(shape)}: the TP plan is the "
        "dense Llama's (q/k/v/o, gate/up/down, embedding, LM head; raggedfsdp.app.models.apply_tp). Routed "
        "experts, routers, MLA and linear attention are not tensor-parallel here (EP x TP is not "
        "supported): use --tp 1, or --ep N for a mixture of experts"
    )


def split_units_for_tp(units: Sequence[Unit], tp: int) -> list[Unit]:
    """The units with every parameter's TP-local shape (what one TP rank holds) for TP size ``tp``.

    Each returned unit keeps the global shapes in ``global_shapes`` (one per parameter) so the planner can
    check that no TP boundary cuts a block. ``tp=1`` returns the units unchanged.

    Raises:
        ValueError: ``tp < 1``, a matrix with no TP rule (:func:`tp_split_dim`), or a split dim not divisible
            by ``tp`` (naming the parameter, its shape and the divisors that would work).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp {tp!r}: the tensor-parallel size must be an int >= 1")
    if tp == 1:
        return list(units)
    out = []
    for u in units:
        params: list[tuple[str, Shape]] = []
        for n, s in u.params:
            d = tp_split_dim(n, s)
            if d is None:
                params.append((n, s))
                continue
            if s[d] % tp:
                ok = [k for k in range(2, 65) if s[d] % k == 0][:6]
                raise ValueError(
                    f"--tp {tp}: parameter {n!r} of shape {tuple(s)}: dim {d} ({s[d]}) does not split "
                    f"evenly over "
                    f"{tp} TP ranks (FSDP x TP needs one TP-local shape on every rank); use a --tp in {ok}"
                )
            params.append((n, tuple(x // tp if i == d else x for i, x in enumerate(s))))
        out.append(Unit(u.name, tuple(params), tuple(s for _, s in u.params)))
    return out


def tp_fsdp_group(world_size: int, tp: int, replicate: int = 1) -> int:
    """The FSDP group size ``world / (replicate x tp)`` (the mesh is ``replicate x dp_shard x tp``). Pure.

    Raises:
        ValueError: ``tp`` or ``replicate`` < 1, or ``replicate x tp`` not dividing ``world_size`` (naming
        both
            and the TP sizes that would fit).
    """
    for flag, v in (("--tp", tp), ("--replicate", replicate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} {v!r}: must be an int >= 1")
    if world_size % (tp * replicate):
        ok = [d for d in (1, 2, 4, 8, 16) if world_size % (d * replicate) == 0]
        raise ValueError(
            f"--tp {tp} x --replicate {replicate} must divide --world-size {world_size} (the world is "
            f"replicate x dp_shard x tp ranks); use a --tp in {ok}"
        )
    return world_size // (tp * replicate)


def plan_model_tp(units: Sequence[Unit], world_size: int, tp: int = 1, **plan_kw) -> ModelPlan:
    """``plan_model`` of the TP-local units over the FSDP group of ``world_size / tp`` ranks.

    Returns the :class:`~raggedfsdp.app.sizing.modelplan.ModelPlan` (its ``world_size`` is the FSDP group
    size).

    Raises:
        ValueError: as :func:`tp_fsdp_group` and :func:`split_units_for_tp`; ``BlockError`` for a block cut
            by a TP boundary.
    """
    m = tp_fsdp_group(world_size, tp)
    return plan_model(split_units_for_tp(units, tp), m, **plan_kw)
