"""Granularity policy: from a parameter's block shape to the planner's block size and ``RaggedShard`` dims.

This is the paper's per-parameter hook ``orig_param_policy`` (veScale-FSDP, sections 4 and 5.1),
shaped like FSDP2's ``shard_placement_fn``: a callable ``fn(param_or_shape) -> BlockSpec | str | None``
that says which block of the parameter must never be cut by a rank boundary. ``None`` means the
default, :data:`DEFAULT_BLOCK` = ``"element"``: the least padding, since a layout valid
for any coarser block is valid for elements too. Only structure-aware optimizers need blocks, and
they declare them: ``AdamW8bit.shard_placement_fn`` (32x32 tiles), ``Shampoo.shard_placement_fn``
(whole bands); ``Muon`` needs none (owners gather whole matrices from any pieces). Element pieces
are still contiguous ranges of one flat buffer, so the collectives stay copy-free.

Block kinds (all sizes in **elements**; "rows" are rows of the trailing dim, i.e. the tensor viewed
row-major as ``(numel // shape[-1], shape[-1])``; a vector's rows are its elements):

=================  =====================================  ======================================
spec               block size ``g``                       must hold
=================  =====================================  ======================================
``element``        1                                      --
``row``            ``shape[-1]`` (1 for a vector)          --
``rows:K``         ``K * shape[-1]``                       ``K`` divides the number of rows
``tile:RxC``       ``R * shape[-1]`` (a row-major tile    ``ndim >= 2``; ``R`` divides
                   spans whole rows; edge tiles of a      ``shape[-2]`` (tiles never straddle
                   width not divisible by C are partial   two matrices of a stack)
                   but stay on one rank)
``slice``          ``prod(shape[1:])`` (one dim-0 slice,  --
                   e.g. one expert of a fused stack)
``matrix``         ``numel`` (the whole tensor)           --
=================  =====================================  ======================================

Composition with a ``Shard(dim > 0)`` placement (paper section 1.3): the block becomes
``lcm(g, tensor.stride(dim))`` so a ragged cut never falls inside the sharded dim.

``dims`` for ``RaggedShard``: the shortest prefix ``(0, ..., k-1)``, ``k >= 1``, whose trailing
block ``prod(shape[k:])`` divides ``g`` -- ``(0,)`` when ``g`` is a multiple of a dim-0 slice,
``(0, ..., ndim-2)`` for row multiples of a stack, all dims for element granularity. Each local
unit is then ``g / prod(shape[k:])`` flattened-prefix rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raggedfsdp.planner.layout import Layout
from raggedfsdp.planner.planner import plan_layout

KINDS = ("element", "row", "rows", "tile", "slice", "matrix")


@dataclass(frozen=True)
class BlockSpec:
    """The atomic block of one parameter (see the module table).

    Attributes:
        kind: one of ``element``, ``row``, ``rows``, ``tile``, ``slice``, ``matrix``.
        rows: rows per block for ``rows`` / ``tile`` (1 otherwise).
        cols: tile width for ``tile`` (informational: tiles span whole rows; 0 otherwise).
    """

    kind: str
    rows: int = 1
    cols: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"BlockSpec: kind={self.kind!r} must be one of {KINDS}")
        if self.rows < 1 or self.cols < 0:
            raise ValueError(f"BlockSpec: rows={self.rows} must be >= 1 and cols={self.cols} >= 0")

    @classmethod
    def parse(cls, spec: BlockSpec | str | tuple[int, int]) -> BlockSpec:
        """Parse ``"element"``, ``"row"``, ``"rows:32"``, ``"tile:32x32"``, ``"slice"``, ``"matrix"``
        or a ``(R, C)`` tile."""
        if isinstance(spec, BlockSpec):
            return spec
        if isinstance(spec, tuple) and len(spec) == 2:
            return cls("tile", int(spec[0]), int(spec[1]))
        if not isinstance(spec, str):  # a bad policy result is bad input: ValueError like the rest
            raise ValueError(  # noqa: TRY004
                f"BlockSpec: cannot parse {spec!r}; use a string like 'rows:32' or a (R, C) tile"
            )
        s = spec.strip().lower()
        if s in ("element", "row", "slice", "matrix"):
            return cls(s)
        mt = re.fullmatch(r"rows:(\d+)", s)
        if mt:
            return cls("rows", int(mt.group(1)))
        mt = re.fullmatch(r"tile:(\d+)x(\d+)", s)
        if mt:
            return cls("tile", int(mt.group(1)), int(mt.group(2)))
        raise ValueError(
            f"BlockSpec: cannot parse {spec!r}; expected element | row | rows:K | tile:RxC | slice | matrix"
        )

    def __str__(self) -> str:
        if self.kind == "rows":
            return f"rows:{self.rows}"
        if self.kind == "tile":
            return f"tile:{self.rows}x{self.cols}"
        return self.kind


DEFAULT_BLOCK = BlockSpec("element")
"""The block of a parameter whose policy says nothing (``None``): element granularity, the least padding."""

Policy = Callable[[Any], "BlockSpec | str | None"]
"""``orig_param_policy``: ``fn(param_or_shape) -> BlockSpec | str | None`` (``None``: :data:`DEFAULT_BLOCK`)."""


def ragged_dims(shape: Sequence[int], granularity: int) -> tuple[int, ...]:
    """Shortest non-empty dims prefix ``(0..k-1)`` with ``prod(shape[k:])`` dividing ``granularity``.

    A 0-d tensor gets ``()`` (it is never split). O(ndim).
    """
    nd = len(shape)
    if nd == 0:
        return ()
    for k in range(1, nd + 1):
        tail = math.prod(shape[k:])
        if tail == 0 or granularity % tail == 0:
            return tuple(range(k))
    return tuple(range(nd))  # pragma: no cover - k = nd always matches (tail 1)


def _shape_of(param_or_shape: Any) -> tuple[int, ...]:
    shape = getattr(param_or_shape, "shape", param_or_shape)
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        raise ValueError(f"expected a tensor or a shape, got {param_or_shape!r}") from None


def granularity_for(
    shape: Sequence[int] | Any,
    block: BlockSpec | str | tuple[int, int] | None = None,
    *,
    strides: Iterable[int] = (),
    name: str | None = None,
) -> tuple[int, tuple[int, ...]]:
    """Block size in elements and ``RaggedShard`` dims for a tensor of ``shape`` and a block spec.

    Args:
        shape: the tensor shape (or a tensor; its ``.shape`` is used).
        block: a :class:`BlockSpec`, its string form, a ``(R, C)`` tile, or ``None`` for
            :data:`DEFAULT_BLOCK` (``"element"``).
        strides: element strides of dims carrying a ``Shard(dim > 0)`` placement; the block becomes
            the LCM with each (paper section 1.3).
        name: tensor name for error messages.

    Returns:
        ``(granularity_elements, dims)``; the granularity divides the numel (1 for empty tensors).

    Raises:
        ValueError: negative dims, a block that does not tile the tensor, or a bad stride -- naming
            the tensor, its shape and the offending values.
    """
    shape = _shape_of(shape)
    who = f"tensor {name!r}" if name else f"tensor of shape {shape}"
    if any(d < 0 for d in shape):
        raise ValueError(f"granularity_for: {who} has a negative dim in shape={shape}")
    spec = DEFAULT_BLOCK if block is None else BlockSpec.parse(block)
    numel = math.prod(shape)
    if numel == 0:
        return 1, ragged_dims(shape, 1)
    width = shape[-1] if len(shape) >= 2 else 1  # a vector's rows are its elements
    nrows = numel // width
    if spec.kind == "element":
        g = 1
    elif spec.kind == "row":
        g = width
    elif spec.kind == "rows":
        if nrows % spec.rows:
            raise ValueError(
                f"granularity_for: {who} shape={shape} has {nrows} rows of {width} elements, "
                f"not a multiple of the block's {spec.rows} rows ({spec})"
            )
        g = spec.rows * width
    elif spec.kind == "tile":
        if len(shape) < 2:
            raise ValueError(
                f"granularity_for: {who} shape={shape} is not a matrix; {spec} tiles need ndim >= 2"
            )
        if shape[-2] % spec.rows:
            raise ValueError(
                f"granularity_for: {who} shape={shape} has {shape[-2]} rows per matrix, not a multiple "
                f"of the tile height {spec.rows} ({spec})"
            )
        g = spec.rows * width
    elif spec.kind == "slice":
        g = math.prod(shape[1:]) if len(shape) >= 1 else 1
    else:  # matrix
        g = numel
    for st in strides:
        st = int(st)
        if st < 1:
            raise ValueError(
                f"granularity_for: {who} shape={shape} has Shard stride={st}; strides must be >= 1"
            )
        g = math.lcm(g, st)
    if numel % g:
        raise ValueError(
            f"granularity_for: {who} shape={shape} (numel={numel}) is not a whole number of blocks of "
            f"{g} elements ({spec}, strides={tuple(strides)})"
        )
    return g, ragged_dims(shape, g)


def granularity_for_local(
    global_shape: Sequence[int],
    local_shape: Sequence[int],
    block: BlockSpec | str | tuple[int, int] | None = None,
    *,
    name: str | None = None,
) -> tuple[int, tuple[int, ...]]:
    """Block size (elements) and ``RaggedShard`` dims for the TP/EP-local tensor of a sharded parameter.

    FSDP x TP (torch FSDP2's order, ``_fsdp_param.py: _init_sharding_spec_tp``) plans and shards the
    local tensor that the tensor-parallel ``Shard`` placements leave on this rank (``local_shape``:
    ``global_shape`` with some dims divided evenly). A block spec is defined on the GLOBAL tensor
    (a quantization tile, ``K`` rows, one expert slice, the matrix) and must not be cut by a TP
    boundary either; this returns the block as seen in the local tensor, whose ragged pieces the
    planner then keeps whole. ``None`` (the default) is one row of the *local* tensor, as FSDP2's
    ``Shard(0)`` of the TP-local tensor.

    Rules (``d`` a dim that TP splits into parts of ``L_d``): ``tile:RxC`` needs ``R | L_d`` for the
    matrix-row dim and ``C | L_d`` for the column dim; other kinds are a run of ``b`` rows of the
    flattened ``dims`` prefix, which must lie inside one value of ``d`` (``b`` divides the prefix
    extent below ``d``) or cover whole runs of ``b / Q`` values of ``d`` with ``b / Q | L_d``; a block
    spanning the whole of a split dim (``row`` or ``slice`` across a split trailing dim, ``matrix``) is cut.

    Returns ``(granularity, dims)`` of the local shape. Pure, O(ndim).

    Raises:
        ValueError: the block does not tile the global tensor, or a TP boundary cuts it -- naming the
            tensor, both shapes, the split dim and a block that fits.
    """
    gshape = _shape_of(global_shape)
    lshape = _shape_of(local_shape)
    who = f"parameter {name!r}" if name else f"tensor of shape {gshape}"
    if len(gshape) != len(lshape):
        raise ValueError(
            f"granularity_for_local: {who}: local shape {lshape} and global shape {gshape} differ"
        )
    if block is None:
        return granularity_for(lshape, None, name=name)
    spec = BlockSpec.parse(block)
    g, dims = granularity_for(gshape, spec, name=name)  # the block must tile the global tensor
    split = [d for d in range(len(gshape)) if lshape[d] != gshape[d]]
    if not split or math.prod(gshape) == 0:
        return granularity_for(lshape, spec, name=name) if split else (g, dims)
    nd = len(gshape)

    def cut(d: int, why: str) -> ValueError:
        return ValueError(
            f"fully_shard: block {spec} of {who} (global shape {gshape}) is cut by the tensor-parallel split "
            f"of dim {d} into parts of {lshape[d]} (local shape {lshape}): {why}. No TP or FSDP boundary may "
            "cut a block: choose a block that fits inside the TP-local tensor (e.g. 'row', 'element', a "
            "smaller tile), or shard that dim so its parts are a multiple of the block"
        )

    if spec.kind == "tile":
        for d in split:
            if d == nd - 2 and lshape[d] % spec.rows:
                raise cut(d, f"the tile height {spec.rows} does not divide {lshape[d]}")
            if d == nd - 1 and spec.cols and lshape[d] % spec.cols:
                raise cut(d, f"the tile width {spec.cols} does not divide {lshape[d]}")
        return spec.rows * (lshape[-1] if nd >= 2 else 1), ragged_dims(lshape, spec.rows * lshape[-1])
    if spec.kind == "row" and nd >= 2 and (nd - 1) in split:
        raise cut(nd - 1, "a row spans the whole split dim")
    k = len(dims)
    tail = math.prod(gshape[k:])
    b = g // tail  # rows of the flattened dims prefix per block
    for d in split:
        if d >= k:
            raise cut(d, f"each block spans the whole of dim {d}")
        q = math.prod(gshape[d + 1 : k])
        if not (q % b == 0 or (b % q == 0 and lshape[d] % (b // q) == 0)):
            raise cut(d, f"a block of {b} rows of the leading dims {tuple(range(k))} crosses a part boundary")
    return g, ragged_dims(lshape, g)


def make_policy(matrix: BlockSpec | str = "row", vector: BlockSpec | str = "element") -> Policy:
    """A policy giving ``matrix`` blocks to tensors with ``ndim >= 2`` and ``vector`` blocks to the rest."""
    m_spec, v_spec = BlockSpec.parse(matrix), BlockSpec.parse(vector)

    def policy(param_or_shape: Any) -> BlockSpec:
        return m_spec if len(_shape_of(param_or_shape)) >= 2 else v_spec

    policy.__name__ = f"policy(matrix={m_spec}, vector={v_spec})"
    return policy


@dataclass(frozen=True)
class ParamBlock:
    """A parameter resolved by a policy: what the planner and ``RaggedShard`` need."""

    name: str
    shape: tuple[int, ...]
    numel: int
    granularity: int
    dims: tuple[int, ...]
    block: str


def _auto_strides(param: Any) -> tuple[int, ...]:
    """Strides of ``Shard(dim > 0)`` dims of a DTensor-like ``param`` (contiguous local layout)."""
    placements = getattr(param, "placements", None)
    if not placements:
        return ()
    local = param.to_local() if hasattr(param, "to_local") else param
    shape = _shape_of(local)
    out = []
    for pl in placements:
        dim = getattr(pl, "dim", None)
        if type(pl).__name__ == "Shard" and dim is not None and dim > 0:
            out.append(math.prod(shape[dim + 1 :]))
    return tuple(out)


def resolve_blocks(
    named_params: Iterable[tuple[str, Any]],
    policy: Policy | None = None,
    *,
    shard_strides: Mapping[str, Sequence[int]] | None = None,
) -> list[ParamBlock]:
    """Apply ``policy`` to ``(name, param_or_shape)`` pairs; DTensor ``Shard(dim>0)`` strides are added.

    For a DTensor the *local* shape is used (FSDP lays out the TP-local tensor). O(#params).
    """
    out = []
    for name, p in named_params:
        local = p.to_local() if hasattr(p, "to_local") else p
        shape = _shape_of(local)
        spec = policy(p) if policy is not None else None
        spec = DEFAULT_BLOCK if spec is None else BlockSpec.parse(spec)
        strides = tuple(_auto_strides(p)) + tuple((shard_strides or {}).get(name, ()))
        g, dims = granularity_for(shape, spec, strides=strides, name=name)
        out.append(ParamBlock(name, shape, math.prod(shape), g, dims, str(spec)))
    return out


def plan_params(
    named_params: Iterable[tuple[str, Any]],
    world_size: int,
    *,
    policy: Policy | None = None,
    align: int = 1,
    order: str | Sequence[int] = "default",
    shard_strides: Mapping[str, Sequence[int]] | None = None,
) -> Layout:
    """Resolve blocks with ``policy`` and plan one unit: :func:`plan_layout` with names and shapes.

    The ``dims`` of each parameter are :func:`ragged_dims` of its shape and granularity.
    """
    blocks = resolve_blocks(named_params, policy, shard_strides=shard_strides)
    return plan_layout(
        [b.numel for b in blocks],
        [b.granularity for b in blocks],
        world_size,
        align=align,
        order=order,
        shapes=[b.shape for b in blocks],
        names=[b.name for b in blocks],
    )
