"""Expert parallelism (EP): token dispatch to the ranks that own the experts, and the combine back.

Layout (as torchtitan's ``ExpertParallel``, ``torchtitan/distributed/expert_parallel.py``; GShard's
all-to-all MoE, Lepikhin et al. 2020): the ``X`` routed experts of a layer are split over the ``ep``
ranks of an EP group in contiguous runs, EP rank ``j`` owning experts ``[j*L, (j+1)*L)``, ``L = X/ep``,
as fused ``(L, D, F)`` stacks (``Shard(0)`` DTensors on the ``ep`` mesh dim, see
``parallelize.apply_ep``). Every rank routes its own tokens (router and attention are replicated over
EP), then:

1. **counts**: an even ``all_to_all_single`` of the per-expert row counts ((X,) int64, ``L`` per
   peer) tells each rank how many rows it receives from each peer for each of its experts;
2. **dispatch**: an uneven ``all_to_all_single`` of the expert-sorted rows (gloo and NCCL both accept
   uneven and empty split sizes); the received rows are ordered (source rank, local expert) and are
   permuted to (local expert, source rank) so each local expert sees one contiguous slice;
3. the local experts run (every one of them, even on zero rows, so every expert parameter has a
   gradient, zero when it got no token);
4. **combine**: the inverse permutation, then the reverse ``all_to_all_single``, which returns the
   rows in exactly the order they were sent: the caller's weighting and scatter-add back into token
   order are those of the single-process model, so outputs are equal up to matmul blocking.

No capacity limit and no token dropping. Backward runs the two all-to-alls in reverse (the
autograd Function below): every EP rank of a group must run forward and backward through the same MoE
layers in the same order -- the usual SPMD rule of any collective. The counts exchange and the split
sizes need a device-to-host sync per layer (as the single-process dispatch does).

Single-device reference: the same rows through ``moe.swiglu_experts`` on the full stacks (what the
single-process ``FusedExperts`` does); ``tests/dist/test_moe_ep.py`` checks outputs and gradients
against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all_rows", "ep_dispatch_combine"]


class _AllToAllRows(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` along dim 0; backward is the same exchange, splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    y = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
    return y


def all_to_all_rows(
    x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group
) -> torch.Tensor:
    """Send ``x[rows of piece j]`` (``in_splits[j]`` rows, in order) to rank ``j`` of ``group``; receive
    ``out_splits[j]`` rows from rank ``j``. x (sum(in_splits), ...) -> (sum(out_splits), ...), differentiable.

    Every rank of ``group`` must call it with matching splits (rank i's ``in_splits[j]`` equals rank j's
    ``out_splits[i]``). Empty pieces are allowed.
    """
    return _AllToAllRows.apply(x, list(out_splits), list(in_splits), group)


def ep_dispatch_combine(
    x: torch.Tensor,
    counts: Sequence[int],
    group,
    local_experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """Run the expert-sorted rows ``x`` through experts owned by the ranks of the EP ``group``.

    Args:
        x: (sum(counts), D) assignment rows sorted by expert, ``counts[e]`` rows for global expert e.
        counts: X row counts (host ints); X divisible by the size of ``group``.
        group: the EP process group (all its ranks call this, in the same layer order).
        local_experts: ``f(rows (sum(c), D), c (L host ints)) -> (sum(c), D)``, the L experts this rank
            owns, rows sorted by local expert.

    Returns:
        (sum(counts), D): expert outputs in the order of ``x`` (differentiable w.r.t. ``x`` and the
        local experts' parameters; backward runs the reverse all-to-alls).
    """
    ep = dist.get_world_size(group)
    X = len(counts)
    if X % ep:
        raise ValueError(f"expert parallelism: {X} experts do not split over an EP group of {ep} ranks")
    L = X // ep
    send = torch.tensor(
        list(counts), dtype=torch.int64, device=x.device
    )  # (X,) = (ep, L): rows I send to peer j's experts
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # even pieces of L counts
    recv2 = recv.view(ep, L)  # recv2[s, e]: rows from source s for my local expert e
    in_splits = send.view(ep, L).sum(1).tolist()
    out_splits = recv2.sum(1).tolist()
    xr = all_to_all_rows(x, out_splits, in_splits, group)  # rows ordered (source, local expert)
    perm = _group_by_expert(recv2.cpu()).to(x.device)  # (source, expert) order -> (expert, source) order
    ys = local_experts(xr.index_select(0, perm), recv2.sum(0).tolist())
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return all_to_all_rows(ys.index_select(0, inv), in_splits, out_splits, group)


def _group_by_expert(recv: torch.Tensor) -> torch.Tensor:
    """recv (ep, L) row counts laid out source-major -> the row index that lays them out expert-major."""
    flat = recv.flatten()  # segment k = (s, e) with k = s*L + e, in receive order
    starts = flat.cumsum(0) - flat
    order = torch.arange(flat.numel()).view(recv.shape).T.flatten()  # segments in (e, s) order
    lengths, seg_starts = flat[order], starts[order]
    total = int(lengths.sum())
    out_pos = lengths.cumsum(0) - lengths  # where each segment begins in the expert-major layout
    return torch.arange(total) + torch.repeat_interleave(seg_starts - out_pos, lengths)
