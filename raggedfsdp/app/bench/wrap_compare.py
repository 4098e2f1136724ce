"""Choose the FSDP unit by measurement: the same model wrapped two (or more) ways, side by side.

For a hybrid model the unit is one layer or one super-block (3 Gated DeltaNet layers + 1 full
attention layer). A super-block unit issues a quarter of the all-gathers and reduce-scatters
(less per-collective latency, better bandwidth use, fewer tensor boundaries to pad) but holds four
layers' unsharded parameters and gradients at once (a larger working set). Which wins depends on
the model, the interconnect and the world size -- "only measurement decides" -- so this measures it.

Method (collective: every rank runs :func:`compare_wraps`, rank 0 gets the result):

1. one model per wrap, same init (``build()``), same AdamW, same data;
2. ``warmup`` untimed steps of each, then ``steps`` timed repetitions whose internal order
   alternates (so slow drift of a shared machine cancels); a barrier and a device sync around
   each step; a step's time is that of the slowest rank; the median is reported;
3. one step of each under the project's peak-memory method (``raggedfsdp.app.bench.memory.PeakMemory``:
   the CUDA allocator's peak on GPU, CPU allocator events on CPU): a rank's peak is its persistent
   state (distinct storages of its sharded params, grads and optimizer state) plus the step's peak
   above it; the maximum over ranks is reported;
4. padding: the bytes of padding in each wrap's flat sharded buffers (the planner's layouts).

Recommendation: the faster wrap when the step-time gap is larger than the measured noise (the
larger of the two inter-quartile ranges, and at least 2%); otherwise the one whose peak is more than
2% smaller; otherwise "no clear winner" and the default unit (``layer``).
Both wraps compute the same function: their final losses must agree (reported).

Run it with ``raggedfsdp wrap-bench --nproc 2 --wrap layer,superblock`` (or, without the bench,
``torchrun --nproc-per-node N -m raggedfsdp.app.bench.wrap_compare``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._python_dispatch
from torch.distributed.elastic.multiprocessing.errors import record

__all__ = ["compare_wraps", "format_wrap_report", "recommend"]

NOISE_FLOOR = 0.02  # relative step-time difference below which two wraps count as equally fast
MEMORY_NOISE = 0.02  # relative peak-memory difference below which two wraps count as equally large


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, opt, tok) -> torch.Tensor:
    logits = model(tok[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _peak_memory(device: torch.device):
    """``raggedfsdp.app.bench.memory.PeakMemory(device)``: the shared peak-memory method (docs/memory.md)."""
    from raggedfsdp.app.bench.memory import PeakMemory

    return PeakMemory(device)


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _state_bytes(model, opt) -> int:
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    for st in opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return _storage_bytes(tensors)


def fsdp_padding_bytes(model, world_size: int) -> tuple[int, int]:
    """``(padding bytes, number of FSDP units)`` of a sharded model: the planned layouts' padding for
    ``raggedfsdp.fully_shard``; for torch's ``fully_shard`` its ``Shard(0)`` padding (dim 0 rounded up
    to a multiple of the world size, per parameter)."""
    from raggedfsdp.fsdp import fsdp_units

    units = fsdp_units(model)
    if units:
        return sum(u.padding_bytes for u in units), len(units)
    total = 0
    groups = set()
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        pg = getattr(get(), "_fsdp_param_group", None) if get is not None else None
        if pg is not None:
            groups.add(id(pg))
    for p in model.parameters():
        d0 = p.shape[0]
        total += (-(-d0 // world_size) * world_size - d0) * (p.numel() // max(d0, 1)) * p.element_size()
    return total, len(groups)


class _CollectiveCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ``c10d`` collectives dispatched under it, by op (all-gathers, reduce-scatters, ...)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        pkt = str(func.overloadpacket)
        if pkt.startswith("c10d.") and "barrier" not in pkt:
            name = pkt.removeprefix("c10d.").strip("_")
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def compare_wraps(
    build: Callable[[], torch.nn.Module],
    wraps: dict[str, Callable[[torch.nn.Module, Any], Any]],
    *,
    device: torch.device,
    steps: int = 6,
    warmup: int = 1,
    batch: int = 2,
    seq: int = 64,
    vocab: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict | None:
    """Measure each wrap of ``build()``'s model; collective, rank 0 returns the result dict.

    Args:
        build: returns the initialised, unsharded model on the CPU (called once per wrap; must give
            the same weights each time).
        wraps: ``name -> wrap(model, mesh)`` applying FSDP in place, e.g.
            ``{"layer": ..., "superblock": ...}`` (see :func:`raggedfsdp.app.models.apply_fsdp`).
        device: this rank's device; steps/warmup/batch/seq: timed steps, untimed steps, sequences per
            rank, tokens per sequence.

    Returns:
        On rank 0: ``{"wraps": {name: {"step_seconds_median", "step_seconds", "peak_memory_bytes",
        "peak_memory_bytes_per_rank", "state_bytes_per_rank", "padding_bytes", "fsdp_units",
        "final_loss"}}, "recommendation", "reason", "final_loss_abs_diff", ...}``; ``None`` elsewhere.

    Raises:
        ValueError: fewer than two wraps, or ``steps < 1``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if len(wraps) < 2:
        raise ValueError(f"compare_wraps: give at least two wraps to compare, got {sorted(wraps)}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"compare_wraps: steps must be >= 1 and warmup >= 0, got {steps=} {warmup=}")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (ws,))
    systems = {}
    for name, wrap in wraps.items():
        model = build().to(device)
        wrap(model, mesh)
        systems[name] = (model, torch.optim.AdamW(model.parameters(), lr=lr))
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(warmup + steps + 1)]
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, torch.Tensor] = {}
    for i in range(warmup + steps):
        tok = batches[i].to(device)
        for n in names if i % 2 == 0 else names[::-1]:
            model, opt = systems[n]
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            last[n] = _step(model, opt, tok)
            _sync(device)
            if i >= warmup:
                times[n].append(time.perf_counter() - t0)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    final = torch.stack([last[n].float().cpu() for n in names])
    dist.all_reduce(final)
    final /= ws
    counts = {}
    for n in names:  # one counted step each: collectives per step
        model, opt = systems[n]
        with _CollectiveCounter() as cc:
            _step(model, opt, batches[-1].to(device))
        counts[n] = cc.calls
    mem = []
    for n in names:
        model, opt = systems[n]
        tok = batches[-1].to(device)
        base = _state_bytes(model, opt)
        dist.barrier()
        with _peak_memory(device) as pm:
            _step(model, opt, tok)
        mem.append([base, base + pm.peak_bytes])
    mem_t = torch.tensor(mem, dtype=torch.float64)
    gathered = [torch.zeros_like(mem_t) for _ in range(ws)]
    dist.all_gather(gathered, mem_t)
    if rank != 0:
        return None
    out: dict[str, dict] = {}
    for a, n in enumerate(names):
        st = t[a].tolist()
        pad, units = fsdp_padding_bytes(systems[n][0], ws)
        per_rank = [int(g[a, 1]) for g in gathered]
        out[n] = dict(
            step_seconds_median=statistics.median(st),
            step_seconds=st,
            tokens_per_second=ws * batch * seq / statistics.median(st),
            peak_memory_bytes=max(per_rank),
            peak_memory_bytes_per_rank=per_rank,
            state_bytes_per_rank=[int(g[a, 0]) for g in gathered],
            padding_bytes=pad,
            fsdp_units=units,
            collectives=counts[n],
            final_loss=float(final[a]),
        )
    best, reason = recommend(out)
    losses = [r["final_loss"] for r in out.values()]
    return dict(
        wraps=out,
        recommendation=best,
        reason=reason,
        final_loss_abs_diff=max(losses) - min(losses),
        nproc=ws,
        steps=steps,
        warmup=warmup,
        batch_per_rank=batch,
        seq=seq,
        device=str(device),
        torch_version=torch.__version__,
        threads_per_rank=torch.get_num_threads(),
        num_params=sum(p.numel() for p in systems[names[0]][0].parameters()),
    )


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return (max(xs) - min(xs)) / 2 if len(xs) > 1 else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def recommend(results: dict[str, dict], default: str = "layer") -> tuple[str, str]:
    """``(wrap name, reason)``: the fastest, unless within noise of the runner-up; then the one whose
    peak memory is more than ``MEMORY_NOISE`` smaller; if neither decides, no clear winner: ``default``
    (the config's default unit) when it was measured, else the faster one."""
    ranked = sorted(results, key=lambda n: results[n]["step_seconds_median"])
    a, b = ranked[0], ranked[1]
    ta, tb = results[a]["step_seconds_median"], results[b]["step_seconds_median"]
    noise = max(_iqr(results[a]["step_seconds"]), _iqr(results[b]["step_seconds"]), NOISE_FLOOR * tb)
    if tb - ta > noise:
        return (
            a,
            f"{a} is {tb / ta:.2f}x faster than {b} (gap {1e3 * (tb - ta):.1f} ms > noise {1e3 * noise:.1f} "
            f"ms)",
        )
    small = min(ranked[:2], key=lambda n: results[n]["peak_memory_bytes"])
    other = b if small == a else a
    ps, po = results[small]["peak_memory_bytes"], results[other]["peak_memory_bytes"]
    times = f"step times within noise ({1e3 * ta:.1f} vs {1e3 * tb:.1f} ms, noise {1e3 * noise:.1f} ms)"
    if po - ps > MEMORY_NOISE * po:
        return small, f"{times}; {small}'s peak is {1 - ps / po:.0%} smaller ({_mib(ps)} vs {_mib(po)})"
    pick = default if default in ranked[:2] else a
    return pick, (
        f"no clear winner: {times}, peaks within {MEMORY_NOISE:.0%} ({_mib(ps)} vs {_mib(po)}); "
        + (f"{pick} is the default" if pick == default else f"{pick} was faster")
    )


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def format_wrap_report(r: dict, title: str = "") -> str:
    """The side-by-side table of a :func:`compare_wraps` result."""
    head = title or "wrap comparison"
    lines = [
        f"{head}: {r['num_params']:,} params, {r['nproc']} ranks on {r['device']} "
        f"({r['threads_per_rank']} threads each), batch/rank {r['batch_per_rank']} x seq {r['seq']}, "
        f"{r['steps']} alternated steps, torch {r['torch_version']}",
        f"{'wrap':<12} {'units':>5} {'step (median)':>14} {'tok/s':>10} {'peak mem/rank':>14} "
        f"{'padding':>11} {'final loss':>11}  collectives/step",
    ]
    for n, w in r["wraps"].items():
        lines.append(
            f"{n:<12} {w['fsdp_units']:>5} {1e3 * w['step_seconds_median']:>11.1f} ms "
            f"{w['tokens_per_second']:>10,.0f} {_mib(w['peak_memory_bytes']):>14} "
            f"{_mib(w['padding_bytes']):>11} {w['final_loss']:>11.4f}  "
            + ", ".join(f"{k} {v}" for k, v in sorted(w.get("collectives", {}).items()))
        )
    lines.append(f"recommendation: --fsdp.unit {r['recommendation']} ({r['reason']})")
    return "\n".join(lines)


