"""Optimizer benchmark: distributed Muon and AdamW8bit vs torch.optim.Muon / AdamW, same run.

Run (CPU, gloo; one intra-op thread per rank):
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node W \
        benchmarks/optim_bench.py --flavor tiny --repeats 5
On a GPU machine add ``--device cuda`` (NCCL, one GPU per rank).

Every rank builds the same LLaMA model, shards it with raggedfsdp.fully_shard (default layout) and
gets real sharded gradients from one forward/backward. Reported on rank 0:

* **Muon step**: median optimizer-step time of ``raggedfsdp.optim.Muon`` (hidden matrices; the
  AdamW part of its param groups excluded for a like-for-like comparison) and Newton-Schulz FLOPs
  and calls per rank (max over ranks), collectives per step and elements sent, against
  ``torch.optim.Muon`` stepping full tensors (every rank orthogonalises every matrix: the
  replicated/DDP and "gather then redundant NS" baselines) and, when it runs, ``torch.optim.Muon``
  on torch's ``fully_shard`` (FSDP2) DTensors (implicit redistribution, its collectives counted);
* **optimizer-state bytes per parameter** (summed over ranks / numel): torch AdamW, AdamW8bit
  (tile layout ``AdamW8bit.shard_placement_fn``), Muon (+ AdamW for the rest);
* **AdamW8bit step time** against torch AdamW (foreach) on the same sharded params.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _model(args, device, backend="ragged", shard_placement_fn=None, mesh=None):
    from raggedfsdp.models.llama import Llama, LlamaConfig
    from raggedfsdp.models.parallelize import apply_fsdp

    torch.manual_seed(0)
    model = Llama(LlamaConfig.flavor(args.flavor)).to(device)
    model.init_weights(0)
    if mesh is not None:
        apply_fsdp(model, mesh, backend=backend, shard_placement_fn=shard_placement_fn)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, model.cfg.vocab_size if hasattr(model, "cfg") else 256, (2, args.seq + 1), generator=g)
    tok = tok.to(device)
    logits = model(tok[:, :-1])
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten()).backward()
    return model


def _time(fn, repeats, device):
    ts = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sum(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _state_bytes(opt) -> int:
    from raggedfsdp.optim._shards import local_flat

    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor):
                loc = local_flat(v)
                total += loc.numel() * loc.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--skip-fsdp2-muon", action="store_true", help="skip torch.optim.Muon on FSDP2 DTensors")
    args = ap.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, ws = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(1) if args.device == "cpu" else None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    import raggedfsdp  # noqa: F401
    from raggedfsdp.optim import AdamW8bit, Muon, muon_param_groups

    mesh = init_device_mesh(args.device, (ws,))
    out: list[str] = []

    # ---- Muon: ours (sharded) vs torch.optim.Muon on full tensors -------------------------
    model = _model(args, device, mesh=mesh)
    groups = muon_param_groups(model)
    mats = groups[0]["params"]
    numel = sum(p.numel() for p in model.parameters())
    ours = Muon(mats, lr=1e-3)
    ours.step()  # warm-up; caches the plan
    t_ours = _time(ours.step, args.repeats, device)
    st = ours.last_step_stats
    with CommDebugMode() as comm:
        ours.step()
    flops_max, calls_max = _max(st["ns_flops"]), _max(st["ns_calls"])
    flops_total = _sum(st["ns_flops"])
    sent = _sum(st["sent_elements"])

    full = _model(args, device)  # plain tensors: what a replicated (DDP) or gather-then-NS rank does
    fmats = [p for p, q in zip(full.parameters(), model.parameters()) if any(q is m for m in mats)]
    tmuon = torch.optim.Muon(fmats, lr=1e-3)
    tmuon.step()
    t_full = _time(tmuon.step, args.repeats, device)
    out.append(f"Muon step, {args.flavor} ({len(mats)} matrices, {numel / 1e6:.2f} M params), world size {ws}:")
    out.append(f"  raggedfsdp.optim.Muon   {t_ours:9.1f} ms | NS calls/rank (max) {calls_max:.0f} | "
               f"NS GFLOP/rank (max) {flops_max / 1e9:.2f} of {flops_total / 1e9:.2f} | "
               f"collectives/step {comm.get_total_counts()} | elements sent/step {sent:.0f}")
    out.append(f"  torch Muon, full tensors {t_full:8.1f} ms | NS calls/rank {len(fmats)} | "
               f"NS GFLOP/rank {flops_total / 1e9:.2f} | collectives/step 0 (after a full gather)")
    out.append(f"  step-time ratio torch-full / ours = {t_full / t_ours:.2f}x; NS FLOPs per rank ratio = "
               f"{flops_total / max(flops_max, 1):.2f}x")
    del full, tmuon
    if not args.skip_fsdp2_muon:
        try:
            m2 = _model(args, device, backend="torch", mesh=mesh)
            m2mats = [p for p in m2.parameters() if p.ndim == 2][1:-1]  # not embedding / output
            t2 = torch.optim.Muon(m2mats, lr=1e-3)
            t2.step()
            t_fsdp2 = _time(t2.step, args.repeats, device)
            with CommDebugMode() as c2:
                t2.step()
            out.append(f"  torch Muon on FSDP2      {t_fsdp2:8.1f} ms | collectives/step {c2.get_total_counts()} "
                       f"({ {str(k).split('.')[-1]: v for k, v in c2.get_comm_counts().items()} })")
            del m2, t2
        except Exception as e:  # noqa: BLE001 - a baseline that does not run is reported, not fatal
            out.append(f"  torch Muon on FSDP2: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")

    # ---- optimizer-state bytes and AdamW8bit step ----------------------------------------
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    adamw.step()
    t_adamw = _time(adamw.step, args.repeats, device)
    b_adamw = _sum(_state_bytes(adamw))
    muon_all = Muon(muon_param_groups(model))
    b_muon = _sum(_state_bytes(muon_all))
    del adamw, muon_all, model, ours
    m8 = _model(args, device, mesh=mesh, shard_placement_fn=AdamW8bit.shard_placement_fn)
    o8 = AdamW8bit(m8.parameters(), lr=1e-3)
    o8.step()
    t_8 = _time(o8.step, args.repeats, device)
    b_8 = _sum(_state_bytes(o8))
    out.append("Optimizer state, bytes per parameter (all ranks / numel):")
    out.append(f"  torch AdamW {b_adamw / numel:.3f} | AdamW8bit {b_8 / numel:.3f} "
               f"(ratio {b_8 / b_adamw:.3f}) | Muon+AdamW {b_muon / numel:.3f}")
    out.append(f"AdamW8bit step {t_8:.1f} ms vs torch AdamW (foreach) {t_adamw:.1f} ms "
               f"(ratio {t_8 / t_adamw:.2f}x), 0 collectives")
    if rank == 0:
        print("\n".join(out), flush=True)
    from raggedfsdp.launch.teardown import shutdown_process_group

    shutdown_process_group()  # barrier + store check-in, then destroy (no SIGABRT in a peer)


if __name__ == "__main__":
    main()
