"""One model resolver for the offline sizing tools (``raggedfsdp plan``, ``raggedfsdp estimate-memory``).

:func:`resolve` turns the ``--model`` text into a :class:`ModelSource`, trying in this order:

1. a shipped preset (``raggedfsdp train --config list``): its real-size table if it has one
   (``llama3-8b``, ``hybrid-27b``, ...), else the model it trains (``llama-tiny`` -> ``llama:tiny``);
2. a built-in real-size table (:data:`raggedfsdp.app.sizing.archs.BUILTIN`);
3. a trainable model of :data:`raggedfsdp.app.models.MODELS` as ``name:flavor`` or ``name-flavor``
   (``hybrid:tiny``, ``llama-debug``);
4. a Hugging Face ``config.json`` path, or a folder holding one.

Tables and ``config.json`` files give a Hugging Face-style config dict (shapes from arithmetic, see
``sizing/archs.py``; ``--unit auto`` needs one); trainable models are built on the meta device and
their units read off :func:`raggedfsdp.app.models.fsdp_unit_modules`, so they are exactly the units
``apply_fsdp`` makes. Units are named with the one vocabulary of ``models/parallelize.py``:
``layer | superblock | layers:K``. Nothing is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raggedfsdp.app.sizing.archs import BUILTIN, Unit, load_config
from raggedfsdp.app.sizing.archs import model_units as table_units

__all__ = ["ModelSource", "model_units", "resolve"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``: ``label`` (how reports name it), and either ``config`` (a Hugging
    Face-style dict: a built-in table or a ``config.json``) or ``family`` + ``flavor`` (a trainable
    model of :data:`raggedfsdp.app.models.MODELS`)."""

    label: str
    config: dict[str, Any] | None = None
    family: str | None = None
    flavor: str | None = None

    def units(self, unit: str = "layer") -> list[Unit]:
        """The FSDP units for ``unit`` (``layer | superblock | layers:K``); ``ValueError`` for a unit
        the model does not have (``superblock`` on a plain model)."""
        if self.config is not None:
            return table_units(self.config, unit)
        return model_units(self.family, self.flavor, unit)


def model_units(name: str, flavor: str, unit: str = "layer", **overrides) -> list[Unit]:
    """The FSDP units of a trainable model as ``Unit``s (shapes only: built on the meta device).

    One unit per ``fully_shard`` call that :func:`raggedfsdp.app.models.apply_fsdp` makes with this
    ``unit``, holding the parameters that call manages, in registration order (the root unit last).
    """
    import torch

    from raggedfsdp.app.models import build_model, fsdp_unit_modules

    with torch.device("meta"):
        model = build_model(name, flavor, **overrides)
    out, seen = [], set()
    for label, modules in fsdp_unit_modules(model, unit):
        params = []
        for i, mod in enumerate(modules):
            prefix = f"{i}." if len(modules) > 1 else ""
            for pname, p in mod.named_parameters(prefix=prefix.rstrip(".")):
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append((pname, tuple(p.shape)))
        out.append(Unit(label, tuple(params)))
    return out


def resolve(name: str) -> ModelSource:
    """The model ``name`` names (see the module docstring for the order). ``ValueError`` naming
    ``name`` and the choices: presets, tables, ``name:FLAVOR`` families, a ``config.json`` path."""
    from raggedfsdp.app.models import MODELS
    from raggedfsdp.app.train.presets import PRESETS

    if name in PRESETS:
        preset = PRESETS[name]
        m = preset.config.get("model", {})
        if preset.arch:
            return ModelSource(preset.arch, config=load_config(preset.arch))
        if m.get("name") in MODELS:
            return ModelSource(name, family=m["name"], flavor=m.get("flavor", "tiny"))
    if name in BUILTIN:
        return ModelSource(name, config=load_config(name))
    for sep in (":", "-"):
        family, found, flavor = name.partition(sep)
        if found and family in MODELS:
            return ModelSource(f"{family}:{flavor}", family=family, flavor=flavor)
    try:
        return ModelSource(name, config=load_config(name))
    except ValueError as exc:
        ours = ", ".join(f"{n}:FLAVOR" for n in sorted(MODELS))
        raise ValueError(f"{exc}; or a built-in model ({ours}, e.g. llama:tiny)") from None
