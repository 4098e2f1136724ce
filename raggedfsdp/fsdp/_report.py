"""What the runtime reports about its FSDP units, for measurers (``raggedfsdp.app.bench``) and tests.

:func:`fsdp_units` walks a model and returns one :class:`FSDPUnit` per ``fully_shard`` call (FSDP unit)
under it: its planned layout, the dtype of its sharded parameters and the flat storages the runtime
holds for it right now (``buffer/lifecycle.py:UnitBuffers.storages`` plus the kept post-forward
slice of ``reshard_after_forward=int``). A measurer reads these instead of the runtime's private
fields, so the runtime may rename its internals without breaking a benchmark.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from raggedfsdp.fsdp._common import state_of
from raggedfsdp.planner.layout import Layout

__all__ = ["FSDPUnit", "fsdp_units"]


class FSDPUnit(NamedTuple):
    """One FSDP unit as the runtime reports it (local to this rank; no collective).

    ``layout``: the planner's layout (``shard_size`` S, ``total_size`` m*S, ``total_numel``,
    ``padding`` in elements, ``world_size`` m); ``orig_dtype``: the dtype of the sharded parameters;
    ``storages``: the runtime's own flat 1-D buffers of this unit (sharded params ``(S,)``, unsharded
    params / grads ``(m*S,)``, accumulator, sharded grads, kept post-forward slice), those that exist;
    a freed one has 0 bytes of storage."""

    layout: Layout
    orig_dtype: torch.dtype
    storages: tuple[torch.Tensor, ...]

    @property
    def padding_bytes(self) -> int:
        """The layout's padding in bytes of ``orig_dtype`` (what the sharded buffers carry beyond the
        unit's elements; the unsharded buffers carry it at ``param_dtype``)."""
        return int(self.layout.padding) * torch.empty((), dtype=self.orig_dtype).element_size()


def fsdp_units(module: torch.nn.Module) -> list[FSDPUnit]:
    """One :class:`FSDPUnit` per ``raggedfsdp.fully_shard`` unit in ``module.modules()`` order (a unit
    with no parameters, e.g. a root whose parameters all sit in its children, is skipped). Empty for
    a model not sharded by raggedfsdp (torch's ``fully_shard`` included). Local, any rank."""
    out, seen = [], set()
    for m in module.modules():
        g = getattr(state_of(m), "group", None)
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        extra = (g.post_forward_buf,) if g.post_forward_buf is not None else ()
        out.append(FSDPUnit(g.layout, g.orig_dtype, tuple(g.bufs.storages()) + extra))
    return out
