"""Quantized parameter all-gather: 8-bit block codes plus fp32 scales on the wire, one collective per unit.

Note [quantized all-gather]
    With a :class:`QuantizedAllGatherPolicy` a unit's all-gather does not send ``param_dtype`` values:
    each rank quantizes its own ``(S,)`` shard of the sharded master (``raggedfsdp/buffer/block_quant.py``:
    ``R x C`` blocks, one fp32 scale each) into a *payload* of ``P`` bytes, the ranks all-gather the
    payloads (one even-sized ``uint8`` all-gather, ``m * P`` bytes) and each rank dequantizes the result
    into the unsharded params buffer (``param_dtype``) before forward or backward uses it. Rank ``r``'s
    payload holds its pieces in shard order, in three 16-byte aligned sections::

        [codes of its quantized pieces (1 byte per element)][their fp32 scales][its unquantized
        pieces (1-D params, small tensors) in param_dtype]

    The offsets of every rank's pieces follow from the unit's layout alone (:class:`PayloadPlan`), so each
    rank knows where the others' pieces are; ``P`` is the largest rank's payload. For a unit of
    quantized matrices ``P ~ S (1 + 4 / (R C))`` bytes where ``param_dtype`` bf16 sends ``2 S``: about
    0.5x the wire bytes (``R x C = 32 x 32``: 0.502x, plus the padding that whole blocks cost).

    Which tensors: :meth:`QuantizedAllGatherPolicy.eligible` (``ndim >= 2``, ``numel >= min_numel``, the
    block height divides the matrix rows) of the (TP-local) shape the unit lays out -- never of the world
    size. Their FSDP granularity is raised to whole block rows (``R * shape[-1]`` elements, the planner's
    ``tile:RxC``), so no rank boundary cuts a block; :class:`PayloadPlan` re-checks it and raises
    ``ValueError`` otherwise. Each block is quantized by its one owner with correctly rounded fp32
    arithmetic, so the gathered values are the same at every world size.

    Gradients are straight-through: autograd differentiates the dequantized unsharded params, and those
    gradients are reduce-scattered into the full-precision sharded params' ``.grad`` as without the
    policy; the optimizer and checkpoints see the unchanged master. The payload is cached with the
    unit's master version (``FSDPParamGroup._master_version``), so the backward re-gather of a
    resharded unit reuses the forward's payload: one quantization per optimizer step.

    Sources: DeepSpeed ZeRO++ qwZ (arXiv 2306.10209, section 3.1: block-quantized int8 weight
    all-gather); veScale-FSDP (the paper's block-preserving RaggedShard, sections 4 and 5.1) for keeping
    blocks on one rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raggedfsdp._release import handoff, hold_until_released, use_count
from raggedfsdp.buffer import block_quant as bq
from raggedfsdp.buffer import quant_time
from raggedfsdp.buffer.streams import CommHandle, current_stream, on_stream, wait_stream

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_ALIGN = 16  # bytes: every payload section and the payload size


def _up(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class QuantizedAllGatherPolicy:
    """Opt-in quantized parameter all-gather for one FSDP unit (``fully_shard(..., all_gather_policy=)``).

    Attributes:
        dtype: the code format, ``"fp8_e4m3"`` (``float8_e4m3fn``, absmax scaled to 448) or ``"int8"``
            (symmetric, absmax scaled to 127).
        block: ``(R, C)`` block of the parameter viewed as ``(numel // shape[-1], shape[-1])``:
            ``(32, 32)`` tiles (the default) or ``(1, K)`` row blocks.
        min_numel: tensors with fewer elements (and every tensor with ``ndim < 2``) are gathered
            unquantized in ``param_dtype``.

    Raises:
        ValueError: an unknown ``dtype``, a bad ``block`` or a negative ``min_numel``.
    """

    dtype: str = "fp8_e4m3"
    block: tuple[int, int] = (32, 32)
    min_numel: int = 4096

    def __post_init__(self):
        object.__setattr__(
            self, "block", bq.check_format(self.dtype, self.block, who="QuantizedAllGatherPolicy")
        )
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(
                f"QuantizedAllGatherPolicy: min_numel={self.min_numel!r} must be an int >= 0, e.g. 4096"
            )

    def eligible(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of (TP-local) ``shape`` is quantized: ``ndim >= 2``, ``numel >= min_numel``,
        and the block height divides ``shape[-2]`` (blocks never straddle two matrices of a stack)."""
        return (
            len(shape) >= 2 and math.prod(shape) >= max(self.min_numel, 1) and shape[-2] % self.block[0] == 0
        )

    def granularity(self, shape: Sequence[int]) -> int:
        """The FSDP block (elements) that keeps this policy's blocks of an eligible tensor whole:
        ``R`` rows of ``shape[-1]``."""
        return self.block[0] * int(shape[-1])


@dataclass(frozen=True)
class _Piece:
    tensor: int  # index in the layout
    start: int  # element offset within the tensor
    numel: int
    shard_offset: int  # offset in the rank's shard (elements)
    data: int  # byte offset in the rank's payload of its codes (quantized) or values (unquantized)
    scales: int = 0  # quantized: byte offset of its fp32 scales
    nblocks: int = 0  # quantized: number of blocks (scales)


class PayloadPlan:
    """Where each rank's pieces sit in its quantized all-gather payload (Note [quantized all-gather]).

    Args:
        layout: the unit's :class:`~raggedfsdp.planner.Layout` (``m`` ranks, shard size ``S``).
        shapes: the tensors' (TP-local) shapes, layout order.
        policy: the :class:`QuantizedAllGatherPolicy`.
        param_dtype: the unsharded params' dtype (of the unquantized pieces on the wire).
        names: optional tensor names for error messages.

    Attributes: ``payload_bytes`` (``P``, the largest rank's payload, 16-byte aligned), ``quantized``
    (per tensor), ``pieces[r]`` (rank ``r``'s pieces with their byte offsets).

    Raises:
        ValueError: a rank boundary cuts a block of a quantized tensor (its granularity is not a
            multiple of the block rows), naming the tensor, the rank and the offset.
    """

    def __init__(
        self,
        layout,
        shapes: Sequence[Sequence[int]],
        policy: QuantizedAllGatherPolicy,
        param_dtype,
        names: Sequence[str] | None = None,
    ):
        self.layout, self.policy, self.param_dtype = layout, policy, param_dtype
        name = (lambda i: repr(names[i])) if names is not None else layout.name
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.quantized = [policy.eligible(s) for s in self.shapes]
        itemsize = torch.empty((), dtype=param_dtype).element_size()
        order = sorted(range(len(self.shapes)), key=lambda i: layout.offsets[i])
        self.pieces: list[list[_Piece]] = []
        ends = []
        for r in range(layout.world_size):
            spans = []  # (tensor, start, numel, shard offset, blocks) in shard order
            for i in order:
                a, b = layout.piece(i, r)
                if b == a:
                    continue
                nb = 0
                if self.quantized[i]:
                    g = policy.granularity(self.shapes[i])
                    if a % g or b % g:
                        cut = a if a % g else b
                        raise ValueError(
                            f"quantized all-gather: the boundary of rank {r} cuts a {policy.block[0]}x"
                            f"{policy.block[1]} block of {name(i)} (shape {self.shapes[i]}) at "
                            f"element {cut}, not a multiple of {g} (= {policy.block[0]} rows of "
                            f"{self.shapes[i][-1]}); "
                            "each block must be quantized by one rank: plan the unit with granularity "
                            "QuantizedAllGatherPolicy.granularity(shape) (fully_shard does) or exclude the "
                            "tensor (min_numel)"
                        )
                    w = self.shapes[i][-1]
                    nb = bq.num_blocks((b - a) // w, w, policy.block)
                spans.append((i, a, b - a, layout.shard_offset(i, r), nb))
            # [codes of the quantized pieces][fp32 scales][unquantized values], sections 16-byte aligned
            quant = [sp for sp in spans if self.quantized[sp[0]]]
            codes_end = sum(sp[2] for sp in quant)
            scale_at = _up(codes_end)
            plain_at = _up(scale_at + 4 * sum(sp[4] for sp in quant))
            pieces, code, scale, plain = [], 0, scale_at, plain_at
            for i, a, n, so, nb in spans:
                if self.quantized[i]:
                    pieces.append(_Piece(i, a, n, so, code, scale, nb))
                    code, scale = code + n, scale + 4 * nb
                else:
                    pieces.append(_Piece(i, a, n, so, plain))
                    plain += n * itemsize
            self.pieces.append(pieces)
            ends.append(plain)
        self.payload_bytes = max(_up(max(ends)), _ALIGN)
        gaps, pos = [], 0  # the unsharded buffer's padding: kept zero
        for o, n in sorted(zip(layout.offsets, layout.numels)):
            if o > pos:
                gaps.append((pos, o - pos))
            pos = max(pos, o + n)
        if layout.total_size > pos:
            gaps.append((pos, layout.total_size - pos))
        self.gaps = gaps

    @property
    def wire_bytes(self) -> int:
        """Bytes of one all-gather of this unit (the output, ``m * P``)."""
        return self.layout.world_size * self.payload_bytes

    def pack(self, shard: torch.Tensor, rank: int, out: torch.Tensor) -> torch.Tensor:
        """Quantize rank ``rank``'s ``(S,)`` ``shard`` (the sharded master) into ``out`` ``(P,)`` ``uint8``.
        Local; reads ``shard`` only."""
        pol, pdt = self.policy, self.param_dtype
        out.zero_()  # padding bytes: deterministic
        with torch.no_grad():
            for pc in self.pieces[rank]:
                x = shard.narrow(0, pc.shard_offset, pc.numel)
                if self.quantized[pc.tensor]:
                    w = self.shapes[pc.tensor][-1]
                    codes = out.narrow(0, pc.data, pc.numel).view(-1, w)
                    _, s = bq.quantize(x.view(-1, w), pol.block, pol.dtype, out=codes)
                    out.narrow(0, pc.scales, 4 * pc.nblocks).view(torch.float32).copy_(s.reshape(-1))
                else:
                    out.narrow(0, pc.data, pc.numel * x.new_empty((), dtype=pdt).element_size()).view(
                        pdt
                    ).copy_(x)
        return out

    def unpack(self, gathered: torch.Tensor, params: torch.Tensor) -> None:
        """Dequantize every rank's payload (``gathered``: ``(m * P,)`` ``uint8``) into the unsharded params
        buffer ``params`` ``(m * S,)`` (of ``param_dtype``), piece by piece. Local."""
        lay, pol, pdt = self.layout, self.policy, self.param_dtype
        rows = gathered.view(lay.world_size, self.payload_bytes)
        item = params.element_size()
        with torch.no_grad():
            for r, pieces in enumerate(self.pieces):
                row = rows[r]
                for pc in pieces:
                    dst = params.narrow(0, lay.offsets[pc.tensor] + pc.start, pc.numel)
                    if self.quantized[pc.tensor]:
                        w = self.shapes[pc.tensor][-1]
                        bq.dequantize(
                            row.narrow(0, pc.data, pc.numel).view(-1, w),
                            row.narrow(0, pc.scales, 4 * pc.nblocks)
                            .view(torch.float32)
                            .view(-1, -(-w // pol.block[1])),
                            pol.block,
                            pol.dtype,
                            out=dst.view(-1, w),
                        )
                    else:
                        dst.copy_(row.narrow(0, pc.data, pc.numel * item).view(pdt))
            for o, n in self.gaps:
                params.narrow(0, o, n).zero_()


class QuantizedGather:
    """The quantized all-gather of one unit: payload plan, the cached local payload, the collective.

    Args: ``layout``, ``shapes``, ``policy``, ``names`` as :class:`PayloadPlan` (the plan is rebuilt when
    ``param_dtype`` changes, e.g. after ``module.to(dtype)``).
    """

    def __init__(self, layout, shapes, policy: QuantizedAllGatherPolicy, names: Sequence[str] | None = None):
        self.layout, self.shapes, self.policy, self.names = layout, list(shapes), policy, names
        self._plan: PayloadPlan | None = None
        self._cache: tuple | None = None  # (sharded DBuffer, master version, payload)
        self.quantizations = 0  # how many times a payload was built (tests: once per step)

    def plan(self, param_dtype) -> PayloadPlan:
        if self._plan is None or self._plan.param_dtype != param_dtype:
            self._plan = PayloadPlan(self.layout, self.shapes, self.policy, param_dtype, self.names)
        return self._plan

    def payload(self, bufs, version: int) -> torch.Tensor:
        """This rank's ``(P,)`` payload of the sharded master at ``version``, cached. Local."""
        c = self._cache
        if c is not None and c[0] is bufs.sharded and c[1] == version:
            return c[2]
        plan = self.plan(bufs.param_dtype)
        shard = bufs.sharded.data
        out = torch.empty(plan.payload_bytes, dtype=torch.uint8, device=shard.device)
        acc = quant_time.active()  # opt-in accounting (raggedfsdp/buffer/quant_time.py); None: off
        if acc is None:
            plan.pack(shard, bufs.rank, out)
        else:
            with quant_time.timed(acc, "quantize", shard.device, plan.payload_bytes):
                plan.pack(shard, bufs.rank, out)
        if out.device != bufs.device:
            out = out.to(bufs.device, non_blocking=True)  # CPU offload: the 8-bit payload crosses, not fp32
        self._cache = (bufs.sharded, version, out)
        self.quantizations += 1
        return out

    def drop_cache(self) -> None:
        self._cache = None

    def gather(self, bufs, group, *, stream=None, version: int) -> CommHandle:
        """Allocate the unsharded params, all-gather every rank's payload over ``group`` (from ``stream``)
        and return a handle whose ``wait()`` dequantizes into them. Collective over ``group``."""
        plan = self.plan(bufs.param_dtype)
        compute = current_stream(bufs.device)
        bufs.params.alloc()
        payload = self.payload(bufs, version)
        m = self.layout.world_size
        wait_stream(stream, compute)
        with on_stream(stream), torch.no_grad():
            if m == 1:
                out, work = payload, None
            else:
                out = torch.empty(m * plan.payload_bytes, dtype=torch.uint8, device=bufs.device)
                base_in, base_out = use_count(payload), use_count(out)
                work = _all_gather_single(*handoff(out, payload), group=group, async_op=True)
                hold_until_released(payload, base_in)  # Note [gloo release]
                hold_until_released(out, base_out)
        return _DequantizeHandle(work, [bufs.params], stream, plan, out, bufs.params.data)


class _DequantizeHandle(CommHandle):
    """A quantized all-gather in flight; the first ``wait()`` dequantizes into the params (on the
    waiting stream) and drops the gathered bytes."""

    def __init__(self, work, buffers, stream, plan: PayloadPlan, gathered, params):
        super().__init__(work, buffers, stream, "quantized all-gather")
        self._plan, self._gathered, self._params = plan, gathered, params

    def wait(self, stream=None) -> None:
        super().wait(stream)
        if self._gathered is not None:
            dev = self._params.device
            with on_stream(stream if stream is not None else current_stream(dev)):
                acc = quant_time.active()
                if acc is None:
                    self._plan.unpack(self._gathered, self._params)
                else:
                    with quant_time.timed(acc, "dequantize", dev, self._gathered.numel()):
                        self._plan.unpack(self._gathered, self._params)
            self._gathered = None


__all__ = ["PayloadPlan", "QuantizedAllGatherPolicy", "QuantizedGather"]
