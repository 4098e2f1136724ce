"""Distributed Muon on RaggedShard parameters: one Newton-Schulz per matrix per step, in the whole world.

Per step, for every mesh (the parameters' FSDP ``(S,)`` or HSDP ``(R, S)`` mesh; its *world* is all
its ``R * S`` ranks):

1. momentum (EMA, torch.optim.Muon's rule) and weight decay, element-wise on each rank's own piece;
2. every matrix has ONE owner among all world ranks (``_muon_plan``: LPT on Newton-Schulz FLOPs,
   whole matrices kept on a holder when balance allows); the owner receives the parts it does not
   hold (``ns_dtype``, bfloat16: exactly the values torch's Newton-Schulz starts from) from the
   holder in its own replica;
3. the owner runs Newton-Schulz (so under HSDP no replica group repeats it);
4. the owner sends the orthogonalised rows of each part to **every** holder (all replicas);
5. each rank adds its slice of the update with the matrix's adjusted learning rate.

Steps 2-4 are pipelined: each owner's matrices are cut into ``pipeline_chunks`` chunks of about
equal cost, and chunk ``c + 1`` is gathered and chunk ``c - 1`` scattered (asynchronous
``all_to_all_single`` over the world group, uneven splits, zeros allowed) while chunk ``c`` is
orthogonalised. So a step costs 0 collectives (every matrix whole on one rank, no replicas) or at
most 2 per chunk, whatever the number of tensors. Every rank derives owners, chunks and splits from
global metadata, so a rank holding nothing still joins the same collectives and nothing hangs.
Single-device reference: :func:`raggedfsdp.optim.reference.muon_reference_step`. Source: Canzona
(arXiv 2602.06079) for owner decoupling and micro-group pipelining; peers-2026-12.md section 5.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from raggedfsdp._release import handoff, hold_until_released, use_count
from raggedfsdp.optim._muon_plan import Matrix, assign_owners, chunk_of, plan_exchange, split_matrices
from raggedfsdp.optim._newton_schulz import (
    ADJUST_LR_FNS,
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    adjust_lr,
    compiled_newton_schulz,
    matrices_of,
    newton_schulz,
    ns_flops,
)
from raggedfsdp.optim._shards import ShardInfo, local_flat, matrix_to_tp_major, shard_info, tp_major_to_matrix
from raggedfsdp.optim._state_check import check_loaded_state

ALGORITHMS = ("muon", "adamw")


class Muon(Optimizer):
    """Muon for 2-D (and 3-D expert-stack) parameters, sharded or not; AdamW for ``algorithm="adamw"`` groups.

    Args (defaults, coefficients and update rule of the installed ``torch.optim.Muon``, torch 2.13):
        params: parameters or param groups. A group may set ``algorithm="adamw"`` (with ``betas``,
            ``eps``, ``weight_decay``) to be stepped by ``torch.optim.adamw.adamw`` instead: see
            :func:`raggedfsdp.optim.muon_param_groups`, which builds both groups for a model.
        lr: learning rate (float), adjusted per matrix by ``adjust_lr_fn``.
        weight_decay: decoupled, ``p *= 1 - lr * weight_decay`` (unadjusted lr, as torch).
        momentum, nesterov: ``buf.lerp_(g, 1 - momentum)``; update ``g.lerp(buf, momentum)`` if nesterov.
        ns_coefficients, eps, ns_steps: the quintic Newton-Schulz (``_newton_schulz.newton_schulz``).
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, rows/cols))``) or ``"match_rms_adamw"``.
        ns_dtype: keyword-only, dtype of Newton-Schulz and of the exchanged pieces (torch: bfloat16).
        balance_slack: keyword-only. A matrix whole on one rank is orthogonalised there with no
            gather unless that puts its rank above ``(1 + balance_slack)`` times the mean
            Newton-Schulz load (``_muon_plan.assign_owners``); ``None``: never move whole matrices.
        pipeline_chunks: keyword-only int >= 1, chunks of the gather / Newton-Schulz / scatter
            pipeline (default 4; 1: one gather and one scatter per step, no overlap).
        compile_ns: keyword-only, run Newton-Schulz through ``torch.compile`` (default off: inductor
            may change the last bits, so the bitwise parity with ``torch.optim.Muon`` is for eager).
        betas: keyword-only, default AdamW betas of ``algorithm="adamw"`` groups.

    Parameters: plain 2-D/3-D tensors, or DTensors with placements ``(RaggedShard,)`` or
    ``(Replicate(), RaggedShard)`` with any ``local_units`` (row- or element-granular, empty pieces), and
    FSDP x TP DTensors ``(RaggedShard, Shard(0) | Shard(1) of a matrix | Replicate())``: Newton-Schulz runs
    on the full logical matrix, owners over the whole dp x tp world (``_shards.shard_info(tp="global")``).
    A 3-D ``(E, d, h)`` stack gets one Newton-Schulz per ``(d, h)`` expert (lr adjusted by ``(d, h)``).
    State: ``momentum_buffer`` (a DTensor sharded like the parameter), created at construction, so
    ``state_dict()`` and DCP (``get_optimizer_state_dict``) work before the first step and reshard
    on load. Owners are not state: they are recomputed from the layout.

    Which ranks: ``step()`` is collective over every rank of each parameter's mesh (replicas
    included); all of them must call it, with ``p.grad`` set (or ``None``) consistently across ranks.
    A mesh that is not the whole default group gets its own group (``dist.new_group`` with
    ``use_local_synchronization=True``, created on first use).
    After each step ``last_step_stats`` holds ``collectives``, ``chunks``, ``ns_calls``, ``ns_flops``,
    ``ns_matrices`` (``(param_index, matrix_index)`` orthogonalised on this rank), ``sent_elements``,
    ``ns_s`` and ``wait_s`` (seconds in Newton-Schulz / blocked waiting for the exchange).

    Raises:
        ValueError: negative lr/momentum/weight_decay, unknown ``adjust_lr_fn`` or ``algorithm``, a Muon
            parameter that is not 2-D or 3-D (naming it and pointing to ``muon_param_groups``),
            ``pipeline_chunks`` not an int >= 1.
        NotImplementedError: ``Partial`` placements, several ``Shard`` mesh dims, ``Shard(d)`` of a 3-D
            stack with ``d > 0``.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        balance_slack: float | None = 0.1,
        betas: tuple[float, float] = (0.9, 0.999),
        pipeline_chunks: int = 4,
        compile_ns: bool = False,
    ) -> None:
        for nm, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not float(v) >= 0.0:
                raise ValueError(f"Muon: {nm}={v} must be >= 0")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Muon: adjust_lr_fn={adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")
        if ns_steps >= 100:
            raise ValueError(f"Muon: ns_steps={ns_steps} must be < 100")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "algorithm": "muon",
            "betas": tuple(betas),
        }
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.balance_slack = balance_slack
        if not isinstance(pipeline_chunks, int) or pipeline_chunks < 1:
            raise ValueError(
                f"Muon: pipeline_chunks={pipeline_chunks!r} must be an int >= 1 (1: no pipelining)"
            )
        self.pipeline_chunks = pipeline_chunks
        self._ns = compiled_newton_schulz() if compile_ns else newton_schulz
        self._groups: dict[tuple[int, ...], Any] = {}
        self._index: dict[int, int] = {}
        self._infos: dict[int, ShardInfo] = {}
        self._plans: dict[Any, tuple[list[Matrix], list[int]]] = {}
        self.last_step_stats: dict[str, Any] = {}
        for group in self.param_groups:
            if group["algorithm"] not in ALGORITHMS:
                raise ValueError(
                    f"Muon: param group algorithm={group['algorithm']!r} must be one of {ALGORITHMS}"
                )
            for p in group["params"]:
                self._index[id(p)] = len(self._index)
                if group["algorithm"] == "muon":
                    if p.ndim not in (2, 3):
                        raise ValueError(
                            f"Muon: parameter #{self._index[id(p)]} of shape {tuple(p.shape)} is not a "
                            "matrix or an expert stack (E, d, h); give it to AdamW, e.g. "
                            "Muon(raggedfsdp.optim.muon_param_groups(model))"
                        )
                    self._info(p)  # validates placements early
        self._init_state()

    # -- state -------------------------------------------------------------------------------
    def _init_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if group["algorithm"] == "muon":
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def load_state_dict(self, state_dict: dict) -> None:
        """``Optimizer.load_state_dict``, after checking the state (``_state_check.check_loaded_state``):
        raises ``ValueError`` naming the parameter, before anything is loaded, when its state lacks a key
        of this optimizer's (``momentum_buffer`` for a Muon group; ``step``, ``exp_avg``, ``exp_avg_sq``
        for an AdamW group) or has another, or holds a tensor of another shape or layout."""
        check_loaded_state(self, state_dict)
        super().load_state_dict(state_dict)

    def _info(self, p: Tensor) -> ShardInfo:
        info = self._infos.get(id(p))
        if info is None or info.local.data_ptr() != local_flat(p).data_ptr():
            info = self._infos[id(p)] = shard_info(p, f"#{self._index.get(id(p))}", tp="global")
        return info

    # -- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (collective over every Muon parameter's shard group); returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = {
            "collectives": 0,
            "ns_calls": 0,
            "ns_flops": 0,
            "ns_matrices": [],
            "sent_elements": 0,
            "chunks": 0,
            "ns_s": 0.0,
            "wait_s": 0.0,
        }
        buckets: dict[tuple, list] = defaultdict(list)
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
                continue
            mu, lr, wd = group["momentum"], float(group["lr"]), group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p) or p.grad.is_sparse:
                    raise RuntimeError("Muon does not support complex parameters or sparse gradients")
                info = self._info(p)
                g = local_flat(p.grad)
                buf = local_flat(self.state[p]["momentum_buffer"])
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                info.local.mul_(1 - lr * wd)
                # one plan per layout of the world (FSDP x TP pieces differ from the replicated ones)
                key = (info.world, info.holders) if info.group is not None else ("local", id(p))
                buckets[key].append((p, info, group, update))
        for key in sorted(buckets, key=str):
            self._orthogonalize(buckets[key], stats)
        self.last_step_stats = stats
        return loss

    def _plan(self, items):
        """Matrices, owners, chunks and this rank's exchange lists (cached per layout): see ``_muon_plan``."""
        info0 = items[0][1]
        key = (info0.me, self.pipeline_chunks) + tuple((id(p), info.ranges) for p, info, _, _ in items)
        plan = self._plans.get(key)
        if plan is None:
            mats: list[Matrix] = []
            for i, (_, info, _, _) in enumerate(items):
                mats += split_matrices(i, matrices_of(info.shape), info.ranges, info.holders)
            owners, loads = assign_owners(mats, len(info0.replica), self.balance_slack)
            chunk, n_chunks = chunk_of(mats, owners, self.pipeline_chunks) if mats else ([], 0)
            ex = plan_exchange(mats, owners, chunk, n_chunks, info0.replica, info0.me)
            piece = info0.holders.index(next(h for h in info0.holders if info0.me in h))
            starts = [items[m.item][1].ranges[piece][0] for m in mats]  # param-flat offset of my piece
            plan = self._plans[key] = (mats, owners, ex, starts, loads)
        return plan

    def _orthogonalize(self, items, stats) -> None:
        """Steps 2-5 of the module docstring for one mesh's parameters (collective over its world)."""
        info0 = items[0][1]
        me, dt = info0.me, self.ns_dtype
        mats, _, ex, starts, _ = self._plan(items)
        group = self._world_group(info0) if any(e.gather or e.scatter for e in ex) else None

        def piece_of(j, lo, hi):  # my update's elements [lo, hi) of matrix j (param-flat)
            return items[mats[j].item][3][lo - starts[j] : hi - starts[j]]

        def launch_gather(c):
            e = ex[c]
            if not e.gather:
                return None
            send = [piece_of(j, lo, hi).to(dt) for lst in e.gather_send for j, lo, hi in lst]
            return self._all_to_all(send, e.gather_send, e.gather_recv, info0, group, stats)

        def launch_scatter(c, ortho):
            e = ex[c]
            if not e.scatter:
                return None
            send = [
                ortho[j][lo - mats[j].start : hi - mats[j].start]
                for lst in e.scatter_send
                for j, lo, hi in lst
            ]
            return self._all_to_all(send, e.scatter_send, e.scatter_recv, info0, group, stats)

        def finish_scatter(c, handle):
            if handle is None:
                return
            recv = self._wait(handle, stats)
            off = 0
            for lst in ex[c].scatter_recv:
                for j, lo, hi in lst:
                    self._apply(items, mats[j], recv[off : off + hi - lo], lo, hi, starts[j])
                    off += hi - lo

        nxt = launch_gather(0) if ex else None
        prev = None
        for c, e in enumerate(ex):
            cur, nxt = nxt, (launch_gather(c + 1) if c + 1 < len(ex) else None)
            received: dict[tuple[int, int], Tensor] = {}
            if cur is not None:
                recv, off = self._wait(cur, stats), 0
                for lst in e.gather_recv:
                    for j, lo, hi in lst:
                        received[(j, lo)] = recv[off : off + hi - lo]
                        off += hi - lo
            ortho: dict[int, Tensor] = {}
            t0 = time.perf_counter()
            for j in e.mine:
                m = mats[j]
                group_ = items[m.item][2]
                src = [piece_of(j, lo, hi) if me in hs else received[(j, lo)] for hs, lo, hi in m.parts]
                src = src[0] if len(src) == 1 else torch.cat([x.to(dt) for x in src])
                tp_cols = items[m.item][1].tp_cols  # FSDP x TP rowwise: TP-major parts -> the matrix
                o = self._ns(
                    tp_major_to_matrix(src, m.rows, m.cols, tp_cols),
                    group_["ns_coefficients"],
                    group_["ns_steps"],
                    group_["eps"],
                    dt,
                )
                ortho[j] = matrix_to_tp_major(o, tp_cols)
                stats["ns_calls"] += 1
                stats["ns_flops"] += ns_flops(m.rows, m.cols, group_["ns_steps"])
                stats["ns_matrices"].append((self._index[id(items[m.item][0])], m.start // m.numel))
                for hs, lo, hi in m.parts:
                    if me in hs:  # the owner's own rows: no message
                        self._apply(items, m, ortho[j][lo - m.start : hi - m.start], lo, hi, starts[j])
            stats["ns_s"] += time.perf_counter() - t0
            handle = launch_scatter(c, ortho)
            if prev is not None:
                finish_scatter(*prev)
            prev = (c, handle)
        if prev is not None:
            finish_scatter(*prev)
        stats["chunks"] = max(stats["chunks"], len(ex))

    def _apply(self, items, m: Matrix, delta: Tensor, lo: int, hi: int, a: int) -> None:
        """``p[lo:hi] -= adjusted_lr * delta`` on this rank's piece starting at param-flat ``a``."""
        _, info, group, _ = items[m.item]
        lr = adjust_lr(float(group["lr"]), group["adjust_lr_fn"], m.rows, m.cols)
        info.local[lo - a : hi - a].add_(delta, alpha=-lr)

    def _world_group(self, info: ShardInfo):
        """The process group of every rank of the mesh (``info.world``; group rank = world index)."""
        if info.world == tuple(range(dist.get_world_size())):
            return dist.group.WORLD
        if info.group is not None and tuple(sorted(info.group_key)) == info.world:
            return info.group
        grp = self._groups.get(info.world)
        if grp is None:  # only the mesh's ranks take part (all of them call step())
            grp = self._groups[info.world] = dist.new_group(list(info.world), use_local_synchronization=True)
        return grp

    def _all_to_all(self, send, send_lists, recv_lists, info: ShardInfo, group, stats):
        """Launch one asynchronous ``all_to_all_single`` (uneven splits, zeros allowed) over ``group``."""
        dev = info.local.device
        send_splits = [sum(h - lo for _, lo, h in lst) for lst in send_lists]
        recv_splits = [sum(h - lo for _, lo, h in lst) for lst in recv_lists]
        inp = torch.cat(send) if send else torch.empty(0, dtype=self.ns_dtype, device=dev)
        out = torch.empty(sum(recv_splits), dtype=self.ns_dtype, device=dev)
        bases = use_count(out), use_count(inp)
        work = dist.all_to_all_single(
            *handoff(out, inp), recv_splits, send_splits, group=group, async_op=True
        )
        hold_until_released(out, bases[0])  # Note [gloo release] in raggedfsdp/_release.py
        hold_until_released(inp, bases[1])
        stats["collectives"] += 1
        stats["sent_elements"] += inp.numel()
        return work, out, inp

    @staticmethod
    def _wait(handle, stats) -> Tensor:
        work, out, _ = handle
        t0 = time.perf_counter()
        work.wait()
        stats["wait_s"] += time.perf_counter() - t0
        return out

    def _adamw_step(self, group) -> None:
        """Stock AdamW (``torch.optim.adamw.adamw``) for an ``algorithm="adamw"`` group: element-wise, no
        comms."""
        from torch.optim.adamw import adamw

        ps, gs, ms, vs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            ps.append(p), gs.append(p.grad), ms.append(st["exp_avg"]), vs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not ps:
            return
        b1, b2 = group["betas"]
        adamw(
            ps,
            gs,
            ms,
            vs,
            [],
            steps,
            foreach=group.get("foreach"),
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
