"""Distributed Muon on RaggedShard parameters: one Newton-Schulz per matrix per step, on one owner rank.

Per step, for every process group (the ragged mesh dim of the parameters; one per FSDP/HSDP mesh):

1. momentum (EMA, torch.optim.Muon's rule) and weight decay, element-wise on each rank's own piece;
2. ONE ``all_to_all_single`` sends every piece of a matrix that is split over ranks to that matrix's
   owner (in ``ns_dtype``, bfloat16: exactly the values torch's Newton-Schulz starts from);
3. each owner runs Newton-Schulz on its matrices (whole-on-one-rank matrices in place, no comms);
4. ONE ``all_to_all_single`` sends each rank the rows of the orthogonalised update it holds;
5. each rank adds its slice of the update with the matrix's adjusted learning rate.

So a step costs 0 collectives (every matrix whole on one rank) or 2, whatever the number of
tensors; uneven splits (including zeros, for ranks with empty pieces) are fine on gloo and NCCL.
Every rank derives owners and splits from global metadata, so a rank holding nothing still joins
the same two collectives and nothing hangs. Under HSDP (``(Replicate(), RaggedShard)``) each
replica group runs the same plan over its shard group only: nothing is gathered over the replicate
dim. Single-device reference: :func:`raggedfsdp.optim.reference.muon_reference_step`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from raggedfsdp.optim._muon_plan import Matrix, assign_owners, split_matrices
from raggedfsdp.optim._newton_schulz import (
    ADJUST_LR_FNS,
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    adjust_lr,
    matrices_of,
    newton_schulz,
    ns_flops,
)
from raggedfsdp.optim._shards import ShardInfo, local_flat, shard_info

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
            communication unless that puts its rank above ``(1 + balance_slack)`` times the mean
            Newton-Schulz load (``_muon_plan.assign_owners``); ``None``: never move whole matrices.
        betas: keyword-only, default AdamW betas of ``algorithm="adamw"`` groups.

    Parameters: plain 2-D/3-D tensors, or DTensors with placements ``(RaggedShard,)`` or
    ``(Replicate(), RaggedShard)`` with any ``local_units`` (row- or element-granular, empty pieces).
    A 3-D ``(E, d, h)`` stack gets one Newton-Schulz per ``(d, h)`` expert (lr adjusted by ``(d, h)``).
    State: ``momentum_buffer`` (a DTensor sharded like the parameter), created at construction, so
    ``state_dict()`` and DCP (``get_optimizer_state_dict``) work before the first step and reshard
    on load. Owners are not state: they are recomputed from the layout.

    Which ranks: ``step()`` is collective over each parameter's shard group; all ranks must call it,
    with ``p.grad`` set (or ``None``) consistently across ranks.
    After each step ``last_step_stats`` holds ``collectives``, ``ns_calls``, ``ns_flops``,
    ``ns_matrices`` (``(param_index, matrix_index)`` orthogonalised on this rank), ``sent_elements``.

    Raises:
        ValueError: negative lr/momentum/weight_decay, unknown ``adjust_lr_fn`` or ``algorithm``, a Muon
            parameter that is not 2-D or 3-D (naming it and pointing to ``muon_param_groups``).
        NotImplementedError: tensor-parallel (``Shard``) placements.
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
    ) -> None:
        for nm, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not float(v) >= 0.0:
                raise ValueError(f"Muon: {nm}={v} must be >= 0")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Muon: adjust_lr_fn={adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")
        if ns_steps >= 100:
            raise ValueError(f"Muon: ns_steps={ns_steps} must be < 100")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                        "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                        "adjust_lr_fn": adjust_lr_fn, "algorithm": "muon", "betas": tuple(betas)}
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.balance_slack = balance_slack
        self._index: dict[int, int] = {}
        self._infos: dict[int, ShardInfo] = {}
        self._plans: dict[Any, tuple[list[Matrix], list[int]]] = {}
        self.last_step_stats: dict[str, Any] = {}
        for group in self.param_groups:
            if group["algorithm"] not in ALGORITHMS:
                raise ValueError(f"Muon: param group algorithm={group['algorithm']!r} must be one of {ALGORITHMS}")
            for p in group["params"]:
                self._index[id(p)] = len(self._index)
                if group["algorithm"] == "muon":
                    if p.ndim not in (2, 3):
                        raise ValueError(
                            f"Muon: parameter #{self._index[id(p)]} of shape {tuple(p.shape)} is not a matrix or "
                            "an expert stack (E, d, h); give it to AdamW, e.g. "
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

    def _info(self, p: Tensor) -> ShardInfo:
        info = self._infos.get(id(p))
        if info is None or info.local.data_ptr() != local_flat(p).data_ptr():
            info = self._infos[id(p)] = shard_info(p, f"#{self._index.get(id(p))}")
        return info

    # -- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (collective over every Muon parameter's shard group); returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = {"collectives": 0, "ns_calls": 0, "ns_flops": 0, "ns_matrices": [], "sent_elements": 0}
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
                key = info.group_key if info.group is not None else ("local", id(p))
                buckets[key].append((p, info, group, update))
        for key in sorted(buckets, key=str):
            self._orthogonalize(buckets[key], stats)
        self.last_step_stats = stats
        return loss

    def _plan(self, items, me: int):
        """Matrices, owners and this rank's send lists (cached per layout): see ``_muon_plan``."""
        key = (me,) + tuple((id(p), info.ranges) for p, info, _, _ in items)
        plan = self._plans.get(key)
        if plan is None:
            mats: list[Matrix] = []
            for i, (_, info, _, _) in enumerate(items):
                mats += split_matrices(i, matrices_of(info.shape), info.ranges)
            ws = items[0][1].world_size
            owners, _ = assign_owners(mats, ws, self.balance_slack)
            # to_owner[q]: (j, lo, hi) of my parts of split matrices owned by q;
            # from_rank[q]: (j, lo, hi) of q's parts of split matrices owned by me (both in j order)
            to_owner: list[list] = [[] for _ in range(ws)]
            from_rank: list[list] = [[] for _ in range(ws)]
            for j, m in enumerate(mats):
                if m.whole_on == owners[j]:
                    continue  # computed where it lies: no communication
                for q, lo, hi in m.parts:
                    if q == me:
                        to_owner[owners[j]].append((j, lo, hi))
                    if owners[j] == me:
                        from_rank[q].append((j, lo, hi))
            plan = self._plans[key] = (mats, owners, to_owner, from_rank)
        return plan

    def _orthogonalize(self, items, stats) -> None:
        """Steps 2-5 of the module docstring for one process group's parameters (collective)."""
        info0 = items[0][1]
        me, dt = info0.rank, self.ns_dtype
        mats, owners, to_owner, from_rank = self._plan(items, me)
        starts = [items[m.item][1].ranges[me][0] for m in mats]  # param-flat offset of my piece
        shared = any(m.whole_on != o for m, o in zip(mats, owners))  # global metadata: same on every rank

        full: dict[int, Tensor] = {}
        if shared:  # gather split matrices to their owners: one all_to_all_single
            send = [items[mats[j].item][3][lo - starts[j]:hi - starts[j]].to(dt) for lst in to_owner
                    for j, lo, hi in lst]
            recv = self._all_to_all(send, [sum(h - l for _, l, h in lst) for lst in to_owner],
                                    [sum(h - l for _, l, h in lst) for lst in from_rank], info0, stats)
            chunks: dict[int, list[Tensor]] = defaultdict(list)
            off = 0
            for lst in from_rank:
                for j, lo, hi in lst:
                    chunks[j].append(recv[off:off + hi - lo])
                    off += hi - lo
            full = {j: torch.cat(c) for j, c in chunks.items()}
        ortho: dict[int, Tensor] = {}
        for j, m in enumerate(mats):
            if owners[j] != me:
                continue
            p, _, group, update = items[m.item]
            src = full[j] if j in full else update[m.start - starts[j]:m.start + m.numel - starts[j]]
            o = newton_schulz(src.view(m.rows, m.cols), group["ns_coefficients"], group["ns_steps"],
                              group["eps"], dt)
            ortho[j] = o.reshape(-1)
            stats["ns_calls"] += 1
            stats["ns_flops"] += ns_flops(m.rows, m.cols, group["ns_steps"])
            stats["ns_matrices"].append((self._index[id(p)], m.start // m.numel))
            if m.whole_on == me:
                self._apply(items, m, ortho[j], m.start, m.start + m.numel, starts[j])
        if shared:  # scatter the orthogonalised rows back: one all_to_all_single
            send = [ortho[j][lo - mats[j].start:hi - mats[j].start] for lst in from_rank for j, lo, hi in lst]
            recv = self._all_to_all(send, [sum(h - l for _, l, h in lst) for lst in from_rank],
                                    [sum(h - l for _, l, h in lst) for lst in to_owner], info0, stats)
            off = 0
            for lst in to_owner:
                for j, lo, hi in lst:
                    self._apply(items, mats[j], recv[off:off + hi - lo], lo, hi, starts[j])
                    off += hi - lo

    def _apply(self, items, m: Matrix, delta: Tensor, lo: int, hi: int, a: int) -> None:
        """``p[lo:hi] -= adjusted_lr * delta`` on this rank's piece starting at param-flat ``a``."""
        _, info, group, _ = items[m.item]
        lr = adjust_lr(float(group["lr"]), group["adjust_lr_fn"], m.rows, m.cols)
        info.local[lo - a:hi - a].add_(delta, alpha=-lr)

    def _all_to_all(self, send, send_splits, recv_splits, info: ShardInfo, stats) -> Tensor:
        dev = info.local.device
        inp = torch.cat(send) if send else torch.empty(0, dtype=self.ns_dtype, device=dev)
        out = torch.empty(sum(recv_splits), dtype=self.ns_dtype, device=dev)
        dist.all_to_all_single(out, inp, recv_splits, send_splits, group=info.group)
        stats["collectives"] += 1
        stats["sent_elements"] += inp.numel()
        return out

    def _adamw_step(self, group) -> None:
        """Stock AdamW (``torch.optim.adamw.adamw``) for an ``algorithm="adamw"`` group: element-wise, no comms."""
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
        adamw(ps, gs, ms, vs, [], steps, foreach=group.get("foreach"), amsgrad=False, beta1=b1, beta2=b2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
