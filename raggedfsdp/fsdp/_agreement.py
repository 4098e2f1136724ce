"""Unit agreement: every rank of a mesh must run the same FSDP units in the same order (the check
rides on the used-flag all-reduce that runs once per backward anyway).

Note [unit agreement]
    Collectives pair up by issue order, so a unit that only some ranks run (data-dependent routing)
    pairs its all-gather with another unit's same-sized one and gives silently wrong results. Every
    rank therefore keeps, since the last check, a running hash of the sequence of (unit id, collective
    kind) it issued and a per-unit count, and sends ``[h, -h, counts, -counts, used flags]`` (int64,
    one fixed length per mesh: every param of every unit of the root on it) in the used-flag MAX
    all-reduce that runs once per backward anyway: ``max(h) == -max(-h)`` iff every rank's hash is
    equal. On a mismatch each rank raises :class:`~raggedfsdp.fsdp._common.CollectiveMismatchError`
    naming the units whose counts differ and the units it ran, *before* any ``.grad`` is set (and it
    drops the sharded ``.grad`` of the root's units, so no optimizer step can use corrupted values).
    No-sync micro-batches and forward-only passes keep accumulating the hash until the next backward
    that reduces gradients (they communicate nothing extra).
    Cost on the host: on CPU the small vector is read back at once. On CUDA, when every local
    parameter got a gradient (nothing to learn from the flags), it is copied non-blocking into pinned
    memory with an event and checked at the next root forward (or the next check), so the step has no
    host sync; a mismatch then raises one step late -- the optimizer step of that iteration used the
    wrong gradients, and the message says so (restore the last checkpoint). ``RAGGEDFSDP_DEBUG=1``
    checks every all-gather and reduce-scatter before it runs instead, in the same :meth:`Agreement.note`
    (:meth:`Agreement.check_now`), so one mechanism does both. ``RuntimeOptions.agreement_check`` = "auto"
    (that rule), "immediate" (always read at once) or "deferred" (always defer; used by the CPU tests).
    Mismatched collectives of *different* sizes do not get that
    far: gloo aborts the rank with the smaller buffer ("Received data size doesn't match expected
    size. Is there a distributed collective mismatch") and its peers' wait raises
    :class:`~raggedfsdp.buffer.CollectiveError` naming the unit and this rank's sequence; same-byte
    collectives of different kinds time out after the process group's timeout with the same error.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from raggedfsdp._release import handoff, hold_until_released, use_count

from raggedfsdp.buffer import CommHandle
from raggedfsdp.fsdp._common import CollectiveMismatchError, RuntimeOptions, attr_scan
from raggedfsdp.fsdp._loops import or_into

_SHARDED_REQUIRES_GRAD = operator.attrgetter("sharded.requires_grad")

if TYPE_CHECKING:
    from raggedfsdp.fsdp._param_group import FSDPParamGroup
    from raggedfsdp.fsdp._reduce import PendingReduce

_KINDS = {"all-gather": 0, "reduce-scatter": 1, "all-reduce": 2}
_HASH_MUL, _HASH_MOD = 1_000_003, (1 << 61) - 1  # fits int64 with its negation
_SEQ_KEEP = 256


@dataclass
class DeferredCheck:
    """An all-reduced agreement vector not read yet (Note [unit agreement]): its host copy, the CUDA
    event of that copy (``None`` on CPU), the units of its mesh, this rank's counts and sequence."""

    host: torch.Tensor
    event: object | None
    units: list
    counts: list[int]
    ran: str = ""


