"""Stage D of benchmarks/gpu/run.sh: a simulated world size 8 on one GPU (torch's fake process group, rank 0).

The fake process group's collectives are no-ops, so every FSDP buffer is allocated at its real
world-size-8 size by the CUDA caching allocator, raggedfsdp's ws > 1 code runs (Work objects,
completion polling, the flag exchange, the deferred agreement check), and compute and copies are
real. Measured on the ~1B dense Llama of stage C1 (bf16 params / fp32 reduce), raggedfsdp vs
torch's ``fully_shard``:

* ``memory``: per-rank ``state`` / fwd+bwd / optimizer-step peaks (``measure_train_step``, each
  system alone); raggedfsdp twice, with collectives reporting "never done" before their wait
  (a network slower than the backward: the worst case) and "done at once" (early free fires);
* ``speed``: step time without communication (interleaved, synchronized), host time to enqueue;
* ``copy_bytes``: bytes written by copy kernels in one step
(``raggedfsdp.app.bench.copy_accounting.CopyCounter``);
* ``overlap``: from a ``torch.profiler`` trace of one step, the fraction of side-stream GPU time
  (raggedfsdp's all-gather-stream casts and reduce-scatter-stream copies; FSDP2's copy-in / copy-out)
  that overlaps compute-stream kernels (``_common.stream_overlap``).

What it cannot show: real NCCL time and its overlap. ``--dry-run``: tiny shapes on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Result,
    device_for,
    init_pg,
    profile,
    section,
    shutdown_pg,
    stream_overlap,
    trace_events,
    write_stdout_json,
)
from train_compare import Bench, config


@contextlib.contextmanager
def comm_completion(done: bool):
    """What raggedfsdp's early-free poll (``CommHandle.is_done``) sees; torch's FSDP2 does not poll."""
    from raggedfsdp.buffer.streams import CommHandle

    orig = CommHandle.is_done
    CommHandle.is_done = (
        (lambda self: True) if done else (lambda self: self.work is None and self.stream is None)
    )
    try:
        yield
    finally:
        CommHandle.is_done = orig


def memory(bench: Bench, res: Result) -> None:
    from raggedfsdp.app.bench.memory import measure_train_step

    out = {}
    for name, system, done in (
        ("settle", "ragged", True),  # discarded: takes the CUDA libraries' one-time allocations
        ("ragged_comm_never", "ragged", False),
        ("ragged_comm_done", "ragged", True),
        ("torch", "torch", False),
    ):
        with section(res, f"memory_{name}"):
            if bench.dev.type == "cuda":
                torch.cuda.empty_cache()
            with comm_completion(done):
                m = measure_train_step(
                    lambda s=system: bench.build(s),
                    lambda model, s=system: bench.loss(s, model, bench.tokens[0]),
                    bench.dev,
                    warmup_steps=1,
                )._asdict()
            m.pop("fwd_bwd_peak_owners", None)
            out[name] = m
            res.set("memory", out)
    if "torch" in out:
        for name in ("ragged_comm_never", "ragged_comm_done"):
            if name in out:
                for k in ("state_bytes", "fwd_bwd_peak_bytes", "optim_peak_bytes"):
                    out[f"ratio_{k.removesuffix('_bytes')}_{name}_over_torch"] = out[name][k] / max(
                        out["torch"][k], 1
                    )
        res.set("memory", out)


def speed_copies_overlap(bench: Bench, res: Result, warmup: int, steps: int) -> None:
    from raggedfsdp.app.bench.copy_accounting import CopyCounter

    if bench.dev.type == "cuda":
        torch.cuda.empty_cache()
    systems = {s: bench.build(s) for s in ("ragged", "torch")}
    rows: dict = {s: [] for s in systems}
    for i in range(warmup + steps):
        for s, (model, opt) in systems.items():
            r = bench.step(s, model, opt, bench.tokens[i % len(bench.tokens)])
            if i >= warmup:
                rows[s].append(r)
    sp = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "loss"} for s, rs in rows.items()}
    sp["step_time_ratio_torch_over_ragged"] = sp["torch"]["wall_s"] / sp["ragged"]["wall_s"]
    res.set("speed_without_comm", sp)
    with section(res, "copy_bytes"):
        cb = {}
        for s, (model, opt) in systems.items():
            with CopyCounter() as c:
                bench.step(s, model, opt, bench.tokens[0])
            cb[s] = {"total_bytes": c.total_bytes, "by_op": dict(c.bytes), "backend_bytes": c.backend_bytes}
        cb["ratio_torch_over_ragged"] = cb["torch"]["total_bytes"] / max(cb["ragged"]["total_bytes"], 1)
        res.set("copy_bytes", cb)
    with section(res, "overlap"):
        ov = {}
        for s, (model, opt) in systems.items():
            with profile(bench.dev) as prof:
                bench.step(s, model, opt, bench.tokens[1])
            ov[s] = stream_overlap(trace_events(prof))
            res.set("overlap", ov)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = device_for(args.dry_run)
    cls, cfg, batch, seq = config("dense", args.dry_run)
    batch = max(1, batch // 2)  # per-rank batch 2 x 2048: memory is dominated by the sharded state anyway
    if args.dry_run:
        args.warmup, args.steps = 1, 1
    res = Result(
        args.out,
        stage="sim_ws8",
        device=str(dev),
        world_size=args.world_size,
        rank=0,
        config=cfg.to_dict(),
        batch=batch,
        seq=seq,
        param_dtype="bf16",
        reduce_dtype="fp32",
    )
    mesh = init_pg(dev, fake_world=args.world_size)
    bench = Bench(cls, cfg, dev, mesh, batch, seq)
    memory(bench, res)
    with section(res, "speed_without_comm"):
        speed_copies_overlap(bench, res, args.warmup, args.steps)
    res.set(
        "ok",
        all(
            k in res.data and "error" not in res.data[k]
            for k in ("memory", "speed_without_comm", "copy_bytes", "overlap")
        ),
    )
    shutdown_pg()
    write_stdout_json(res.data)


if __name__ == "__main__":
    main()