# -- standalone entry (torchrun) ------------------------------------------------------------


def hybrid_wraps(
    model_name: str,
    flavor: str,
    units: list[str],
    *,
    param_dtype: str = "fp32",
    seed: int = 0,
    backend: str = "ragged",
):
    """``(build, wraps)`` for :func:`compare_wraps` on a built-in model with ``backend``'s
    ``fully_shard`` (``"ragged"``: ours, ``"torch"``: FSDP2)."""
    from raggedfsdp.app.models import apply_fsdp, build_model, make_mp_policy

    def build():
        m = build_model(model_name, flavor)
        m.init_weights(seed)
        return m

    mp = make_mp_policy(backend, param_dtype=param_dtype)
    wraps = {
        u: (lambda model, mesh, u=u: apply_fsdp(model, mesh, backend=backend, mp_policy=mp, unit=u))
        for u in units
    }
    return build, wraps


@record
def main(argv: list[str] | None = None) -> int:
    from datetime import timedelta

    from raggedfsdp.app.bench.options import wrap_bench_parser

    args = wrap_bench_parser().parse_args(argv)
    from raggedfsdp.app.launch.env import quiet_profiler_logs

    quiet_profiler_logs()  # before the first profiler session (kineto reads its level then)
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29541"),
        )
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=timedelta(seconds=600))
    from raggedfsdp.app.launch.failures import report_rank_failure
    from raggedfsdp.teardown import shutdown_process_group

    rank, ws = dist.get_rank(), dist.get_world_size()
    ok = False
    try:
        build, wraps = hybrid_wraps(
            args.model,
            args.flavor,
            args.wrap.split(","),
            param_dtype=args.param_dtype,
            seed=args.seed,
            backend=args.backend,
        )
        r = compare_wraps(
            build,
            wraps,
            device=device,
            steps=args.steps,
            warmup=args.warmup,
            batch=args.batch,
            seq=args.seq,
            seed=args.seed,
        )
        ok = True
    except Exception as e:  # noqa: BLE001 (recorded for the launcher's one last line, exit code 1)
        return report_rank_failure(e, rank, ws, f"[rank {rank}/{ws}]")
    finally:
        shutdown_process_group(synchronize=ok)
    if r is not None:
        r.update(model=args.model, flavor=args.flavor, param_dtype=args.param_dtype, backend=args.backend)
        print(
            json.dumps(r) if args.json else format_wrap_report(r, f"{args.model}/{args.flavor}"), flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
