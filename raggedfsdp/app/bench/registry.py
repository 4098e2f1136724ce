"""Model families ``raggedfsdp bench`` can run, and how each is wrapped into FSDP units.

A ``BenchModel`` says how to build an (un-sharded, initialised) model from the bench arguments and
which wrapping policies it supports: ``wraps[name](model, mesh, backend, mp_policy, **fsdp_kw)`` applies
``backend``'s ``fully_shard`` in place (``backend`` is ``"ragged"`` or ``"torch"``, so both systems
get the same units; ``fsdp_kw``: further ``apply_fsdp`` options, e.g. ``all_gather_dtype``). Add a
family with ``register_bench_model``; ``--model NAME`` and ``--wrap POLICY`` then accept it. The bench
never needs to know the model's structure beyond that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no torch at import: ``raggedfsdp bench --help`` lists the models without it
    from torch import nn

WrapFn = Callable[["nn.Module", Any, str, Any], "nn.Module"]


def wrap_units(unit: str) -> WrapFn:
    """Wrap with :func:`raggedfsdp.app.models.apply_fsdp` and FSDP unit ``unit`` (the one vocabulary of
    ``models/parallelize.py``: ``layer | superblock | layers:K``), then the root. ``layers:K`` makes one
    ``fully_shard([blocks...])`` per ``K`` blocks: fewer, larger collectives than ``layer``."""

    def wrap(model: nn.Module, mesh: Any, backend: str, mp_policy: Any, **fsdp_kw: Any) -> nn.Module:
        from raggedfsdp.app.models import apply_fsdp

        return apply_fsdp(model, mesh, backend=backend, mp_policy=mp_policy, unit=unit, **fsdp_kw)

    return wrap


def _default_wraps() -> dict[str, WrapFn]:
    return {u: wrap_units(u) for u in ("layer", "layers:2", "layers:4")}


@dataclass(frozen=True)
class BenchModel:
    """A benchmarkable model family.

    ``build(args)`` returns the model on the CPU, initialised with ``init_weights(args.seed)``
    (the bench moves it to the device); it reads ``args.flavor`` (``None``: ``default_flavor``),
    ``args.n_layers`` and family-specific flags such as ``args.experts``. ``wraps`` maps a policy
    name to its wrap function; the first one is the default.
    """

    name: str
    build: Callable[[Any], nn.Module]
    default_flavor: str
    wraps: dict[str, WrapFn] = field(default_factory=_default_wraps)
    description: str = ""


BENCH_MODELS: dict[str, BenchModel] = {}


def register_bench_model(model: BenchModel) -> BenchModel:
    """Add (or replace) a family under ``model.name``; returns it."""
    BENCH_MODELS[model.name] = model
    return model


def get_bench_model(name: str) -> BenchModel:
    """The family ``name``; ``ValueError`` naming the choices if unknown."""
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {name!r}; choose one of {sorted(BENCH_MODELS)}")
    return BENCH_MODELS[name]


def _overrides(args, *keys) -> dict:
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _build_dense(args) -> nn.Module:
    from raggedfsdp.app.models import build_model

    m = build_model("llama", args.flavor or "small", **_overrides(args, "n_layers"))
    m.init_weights(args.seed)
    return m


def _build_moe(args) -> nn.Module:
    from raggedfsdp.app.models import build_model

    kw = _overrides(args, "n_layers", "n_experts", "top_k")
    if getattr(args, "experts", None):
        kw["experts"] = args.experts
    m = build_model("moe", args.flavor or "moe-small", **kw)
    m.init_weights(args.seed)
    return m


register_bench_model(
    BenchModel(
        "dense",
        _build_dense,
        "small",
        description="LLaMA-style decoder (raggedfsdp.app.models.llama), one FSDP unit per block",
    )
)
register_bench_model(
    BenchModel(
        "moe",
        _build_moe,
        "moe-small",
        description="LLaMA-style MoE (app.models.moe), --experts separate|fused, one unit per block",
    )
)