@dataclass
class Agreement:
    """What this rank issued since the last check, and the checks still to read (one per root, on its
    ``CommContext``)."""

    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    units: list = field(default_factory=list)  # every unit of the root (set at its lazy init)
    seq_hash: int = 0
    seq: list = field(default_factory=list)  # (unit name, kind), the first _SEQ_KEEP since the last check
    seq_len: int = 0
    counts: dict = field(default_factory=dict)  # unit id -> collectives issued since the last check
    pending: list[DeferredCheck] = field(default_factory=list)  # read at the next check

    def note(self, group: FSDPParamGroup, kind: str, numel: int | None = None) -> None:
        """Record that this rank issues ``kind`` for ``group`` (``numel`` elements over its shard group).
        Local, O(1); in debug mode (``RuntimeOptions.debug_on``) with ``numel`` given, first
        :meth:`check_now`: collective (one small blocking all-reduce over the shard group)."""
        if numel is not None and self.options.debug_on():
            self.check_now(group, kind, numel)
        code = (group.unit_id + 1) * 4 + _KINDS[kind]
        self.seq_hash = (self.seq_hash * _HASH_MUL + code) % _HASH_MOD
        self.seq_len += 1
        self.counts[group.unit_id] = self.counts.get(group.unit_id, 0) + 1
        if len(self.seq) < _SEQ_KEEP:
            self.seq.append((group.unit_name, kind))

    def check_now(self, group: FSDPParamGroup, kind: str, numel: int) -> None:
        """Debug mode: check, before it runs, that every rank of ``group``'s shard group issues this
        collective for the same unit (id and size), so collectives of different units never pair up
        silently (e.g. data-dependent routing that runs a unit on some ranks only). Raises
        ``RuntimeError`` naming both units. Collective (one small blocking MAX all-reduce)."""
        if group.shard_world == 1:
            return
        uid = group.unit_id
        dev = group.device if group.device.type == "cuda" else "cpu"
        t = torch.tensor([uid, -uid, numel, -numel], dtype=torch.int64, device=dev)
        dist.all_reduce(handoff(t), op=dist.ReduceOp.MAX, group=group.shard_group)  # Note [gloo release]
        hi_id, lo_id, hi_n, lo_n = (int(v) for v in t.tolist())
        if hi_id != -lo_id or hi_n != -lo_n:
            raise RuntimeError(
                f"raggedfsdp: collective mismatch on rank {dist.get_rank()}: this rank issues the {kind} of "
                f"FSDP unit {group.unit_name!r} (#{uid}, {numel} elements) while another rank of its group "
                f"issues one of unit #{-lo_id if -lo_id != uid else hi_id} "
                f"({-lo_n if -lo_n != numel else hi_n} elements). Every rank must run the same FSDP units in "
                "the same order; a unit run by only some ranks (data-dependent routing, e.g. MoE experts as "
                "separate units) must be run on every rank (with an empty input) or merged into a unit that "
                "every rank runs"
            )

    def ran(self) -> str:
        """This rank's collectives since the last check, for error messages."""
        out, last = [], None
        for name, kind in self.seq:
            if last is not None and last[0] == (name, kind):
                last[1] += 1
                continue
            last = [(name, kind), 1]
            out.append(last)
        text = ", ".join(f"{k} of {n!r}" + (f" x{c}" if c > 1 else "") for (n, k), c in out)
        return text + (f", ... ({self.seq_len} in all)" if self.seq_len > len(self.seq) else "")

    def context(self, group: FSDPParamGroup):
        """A ``CommHandle.context``: names the unit and this rank's sequence in a collective's error."""
        return lambda: (
            f" of FSDP unit {group.unit_name!r} (#{group.unit_id}) on rank {dist.get_rank()} (this rank "
            f"issued since the last check: {self.ran()}; if a peer reported a collective mismatch, the "
            "ranks ran different FSDP units: see Note [unit agreement] in raggedfsdp/fsdp/_agreement.py)"
        )

    def clear_sequence(self) -> None:
        self.seq_hash, self.seq_len = 0, 0
        self.seq.clear()
        self.counts.clear()

    def reset(self) -> None:
        """reset_iter_state: forget the sequence and the checks not read yet. Local."""
        self.pending.clear()
        self.clear_sequence()

    def check_pending(self) -> None:
        """Read back the deferred results whose copy has finished and raise
        :class:`CollectiveMismatchError` if one shows a mismatch. Never blocks: a result whose event has
        not completed (``event.query()``) stays pending, with every newer one, for the next check (at
        most a step or two later on a GPU that keeps up). Local."""
        pending, self.pending = self.pending, []
        for k, d in enumerate(pending):
            if d.event is not None and not d.event.query():
                self.pending = pending[k:]  # keep the order: the oldest is read first
                return
            hash_differs, differ = _mismatches(d.host.tolist(), d.units, d.counts)
            if hash_differs or differ:
                raise _mismatch_error(differ, d.ran, late=True)

    def exchange_used_flags(self, recs: list[PendingReduce]) -> dict[int, bool]:
        """OR of the used flags over every data-parallel rank, checking unit agreement in the same
        collective: one MAX all-reduce of an int64 vector per mesh (per dim for HSDP) over every param of
        every unit of the root on that mesh. Returns ``{id(fsdp_param): used}``. Collective; reads the
        result back (on CUDA: pinned H2D, one D2H). Raises :class:`CollectiveMismatchError` on every rank
        when the ranks' sequences differ."""
        self.check_pending()  # the previous backward's deferred check first
        local_or: dict[int, bool] = {}
        for r in recs:
            or_into(local_or, list(map(id, r.params)), r.flags)
        units = list(self.units) or list({id(r.group): r.group for r in recs}.values())
        by_mesh: dict[tuple, list] = {}
        for g in units:
            by_mesh.setdefault((id(g.shard_group), id(g.replicate_group)), []).append(g)
        used: dict[int, bool] = {}
        differ: list[str] = []
        deferred: list[DeferredCheck] = []
        hash_differs = False
        for gs in by_mesh.values():
            g = gs[0]
            params = list(itertools.chain.from_iterable(u.fsdp_params for u in gs))
            ids = list(map(id, params))
            local = list(map(local_or.get, ids, itertools.repeat(False)))
            if g.shard_world * g.replicate_world > 1:
                counts = [self.counts.get(u.unit_id, 0) for u in gs]
                t = torch.tensor(
                    [self.seq_hash, -self.seq_hash, *counts, *(-c for c in counts), *map(int, local)],
                    dtype=torch.int64,
                )
                if g.device.type == "cuda":
                    t = t.pin_memory().to(g.device, non_blocking=True)
                base = use_count(t)
                groups = [g.shard_group] + (
                    [g.replicate_group] if g.is_hsdp and g.replicate_world > 1 else []
                )
                for pg in groups:
                    handle = CommHandle(
                        dist.all_reduce(handoff(t), op=dist.ReduceOp.MAX, group=pg, async_op=True),
                        (),
                        None,
                        "used-flag all-reduce",
                    )
                    hold_until_released(t, base)  # Note [gloo release]: `t` dies with this call
                    handle.context = self.context(g)
                    handle.wait()
                mode = "immediate" if self.options.debug_on() else self.options.agreement_check
                # only trainable params need their flags read (frozen ones never get a .grad, and
                # requires_grad must agree across ranks); a trainable one no local reduction carried
                # (its unit's backward did not run here) still needs them
                with attr_scan():  # DTensor attribute reads without __torch_function__ (2.7x cheaper)
                    frozen = list(map(operator.not_, map(_SHARDED_REQUIRES_GRAD, params)))
                carried = all(map(local_or.get, ids, frozen))
                if carried and (mode == "deferred" or (mode == "auto" and g.device.type == "cuda")):
                    # every carried param got a grad, so their OR is all-true: only the agreement needs
                    # reading, and that can wait for the next check (no host sync in the step)
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
                    host.copy_(t, non_blocking=True)
                    event = None
                    if t.device.type == "cuda":
                        event = torch.cuda.Event()
                        event.record()
                    deferred.append(DeferredCheck(host, event, gs, counts))
                else:
                    vals = t.tolist()
                    h, d = _mismatches(vals, gs, counts)
                    hash_differs |= h
                    differ += d
                    local = list(map(bool, vals[2 + 2 * len(gs) :]))
            used.update(zip(ids, local))
        ran = self.ran()
        self.clear_sequence()
        for d in deferred:
            d.ran = ran
        self.pending += deferred
        if hash_differs or differ:
            for (
                u
            ) in units:  # values in the sharded grad buffers may mix units: let no optimizer step see them
                for fp in u.fsdp_params:
                    fp.sharded.grad = None
            raise _mismatch_error(differ, ran, late=False)
        return used


