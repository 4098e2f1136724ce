"""Step time of one FSDP training step, predicted from shapes, parallel dims and a cluster description.

Pure arithmetic, nothing allocated (like :mod:`raggedfsdp.app.sizing.memory_estimate`). The model
(veScale-FSDP, arXiv 2602.22437, section 5: "small-scale profiling predicts large runs"; the overlap
schedule is torch FSDP2's, ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``):

* **Compute** of a unit = tokens per rank x FLOPs per token / achieved FLOP/s. FLOPs per token are
  ``2 x active matmul parameters`` (a routed expert counts ``top_k / E``; embeddings count 0) plus
  causal attention ``2 x seq x heads x head_dim`` per full-attention layer, forward; backward is 2x
  forward, activation checkpointing adds one forward. Tensor parallel divides a layer's compute by
  ``tp``.
* **Collectives** use the ring cost ``(n - 1) / n x bytes / bandwidth + (n - 1) x latency`` (all-gather,
  reduce-scatter; all-reduce twice that), all-to-all ``(n - 1) / n x bytes / bandwidth + (n - 1) x
  latency``. A group's bandwidth is the intra-node one when all its ranks sit on one node, else the
  per-device inter-node one. Rank order is torchtitan's: tp innermost, then dp_shard (ep inside it),
  then dp_replicate.
* **Overlap** follows FSDP2: one network queue (the all-gather and reduce-scatter streams share the
  links, so their transfers are serialised FIFO by issue time); the all-gather of unit ``i + 1`` is
  issued when unit ``i - 1`` has been resharded (two unsharded units at most); a reduce-scatter is
  issued when its unit's backward ends, HSDP's all-reduce right after it. Tensor- and expert-parallel
  collectives are on the critical path (exposed).
* **Layouts**: ours all-gathers ``world x S`` elements per unit (the planner's shard size, padding
  included) with no copy-in / copy-out, and folds per-parameter gradients into the flat buffer (one
  read + write of the unit's gradient bytes on the compute stream). FSDP2 pads each parameter's dim 0
  to the group size and copies in (all-gather stream), copies out (compute stream) and copies the
  gradients into the reduce-scatter input (reduce-scatter stream), each a read + write at HBM speed.
* **Host**: a fixed CPU cost per unit and phase (``Cluster.host_s_per_unit``) plus one per parameter
  tensor and phase (``host_s_per_tensor``, the optimizer step included), on the critical path when the
  device is faster than the host.
* **A CPU host** (``Cluster.shared_host``, the ``cpu`` preset): the devices are the machine's cores,
  nothing overlaps (gloo and compute share the cores), ``work_s`` is a rank's CPU seconds per step and
  ranks beyond the cores time-share them (elapsed ``step_s = work_s x ranks / cores``). gloo's
  collectives also copy their whole buffer once at memory speed (``_allgather_base`` gathers into a
  temporary; our reduce-scatter is an in-place all-reduce and a slice copy): a cost that appears at 2
  ranks and does not grow with the ring, unlike its ``(n - 1) / n`` part.
* **Optimizer**: memory-bound AdamW (``OPT_BYTES_PER_ELEM`` bytes touched per shard element at HBM
  speed); Muon adds its Newton-Schulz FLOPs spread over all ranks.

Every number the model uses is in :class:`Cluster` (presets below, sources named) or is derived
from the model config; ``sizing/steptime_search.py`` uses :func:`estimate_time`: ``rank_configs``
searches the parallel configurations, ``calibrate`` fits a cluster's compute / network constants from
measured steps, ``format_time_report`` prints one. Units: seconds, bytes, FLOP/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from raggedfsdp.planner.planner import plan_layout
from raggedfsdp.planner.policy import make_policy
from raggedfsdp.app.sizing.clusters import CLUSTERS, Cluster

__all__ = [
    "CLUSTERS",
    "Cluster",
    "Parallel",
    "StepTime",
    "builtin_cfg",
    "estimate_time",
]

OPT_BYTES_PER_ELEM = 30.0
"""AdamW step: read fp32 master, grad, two moments; write master, two moments, a bf16 param copy."""


@dataclass(frozen=True)
class Parallel:
    """Parallel dims; ``world = dp_replicate x dp_shard x tp``; ``ep`` divides ``dp_shard``."""

    dp_shard: int
    dp_replicate: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    def check(self) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"estimate_time: {k}={v!r} must be an int >= 1")
        if self.dp_shard % self.ep:
            raise ValueError(
                f"estimate_time: ep={self.ep} must divide dp_shard={self.dp_shard} (experts are split over "
                "a sub-group of the FSDP ranks, torchtitan's dp_shard_mod_ep layout)"
            )


@dataclass
class _UnitCost:
    name: str
    fwd: float  # compute seconds, forward
    ag: float  # all-gather seconds (params)
    rs: float  # reduce-scatter seconds (grads)
    ar: float  # HSDP all-reduce seconds
    exposed_fwd: float  # TP / EP collectives on the critical path, forward
    copy_out: float = 0.0  # compute stream, after the all-gather
    copy_in: float = 0.0  # network stream, before the all-gather
    rs_copy: float = 0.0  # network stream, before the reduce-scatter
    grad_fold: float = 0.0  # compute stream, after the unit's backward
    shard: int = 0  # elements per rank
    padded: int = 0  # elements all-gathered per rank (group x shard)
    numel: int = 0  # elements of the unit on one TP / EP rank (no padding)
    tensors: int = 0  # parameter tensors of the unit
    ag_bytes: float = 0.0  # bytes one all-gather of the unit puts on each rank (group x shard x wire bytes)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step (forward + backward + optimizer) on one rank."""

    layout: str
    step_s: float
    compute_s: float
    exposed_comm_s: float
    """Step time not covered by compute: exposed FSDP collectives, TP/EP collectives, copies, host."""
    ag_s: float
    rs_s: float
    ar_s: float
    tp_ep_s: float
    copy_s: float
    optim_s: float
    host_s: float
    tokens_per_s: float
    """Global tokens per second (all data-parallel ranks)."""
    mfu: float
    padding_ratio: float
    allgather_bytes: float
    """Largest unit's all-gather output per rank, bytes (the buffer FSDP must hold)."""
    ag_wire_bytes: float = 0.0
    """Bytes one all-gather of every unit (one forward's worth) delivers to each rank: ``param_dtype``
    elements, or with ``all_gather_dtype`` 8-bit codes plus fp32 block scales for the eligible matrices."""
    work_s: float = 0.0
    """Busy seconds of one rank per step (a rank's CPU clock on a ``shared_host``); equal to
    ``step_s`` unless ranks time-share the cores of a shared host."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _coll(nbytes: float, n: int, bw: float, lat: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def _top_k(cfg: dict) -> int:
    for k in ("num_experts_per_tok", "experts_per_token", "moe_top_k"):
        if cfg.get(k):
            return int(cfg[k])
    return 4 if cfg.get("model_type") == "gpt_oss" else 8


def _n_experts(cfg: dict) -> int:
    for k in ("num_local_experts", "n_routed_experts", "num_experts"):
        if cfg.get(k):
            return int(cfg[k])
    return 0


def _is_expert(name: str) -> bool:
    return ".experts." in f".{name}."


_EMBED = ("embed_tokens", "tok_embeddings", "wte.", "embeddings.word")
_ATTN_OUT = ("self_attn.o_proj.weight", "attention.wo.weight", "attn.o_proj.weight", "attn.c_proj.weight")


def _unit_flops(params, cfg: dict, seq: int) -> tuple[float, int, int]:
    """(forward FLOPs per token, attention layers, MoE layers) of a unit's ``(name, shape)`` params.

    HF names (``transformers``) and the built-in models' names are recognised: embeddings cost 0,
    a routed expert's matrix ``top_k / E`` of its FLOPs, an attention output projection marks one
    full-attention layer (``2 x seq x heads x head_dim`` causal attention FLOPs per token).
    """
    E, k = _n_experts(cfg), _top_k(cfg)
    heads = int(cfg.get("num_attention_heads") or 0)
    hd = int(cfg.get("head_dim") or (int(cfg.get("hidden_size", 0)) // max(heads, 1)))
    if cfg.get("v_head_dim"):  # MLA: scores over qk_nope + qk_rope dims, values over v_head_dim
        hd = (
            int(cfg.get("qk_nope_head_dim", 0)) + int(cfg.get("qk_rope_head_dim", 0)) + int(cfg["v_head_dim"])
        ) // 2
    flops = 0.0
    attn, moe = 0, set()
    for name, s in params:
        if len(s) < 2 or any(e in name for e in _EMBED):
            continue
        n = math.prod(s)
        if _is_expert(name):
            flops += 2 * n * (k / E if E else 1.0)
            moe.add(name.split(".experts.")[0] if ".experts." in name else name)
        else:
            flops += 2 * n
        if name.endswith(_ATTN_OUT):
            attn += 1
    flops += attn * 2.0 * seq * heads * hd
    return flops, attn, len(moe)


def builtin_cfg(name: str, flavor: str, **overrides) -> dict:
    """The HF-style config keys the model reads, for a built-in model (``raggedfsdp.app.models``)."""
    from raggedfsdp.app.models import build_model_config

    c = build_model_config(name, flavor, **overrides)
    out = {
        "hidden_size": c.dim,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.dim // c.n_heads,
        "vocab_size": c.vocab_size,
        "model_type": name,
    }
    if getattr(c, "n_experts", 0):
        out.update(num_experts=c.n_experts, num_experts_per_tok=c.top_k)
    return out


def _group_bw(c: Cluster, size: int, stride: int) -> tuple[float, float]:
    """Bandwidth and latency of a group of ``size`` ranks ``stride`` apart in the rank order."""
    if size <= 1 or size * stride <= c.devices_per_node or c.shared_host:
        return c.intra_bw, c.intra_lat
    return c.inter_bw, c.inter_lat


def _shard_size(numels, grans, shapes, m: int, align: int) -> int:
    return plan_layout(numels, grans, m, align=align, order="best", shapes=shapes).shard_size


def _costs(
    units,
    cfg,
    c: Cluster,
    par: Parallel,
    *,
    layout: str,
    tokens: int,
    seq: int,
    param_bytes: int,
    reduce_bytes: int,
    policy: str,
    align: int,
    quant_block: tuple[int, int] | None = None,
) -> list[_UnitCost]:
    from raggedfsdp.app.sizing.modelplan import resolve_unit_blocks

    H = int(cfg.get("hidden_size", 0))
    k = _top_k(cfg)
    M, R, T, EP = par.dp_shard, par.dp_replicate, par.tp, par.ep
    bw_dp, lat_dp = _group_bw(c, M, T)
    bw_e, lat_e = _group_bw(c, M // EP, T * EP)
    bw_rep, lat_rep = _group_bw(c, R, T * M)
    bw_tp, lat_tp = _group_bw(c, T, 1)
    bw_ep, lat_ep = _group_bw(c, EP, T)
    speed = c.peak_flops * c.mfu
    pol = make_policy(policy)
    out = []
    cache: dict = {}
    for u in units:
        flops, n_attn, n_moe = _unit_flops(u.params, cfg, seq)
        # TP splits every matrix of a layer; the embedding / head units split their big matrix too.
        fwd = tokens * flops / T / speed
        groups = []  # (params, fsdp group size, bw, lat, ep divisor)
        dense = [(nm, s) for nm, s in u.params if not _is_expert(nm)]
        experts = [(nm, s) for nm, s in u.params if _is_expert(nm)]
        if experts and EP > 1:
            groups = [(dense, M, bw_dp, lat_dp, 1), (experts, M // EP, bw_e, lat_e, EP)]
        else:
            groups = [(list(u.params), M, bw_dp, lat_dp, 1)]
        ag = rs = ar = copy_out = copy_in = rs_copy = ag_bytes = 0.0
        shard_tot = padded_tot = 0
        numel_local = 0
        for ps, m, bw, lat, div in groups:
            if not ps:
                continue
            # local shapes: TP splits matrices (dim 0 or 1: same element count), EP splits dim 0 of stacks
            numels = [max(math.prod(s) // (T if len(s) >= 2 else 1) // div, 0) for _, s in ps]
            numel_local += sum(numels)
            if layout == "ours":
                shapes = tuple(s for _, s in ps)
                grans, _, _ = resolve_unit_blocks(type(u)(u.name, tuple(ps)), pol, cache)
                grans = [
                    max(1, g // (T if len(s) >= 2 else 1)) if g > 1 else g for g, s in zip(grans, shapes)
                ]
                key = (tuple(numels), tuple(grans), m)
                S = cache.get(key)
                if S is None:
                    S = cache[key] = _shard_size(numels, grans, None, m, align)
            else:
                pad = 0  # FSDP2 pads dim 0 of each (local) tensor to a multiple of the group size
                for (_, s), n in zip(ps, numels):
                    d0 = s[0] // div if div > 1 else s[0]
                    row = n // d0 if d0 else 0
                    pad += (-(-d0 // m) * m - d0) * row
                S = -(-(sum(numels) + pad) // m)
            shard_tot += S
            padded_tot += m * S
            wire = float(param_bytes)  # bytes per gathered element
            if quant_block is not None:  # Note [quantized all-gather]: codes + one fp32 scale per block
                qn = sum(n for (_, sh), n in zip(ps, numels) if _quant_eligible(sh, n, quant_block))
                frac = qn / max(sum(numels), 1)
                wire = frac * (1 + 4 / (quant_block[0] * quant_block[1])) + (1 - frac) * param_bytes
                copy_in += S * (4 + 1) / c.hbm_bw  # quantize: read the fp32 master, write codes
                copy_out += m * S * (1 + param_bytes) / c.hbm_bw  # dequantize into param_dtype
            ag_bytes += m * S * wire
            ag += _coll(m * S * wire, m, bw, lat)
            rs += _coll(m * S * reduce_bytes, m, bw, lat)
            if c.shared_host and m > 1:  # gloo: each collective also copies its whole buffer once
                ag += m * S * wire / c.hbm_bw  # _allgather_base gathers into a temporary
                rs += m * S * reduce_bytes / c.hbm_bw  # ours: in-place all-reduce, then the slice out
            ar += 2 * _coll(S * reduce_bytes, R, bw_rep, lat_rep)
            if layout == "fsdp2":
                copy_in += 2 * S * param_bytes / c.hbm_bw
                copy_out += 2 * m * S * param_bytes / c.hbm_bw
                rs_copy += 2 * m * S * reduce_bytes / c.hbm_bw
        grad_fold = 2 * numel_local * param_bytes / c.hbm_bw if layout == "ours" else 0.0
        act = tokens * H * param_bytes
        exposed = n_attn * 2 * 2 * _coll(act, T, bw_tp, lat_tp) if T > 1 else 0.0  # 2 all-reduces / layer
        if EP > 1 and n_moe:
            exposed += n_moe * 2 * _coll(act * k, EP, bw_ep, lat_ep)  # dispatch + combine
        out.append(
            _UnitCost(
                u.name,
                fwd,
                ag,
                rs,
                ar,
                exposed,
                copy_out,
                copy_in,
                rs_copy,
                grad_fold,
                shard_tot,
                padded_tot,
                numel_local,
                len(u.params),
                ag_bytes,
            )
        )
    return out


def _quant_eligible(shape, numel: int, block: tuple[int, int], min_numel: int = 4096) -> bool:
    """``QuantizedAllGatherPolicy.eligible`` on the (local) element count: a matrix (or stack) of at least
    ``min_numel`` elements whose rows the block height divides."""
    return len(shape) >= 2 and numel >= min_numel and shape[-2] % block[0] == 0


def _simulate(costs: list[_UnitCost], c: Cluster, ac: bool) -> tuple[float, float, float]:
    """(end of backward incl. drained collectives, compute seconds, host seconds)."""
    hosts = [c.host_s_per_unit + c.host_s_per_tensor * u.tensors for u in costs]  # per unit and phase
    n = len(costs)
    comp = 0.0  # compute stream free at
    net = 0.0  # network free at
    host_total = 0.0
    compute_total = 0.0
    if not c.overlap:  # everything serial: the cores do both
        t = 0.0
        for u, host in zip(costs, hosts):
            t += host + u.copy_in + u.ag + u.copy_out + u.fwd + u.exposed_fwd
        for u, host in reversed(list(zip(costs, hosts))):
            bwd = 2 * u.fwd + (u.fwd if ac else 0.0)
            t += host + u.copy_in + u.ag + u.copy_out + bwd + 2 * u.exposed_fwd + u.grad_fold
            t += u.rs_copy + u.rs + u.ar
        compute_total = sum(3 * u.fwd + (u.fwd if ac else 0.0) for u in costs)
        return t, compute_total, 2 * sum(hosts)
    # forward: all-gathers FIFO on the network, at most two unsharded units
    ag_done = [0.0] * n
    comp_end = [0.0] * n
    issue = 0.0
    for i, u in enumerate(costs):
        ready = max(issue, comp_end[i - 2] if i >= 2 else 0.0)
        net = max(net, ready) + u.copy_in + u.ag
        ag_done[i] = net
        start = max(comp, ag_done[i])
        host = hosts[i]
        comp = start + host + u.copy_out + u.fwd + u.exposed_fwd
        comp_end[i] = comp
        host_total += host
        compute_total += u.fwd
    # backward, reverse order; the last forward unit stays unsharded (FSDP2 keeps the root's)
    order = list(reversed(range(n)))
    queue: list[tuple[float, int, float, str]] = []  # (ready, seq, duration, tag)
    seq = 0
    bend: dict[int, float] = {}
    done: dict[str, float] = {}

    def run_until(tag: str) -> float:
        nonlocal net
        while tag not in done:
            queue.sort()
            ready, _, dur, t = queue.pop(0)
            net = max(net, ready) + dur
            done[t] = net
        return done[tag]

    for k, j in enumerate(order):
        u = costs[j]
        if k == 0:
            done[f"ag{j}"] = comp  # still unsharded after forward
        else:
            ready = bend[order[k - 2]] if k >= 2 else comp_end[-1]
            queue.append((ready, seq, u.copy_in + u.ag, f"ag{j}"))
            seq += 1
        # prefetch the next unit's all-gather as soon as the buffer budget allows
        got = run_until(f"ag{j}")
        start = max(comp, got)
        bwd = 2 * u.fwd + (u.fwd if ac else 0.0)
        host = hosts[j]
        comp = start + host + (u.copy_out if k else 0.0) + bwd + 2 * u.exposed_fwd + u.grad_fold
        bend[j] = comp
        queue.append((comp, seq, u.rs_copy + u.rs + u.ar, f"rs{j}"))
        seq += 1
        host_total += host
        compute_total += bwd
    for j in order:
        run_until(f"rs{j}")
    end = max(comp, net)
    return end, compute_total, host_total


def estimate_time(
    units: Sequence[Any],
    cfg: dict,
    *,
    cluster: Cluster | str,
    parallel: Parallel,
    batch: int,
    seq_len: int,
    layout: str = "ours",
    param_bytes: int = 2,
    reduce_bytes: int = 4,
    policy: str = "element",
    activation_checkpointing: bool = False,
    optimizer: str = "adamw",
    all_gather_dtype: str = "none",
) -> StepTime:
    """Predicted step time on one rank.

    Args:
        units: FSDP units with shapes (:func:`raggedfsdp.app.sizing.archs.model_units`), forward order.
        cfg: the model config (hidden size, heads, experts, top-k) the units came from.
        cluster: a :class:`Cluster` or a :data:`CLUSTERS` name.
        parallel: the dims; ``parallel.world`` ranks in all.
        batch: sequences per data-parallel rank per step (micro-batch x accumulation).
        seq_len: tokens per sequence.
        layout: ``"ours"`` (planner layout, copy-free) or ``"fsdp2"`` (dim-0 padding, copies).
        param_bytes / reduce_bytes: bytes per element of ``param_dtype`` / ``reduce_dtype``.
        policy: block spec of the planner (``"row"``, ``"element"``, ...), ours only.
        optimizer: ``"adamw"`` or ``"muon"`` (adds Newton-Schulz FLOPs over all ranks).
        all_gather_dtype: ``"none"``, or ``"fp8_e4m3"`` / ``"int8"`` (ours only): the quantized parameter
            all-gather (``QuantizedAllGatherPolicy``, 32x32 blocks, docs/quantized_comm.md): eligible
            matrices travel as 1-byte codes plus a 4-byte scale per block, the rest in ``param_dtype``;
            the quantize (fp32 read, code write) and dequantize passes are charged at HBM bandwidth.
            The whole-block-row granularity it adds to the layout is not modelled.

    Raises:
        ValueError: unknown cluster / layout / optimizer, or invalid parallel dims (also ``ep > 1`` on a
            model without routed experts, or an expert count ``ep`` does not divide, as
            :func:`raggedfsdp.app.sizing.ep.split_units_for_ep`).
    """
    if isinstance(cluster, str):
        if cluster not in CLUSTERS:
            raise ValueError(f"estimate_time: unknown cluster {cluster!r}; choose one of {sorted(CLUSTERS)}")
        cluster = CLUSTERS[cluster]
    if layout not in ("ours", "fsdp2"):
        raise ValueError(f"estimate_time: layout={layout!r} must be 'ours' or 'fsdp2'")
    if all_gather_dtype not in ("none", "fp8_e4m3", "int8"):
        raise ValueError(
            f"estimate_time: all_gather_dtype={all_gather_dtype!r} must be 'none', 'fp8_e4m3' or 'int8'"
        )
    if all_gather_dtype != "none" and layout != "ours":
        raise ValueError(
            f"estimate_time: all_gather_dtype={all_gather_dtype!r} is raggedfsdp's quantized all-gather; "
            f"layout={layout!r} (torch's fully_shard) gathers in param_dtype: use layout='ours'"
        )
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"estimate_time: optimizer={optimizer!r} must be 'adamw' or 'muon'")
    for k, v in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"estimate_time: {k}={v!r} must be an int >= 1")
    parallel.check()
    if parallel.ep > 1:  # the check of plan / estimate-memory: a dense model (or E % ep) is refused
        from raggedfsdp.app.sizing.ep import split_units_for_ep

        split_units_for_ep(units, parallel.ep)
    c = cluster
    tokens = batch * seq_len
    align = 8 if param_bytes == 2 else 4
    costs = _costs(
        units,
        cfg,
        c,
        parallel,
        layout=layout,
        tokens=tokens,
        seq=seq_len,
        param_bytes=param_bytes,
        reduce_bytes=reduce_bytes,
        policy=policy,
        align=align,
        quant_block=(32, 32) if all_gather_dtype != "none" else None,
    )
    end, compute, host = _simulate(costs, c, activation_checkpointing)
    shard = sum(u.shard for u in costs)
    optim = shard * OPT_BYTES_PER_ELEM / c.hbm_bw + c.host_s_per_tensor * sum(u.tensors for u in costs)
    if optimizer == "muon":
        from raggedfsdp.optim import ns_flops

        ns = sum(
            ns_flops(min(s[-2:]), max(s[-2:])) * math.prod(s[:-2])
            for u in units
            for _, s in u.params
            if len(s) >= 2
        )
        optim += ns / parallel.world / (c.peak_flops * c.mfu)
    work = end + optim
    # a shared CPU host: ranks beyond its cores time-share them (the elapsed step stretches)
    step = work * max(1.0, parallel.world / c.devices_per_node) if c.shared_host else work
    numel = sum(u.numel for u in costs)
    padded = sum(u.padded for u in costs)
    model_flops = sum(3 * tokens * _unit_flops(u.params, cfg, seq_len)[0] for u in units)
    dp = parallel.dp_shard * parallel.dp_replicate
    return StepTime(
        layout=layout,
        step_s=step,
        compute_s=compute,
        exposed_comm_s=max(work - compute - optim, 0.0),
        ag_s=sum(u.ag for u in costs),
        rs_s=sum(u.rs for u in costs),
        ar_s=sum(u.ar for u in costs),
        tp_ep_s=sum(3 * u.exposed_fwd for u in costs),
        copy_s=sum(u.copy_in + 2 * u.copy_out + u.rs_copy + u.grad_fold for u in costs),
        optim_s=optim,
        host_s=host,
        tokens_per_s=tokens * dp / step if step else 0.0,
        mfu=model_flops / parallel.tp / (step * c.peak_flops) if step else 0.0,
        padding_ratio=1 - numel / padded if padded else 0.0,
        allgather_bytes=max((u.padded for u in costs), default=0) * param_bytes,
        ag_wire_bytes=sum(u.ag_bytes for u in costs),
        work_s=work,
    )
