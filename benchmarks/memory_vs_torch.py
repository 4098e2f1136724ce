"""Peak memory of one training step: raggedfsdp.fully_shard vs torch's fully_shard, in the same run.

Both backends train the same model (``tests/_memory.py``: ``--blocks`` blocks of two
``Linear(dim, dim)``, one FSDP unit each, plus a root ``Linear(dim, dim)``; AdamW; same init, same
data) and are measured with the project's one peak-memory method,
``raggedfsdp.app.bench.memory.measure_train_step`` (docs/memory.md): live bytes relative to just before
the model is built, at the start of the measured step (``state``), and the peak during forward +
backward and during ``optimizer.step()``; ratios are ragged / torch (< 1: raggedfsdp uses less).

Backends:
    python benchmarks/memory_vs_torch.py --nproc 2                 # CPU, fake process group (exact, default; worst case)
    python benchmarks/memory_vs_torch.py --nproc 3 --rank 2        # another simulated rank
    python benchmarks/memory_vs_torch.py --nproc 2 --comm done     # fake PG, communication that keeps up
    python benchmarks/memory_vs_torch.py --nproc 2 --backend gloo  # CPU, real gloo ranks (adds gloo scratch)
    python benchmarks/memory_vs_torch.py --device cuda             # NCCL, one process per GPU, CUDA allocator
Add ``--breakdown 8`` to list what each forward + backward peak is made of (CPU). Add ``--rss`` (with
``MALLOC_MMAP_THRESHOLD_=65536`` in the environment) to print, as a
cross-check of the CPU method, the resident-set high-water growth over one step after warm-up
(a separate pass) next to the measured step's transient (peak - state). The last
line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

MiB = 2**20


def _rss_hwm() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024


def _rss_step(build, loss, warmup: int) -> int:
    """RSS high-water growth over one step after warm-up (VmHWM reset via /proc/self/clear_refs)."""
    import gc

    model, opt = build()
    for _ in range(warmup):
        loss(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0, _ = _rss_hwm()
    loss(model).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    growth = _rss_hwm()[1] - rss0
    del model, opt
    gc.collect()
    return growth


def measure(rank: int, ws: int, args) -> dict:
    """Every (dtype, backend) measurement on this rank (a process group must be initialised)."""
    import contextlib

    from _memory import MemNet, builder, comm_completion, loss_fn
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.app.bench.memory import measure_train_step

    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (ws,))
    torch.manual_seed(0)
    init = {k: v.to(dev) for k, v in MemNet(args.dim, args.blocks).state_dict().items()}
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank)).to(dev)
    out = {}
    for dt in args.param_dtype:
        pdt = {"fp32": None, "bf16": torch.bfloat16}[dt]
        row = {}
        for b in ("ragged", "torch"):
            build = builder(b, init, mesh, pdt, d=args.dim, n=args.blocks)
            with comm_completion(args.comm) if args.comm != "backend" else contextlib.nullcontext():
                r = measure_train_step(
                    build, loss_fn(x), dev, warmup_steps=args.warmup, breakdown=args.breakdown
                )._asdict()
            owners = r.pop("fwd_bwd_peak_owners")
            if args.breakdown:
                r["fwd_bwd_peak_owners"] = [[n, op] for n, op in owners]
            if args.rss:
                r["rss_step_growth_bytes"] = _rss_step(build, loss_fn(x), args.warmup)
            row[b] = r
        for k in ("fwd_bwd_peak_bytes", "optim_peak_bytes", "state_bytes"):
            row[f"ratio_{k.removesuffix('_bytes')}"] = row["ragged"][k] / max(row["torch"][k], 1)
        row["ratio_fwd_bwd_transient"] = (
            row["ragged"]["fwd_bwd_peak_bytes"] - row["ragged"]["state_bytes"]
        ) / max(row["torch"]["fwd_bwd_peak_bytes"] - row["torch"]["state_bytes"], 1)
        out[dt] = row
    return out


def _print(res: dict, args, ws: int, rank: int) -> None:
    unit = 2 * (args.dim**2 + args.dim) * 4
    print(
        f"# model: {args.blocks} blocks x 2 Linear({args.dim},{args.dim}) + root Linear; unit "
        f"{unit / MiB:.2f} MiB fp32; batch/rank {args.batch}; AdamW; backend {args.backend} (comm: "
        f"{args.comm}); device {args.device}; ws {ws}; rank {rank}"
    )
    print(
        f"{'dtype':5s} {'backend':7s} {'state MiB':>10s} {'fwd+bwd peak':>13s} {'optim peak':>11s}"
        + (f" {'step transient':>15s} {'RSS step growth':>15s}" if args.rss else "")
    )
    for dt, row in res.items():
        for b in ("ragged", "torch"):
            r = row[b]
            line = (
                f"{dt:5s} {b:7s} {r['state_bytes'] / MiB:10.2f} {r['fwd_bwd_peak_bytes'] / MiB:13.2f} "
                f"{r['optim_peak_bytes'] / MiB:11.2f}"
            )
            if args.rss:
                transient = max(r["fwd_bwd_peak_bytes"], r["optim_peak_bytes"]) - r["state_bytes"]
                line += f" {transient / MiB:15.2f} {r['rss_step_growth_bytes'] / MiB:15.2f}"
            print(line)
        for b in ("ragged", "torch") if args.breakdown else ():
            print(f"{dt:5s} {b}: blocks allocated in the step and live at its fwd+bwd peak:")
            for n, op in row[b]["fwd_bwd_peak_owners"]:
                print(f"        {n / MiB:8.3f} MiB  {op}")
        print(
            f"{dt:5s} ratio ragged/torch: fwd+bwd peak {row['ratio_fwd_bwd_peak']:.3f}, optimizer-step peak "
            f"{row['ratio_optim_peak']:.3f}, fwd+bwd transient (peak - state) "
            f"{row['ratio_fwd_bwd_transient']:.3f}"
        )


def _fake_main(args) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.nproc)
    try:
        return {args.rank: measure(args.rank, args.nproc, args)}
    finally:
        dist.destroy_process_group()


def _spawn_worker(rank, ws, store_path, args, q):
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    try:
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo",
            store=dist.FileStore(store_path, ws),
            rank=rank,
            world_size=ws,
            timeout=timedelta(seconds=300),
        )
        q.put((rank, measure(rank, ws, args), None))
        from raggedfsdp.teardown import shutdown_process_group

        shutdown_process_group()  # barrier + store check-in, then destroy (no SIGABRT in a peer)
    except BaseException:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


def _spawn_main(args) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_spawn_worker, args=(r, args.nproc, os.path.join(tmp, "store"), args, q))
            for r in range(args.nproc)
        ]
        for p in procs:
            p.start()
        res = {}
        try:
            for _ in procs:
                rank, out, tb = q.get(timeout=900)
                if tb:
                    raise RuntimeError(f"rank {rank} failed:\n{tb}")
                res[rank] = out
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.terminate()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--nproc",
        "--world-size",
        type=int,
        default=None,
        help="world size (default 2 on CPU, the number of GPUs with --device cuda)",
    )
    ap.add_argument("--rank", type=int, default=0, help="fake backend: the simulated rank")
    ap.add_argument(
        "--backend",
        default=None,
        choices=["fake", "gloo", "nccl"],
        help="default: fake on CPU, nccl with --device cuda",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--comm",
        default=None,
        choices=["never", "done", "backend"],
        help="what raggedfsdp's collectives report to its early-free poll (Note [early free]): 'never' "
        "(the worst case: a network slower than the backward; default with the fake backend), "
        "'done' (communication that keeps up), 'backend' (what the backend reports; default on "
        "gloo / nccl). torch's FSDP2 does not poll, so it is unaffected",
    )
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="rows per rank")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--param-dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument(
        "--breakdown",
        type=int,
        default=0,
        metavar="N",
        help="CPU: print the N largest blocks live at each fwd+bwd peak and the ops that allocated them",
    )
    ap.add_argument("--rss", action="store_true", help="also print the RSS high-water growth (CPU, Linux)")
    args = ap.parse_args(argv)
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "fake"
    if args.comm is None:
        args.comm = "never" if args.backend == "fake" else "backend"
    if (args.backend == "nccl") != (args.device == "cuda"):
        ap.error(
            f"--backend {args.backend} does not fit --device {args.device} (nccl <-> cuda, fake/gloo <-> cpu)"
        )
    if not 0 <= args.rank < args.nproc:
        ap.error(f"--rank {args.rank} is not in [0, {args.nproc})")
    if args.backend == "fake":
        torch.set_num_threads(1)
        res = _fake_main(args)
    else:
        res = _spawn_main(args)
    rank = min(res)
    _print(res[rank], args, args.nproc, rank)
    summary = {
        "config": {k: v for k, v in vars(args).items()},
        "rank": rank,
        "results": res[rank],
        "max_over_ranks": {
            dt: {
                k: max(res[r][dt]["ragged"][k] for r in res)
                for k in res[rank][dt]["ragged"]
                if k.endswith("_bytes")
            }
            for dt in res[rank]
        },
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