def _mismatches(vals: list[int], gs: list, counts: list[int]) -> tuple[bool, list[str]]:
    """From the all-reduced ``[h, -h, counts, -counts, ...]``: whether the hashes differ, and the units
    whose counts differ (Note [unit agreement])."""
    n = len(gs)
    differ = [
        f"{u.unit_name!r} (#{u.unit_id}: {c} collectives on this rank, {-lo} to {hi} on the ranks of its "
        f"mesh)"
        for u, c, hi, lo in zip(gs, counts, vals[2 : 2 + n], vals[2 + n : 2 + 2 * n])
        if hi != -lo
    ]
    return vals[0] != -vals[1], differ


def _mismatch_error(differ: list[str], ran: str, *, late: bool) -> CollectiveMismatchError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    what = "; ".join(differ) if differ else "the same units, in a different order"
    when = (
        "found by the deferred check of the previous backward's used-flag all-reduce (on CUDA it is read at "
        "the next forward to keep the step free of host syncs): the optimizer step of that iteration already "
        "used the wrong gradients, so restore the last checkpoint"
        if late
        else "found in the used-flag all-reduce at the end of backward, before any gradient was set; the "
        "gradients "
        "were dropped (.grad is None)"
    )
    return CollectiveMismatchError(
        f"raggedfsdp: FSDP units ran differently across ranks since the last check ({when}): units whose "
        f"collective counts differ: {what}. This rank (rank {rank}) issued: {ran}. Collectives pair up by "
        "issue order, so same-sized collectives of different units paired up and these gradients are wrong. "
        "Every rank must run the same FSDP units in the same order: run a unit on every rank (with an empty "
        "input, as MoE experts inside one unit are) or merge data-dependent branches into a unit every rank "
        "runs. Call reset_iter_state() on the root before the next step."
    )
