"""Plan a unit in segments: each group of tensors sharded evenly on its own (Note [segmented layout]).

Why: a unit that mixes frozen and trainable parameters (LoRA: frozen base weights,
small trainable adapters) planned as one buffer puts each tensor wherever the order and the shard
size leave it. Equal shards balance the *total* bytes, but the trainable tensors are a small,
arbitrary subset: a frozen weight larger than a shard owns whole ranks, and adapters laid out after
the base weights all land on the last rank. The memory a fine-tuning job pays per rank -- trainable
params, their gradients (the compacted :class:`~raggedfsdp.planner.GradLayout` holds each rank's
trainable pieces) and the optimizer state (one state tensor per local piece) -- was then not sharded
(measured: ws 2, rank 1 held every adapter, rank 0 none; torch's ``fully_shard`` splits each
parameter's dim 0 evenly). No single rank-major buffer can fix this in general: a shard that lies
inside a frozen tensor holds no trainable element, whatever the order.

:func:`plan_segments` gives each group its own segment of the buffer: segment ``s`` is planned by
:func:`~raggedfsdp.planner.plan_layout` alone (shard size ``S_s``, the exact minimum for its order),
and each rank's ``(S,)`` shard is the concatenation of its ``S_s`` pieces, ``S = sum S_s``. So every
group is spread over all ranks: a group of ``E_s`` elements puts at most ``S_s`` on any rank, and with
element granularity ``S_s = ceil(E_s / m)`` rounded up to ``align``.

Guarantees, per segment, as :func:`plan_layout`'s: (a) equal shards, (b) no rank boundary cuts a
block, (c) each tensor one contiguous range of the unsharded buffer (inside its segment), (d)
``S_s % align == 0``, and (e) ``S_s`` is the minimum for the segment's order -- so ``S`` is the
minimum over segmented layouts that keep each segment's order (segments are independent). Against one
unsegmented buffer it costs at most ``align`` elements per rank per extra segment of rounding, plus
whatever a block policy's lcm steps cost each segment separately (none with element granularity).
The price at run time: one all-gather per segment instead of one per unit.

All sizes in elements. Pure Python; every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from raggedfsdp.planner.layout import Layout
from raggedfsdp.planner.planner import _check_inputs, plan_layout


def plan_segments(
    numels: Sequence[int],
    granularities: Sequence[int] | None,
    world_size: int,
    segment_ids: Sequence[int],
    *,
    align: int = 1,
    order: str | Sequence[int] = "default",
    shapes: Sequence[Sequence[int]] | None = None,
    names: Sequence[str] | None = None,
) -> Layout:
    """Lay out tensors in segments by ``segment_ids``, each segment sharded evenly over ``world_size``
    ranks on its own (see the module docstring; Note [segmented layout] in ``layout.py``). Pure.

    Args:
        numels, granularities, world_size, align, shapes, names: as :func:`plan_layout` (elements).
        segment_ids: per tensor, an integer ``>= 0``; segments are laid out in increasing id. Tensors
            of a segment whose tensors are all empty (0 elements) join the first non-empty segment.
        order: a named order of :func:`plan_layout` (``"best"`` included), applied within each
            segment, or a permutation of ``range(len(numels))`` whose relative order each segment keeps.

    Returns:
        A :class:`Layout`. With one non-empty segment (or ``world_size == 1``, where segments change
        nothing a rank holds) exactly ``plan_layout``'s result (``segments=None``); otherwise one
        with ``segments = (S_0, S_1, ...)``, ``offsets`` in the segment-major unsharded buffer and
        ``order`` the buffer order.

    Raises:
        ValueError: as :func:`plan_layout`, and for ``segment_ids`` of the wrong length or not
            integers ``>= 0`` (naming the tensor and value).
    """
    n = len(numels)
    if len(segment_ids) != n:
        raise ValueError(
            f"plan_segments: {len(segment_ids)} segment_ids for {n} tensors; give one id per tensor"
        )
    ids = []
    for i, s in enumerate(segment_ids):
        if isinstance(s, bool) or int(s) != s or s < 0:
            who = f"tensor {i} ({names[i]!r})" if names is not None and i < len(names) else f"tensor {i}"
            raise ValueError(f"plan_segments: {who} has segment id {s!r}; ids must be integers >= 0")
        ids.append(int(s))
    kw = dict(align=align, shapes=shapes, names=names)
    numels_l, grans = _check_inputs(
        list(numels),
        None if granularities is None else list(granularities),
        world_size,
        align,
        None if shapes is None else list(shapes),
        None if names is None else list(names),
    )
    total = {}
    for s, e in zip(ids, numels_l):
        total[s] = total.get(s, 0) + e
    live = sorted(s for s, t in total.items() if t > 0)
    if len(live) <= 1 or int(world_size) == 1:
        return plan_layout(numels_l, grans, world_size, order=order, **kw)
    ids = [s if total[s] > 0 else live[0] for s in ids]
    if isinstance(order, str):
        perm = None
    else:
        perm = [int(i) for i in order]
        if sorted(perm) != list(range(n)):
            raise ValueError(f"plan_segments: order={tuple(perm)} is not a permutation of range({n})")
    m, align = int(world_size), int(align)
    offsets = [0] * n
    buffer_order: list[int] = []
    sizes: list[int] = []
    base = 0  # start of the segment in the unsharded buffer
    for s in live:
        idx = [i for i in range(n) if ids[i] == s]
        local = {i: j for j, i in enumerate(idx)}
        sub_order = order if perm is None else [local[i] for i in perm if i in local]
        sub = plan_layout(
            [numels_l[i] for i in idx],
            [grans[i] for i in idx],
            m,
            align=align,
            order=sub_order,
            shapes=None if shapes is None else [shapes[i] for i in idx],
            names=None if names is None else [names[i] for i in idx],
        )
        for j, i in enumerate(idx):
            offsets[i] = base + sub.offsets[j]
        buffer_order.extend(idx[j] for j in sub.order)
        sizes.append(sub.shard_size)
        base += m * sub.shard_size
    return Layout(
        m,
        sum(sizes),
        tuple(numels_l),
        tuple(grans),
        tuple(offsets),
        tuple(buffer_order),
        align,
        None if shapes is None else tuple(tuple(int(d) for d in sh) for sh in shapes),
        None if names is None else tuple(str(x) for x in names),
        tuple(sizes),
    )


def segment_share(layout: Layout, members: Sequence[int]) -> tuple[int, ...]:
    """Per rank, the elements of tensors ``members`` (indices of ``layout``) that the rank holds: its
    share of a group's params, and of their gradients and optimizer state. O(len(members) * m)."""
    out = [0] * layout.world_size
    for i in members:
        for r in layout.ranks_of(i):
            a, b = layout.piece(i, r)
            out[r] += b - a
    return tuple(out)


__all__ = ["plan_segments", "segment_share"]
