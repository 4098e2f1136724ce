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
* **AdamW8bit step time** against torch AdamW (foreach) on the same sharded params;
* **cost table** (``--tokens``): at each tokens-per-step setting (per rank), forward+backward time
  and the step time of Muon (``muon_param_groups``: Muon + AdamW for the rest) and of torch AdamW,
  with the step's share of the whole iteration;
* **overlap**: Muon step with ``pipeline_chunks=1`` (gather, NS, scatter in sequence) against the
  default 4 chunks (chunk ``c + 1`` gathered and ``c - 1`` scattered while ``c`` is orthogonalised):
  step time, time blocked in ``wait()`` and time in Newton-Schulz (max over ranks).

``--replicate R`` runs on an HSDP mesh ``(R, W / R)``: Muon's owners then span all ``W`` ranks.
``--sections`` picks any of ``muon,state,cost,overlap`` (default: all).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _model(args, device, backend="ragged", shard_placement_fn=None, mesh=None, batch=2):
    """The LLaMA ``args.flavor``, sharded on ``mesh`` (if given), with gradients from one forward/backward.

    Returns ``(model, fwd_bwd)``: ``fwd_bwd()`` runs one more forward/backward on the same batch.
    """
    from raggedfsdp.app.models.llama import Llama, LlamaConfig
    from raggedfsdp.app.models.parallelize import apply_fsdp

    torch.manual_seed(0)
    model = Llama(LlamaConfig.flavor(args.flavor)).to(device)
    model.init_weights(0)
    if mesh is not None:
        apply_fsdp(model, mesh, backend=backend, shard_placement_fn=shard_placement_fn)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(
        0, model.cfg.vocab_size if hasattr(model, "cfg") else 256, (batch, args.seq + 1), generator=g
    )
    tok = tok.to(device)

    def fwd_bwd():
        logits = model(tok[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten()).backward()

    fwd_bwd()
    return model, fwd_bwd


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


def _muon_section(args, device, mesh, out) -> None:
    """Ours (sharded) vs torch.optim.Muon on full tensors and on FSDP2 DTensors."""
    from torch.distributed.tensor.debug import CommDebugMode

    from raggedfsdp.optim import Muon, muon_param_groups

    ws = dist.get_world_size()
    model, _ = _model(args, device, mesh=mesh)
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

    full, _ = _model(args, device)  # plain tensors: what a replicated (DDP) or gather-then-NS rank does
    fmats = [p for p, q in zip(full.parameters(), model.parameters()) if any(q is m for m in mats)]
    tmuon = torch.optim.Muon(fmats, lr=1e-3)
    tmuon.step()
    t_full = _time(tmuon.step, args.repeats, device)
    out.append(
        f"Muon step, {args.flavor} ({len(mats)} matrices, {numel / 1e6:.2f} M params), world size {ws}:"
    )
    out.append(
        f"  raggedfsdp.optim.Muon   {t_ours:9.1f} ms | NS calls/rank (max) {calls_max:.0f} | "
        f"NS GFLOP/rank (max) {flops_max / 1e9:.2f} of {flops_total / 1e9:.2f} | "
        f"collectives/step {comm.get_total_counts()} | elements sent/step {sent:.0f}"
    )
    out.append(
        f"  torch Muon, full tensors {t_full:8.1f} ms | NS calls/rank {len(fmats)} | "
        f"NS GFLOP/rank {flops_total / 1e9:.2f} | collectives/step 0 (after a full gather)"
    )
    out.append(
        f"  step-time ratio torch-full / ours = {t_full / t_ours:.2f}x; NS FLOPs per rank ratio = "
        f"{flops_total / max(flops_max, 1):.2f}x"
    )
    del full, tmuon
    if not args.skip_fsdp2_muon:
        try:
            m2, _ = _model(args, device, backend="torch", mesh=mesh)
            m2mats = [p for p in m2.parameters() if p.ndim == 2][1:-1]  # not embedding / output
            t2 = torch.optim.Muon(m2mats, lr=1e-3)
            t2.step()
            t_fsdp2 = _time(t2.step, args.repeats, device)
            with CommDebugMode() as c2:
                t2.step()
            out.append(
                f"  torch Muon on FSDP2      {t_fsdp2:8.1f} ms | collectives/step {c2.get_total_counts()} "
                f"({ {str(k).split('.')[-1]: v for k, v in c2.get_comm_counts().items()} })"
            )
            del m2, t2
        except Exception as e:  # noqa: BLE001 - a baseline that does not run is reported, not fatal
            out.append(f"  torch Muon on FSDP2: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")

    del model, ours


def _state_section(args, device, mesh, out) -> None:
    """Optimizer-state bytes per parameter and the AdamW8bit step."""
    from raggedfsdp.optim import AdamW8bit, Muon, muon_param_groups

    model, _ = _model(args, device, mesh=mesh)
    numel = sum(p.numel() for p in model.parameters())
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    adamw.step()
    t_adamw = _time(adamw.step, args.repeats, device)
    b_adamw = _sum(_state_bytes(adamw))
    muon_all = Muon(muon_param_groups(model))
    b_muon = _sum(_state_bytes(muon_all))
    del adamw, muon_all, model
    m8, _ = _model(args, device, mesh=mesh, shard_placement_fn=AdamW8bit.shard_placement_fn)
    o8 = AdamW8bit(m8.parameters(), lr=1e-3)
    o8.step()
    t_8 = _time(o8.step, args.repeats, device)
    b_8 = _sum(_state_bytes(o8))
    out.append("Optimizer state, bytes per parameter (all ranks / numel):")
    out.append(
        f"  torch AdamW {b_adamw / numel:.3f} | AdamW8bit {b_8 / numel:.3f} "
        f"(ratio {b_8 / b_adamw:.3f}) | Muon+AdamW {b_muon / numel:.3f}"
    )
    out.append(
        f"AdamW8bit step {t_8:.1f} ms vs torch AdamW (foreach) {t_adamw:.1f} ms "
        f"(ratio {t_8 / t_adamw:.2f}x), 0 collectives"
    )


def _cost_section(args, device, mesh, out) -> None:
    """Muon vs AdamW: forward+backward and step time at each tokens-per-step setting (per rank)."""
    from raggedfsdp.optim import Muon, muon_param_groups

    out.append(
        f"Muon vs AdamW cost, {args.flavor}, world size {dist.get_world_size()} (mesh {tuple(mesh.shape)}), "
        f"seq {args.seq}, NS in {args.ns_dtype}, median of {args.repeats}:"
    )
    out.append(
        "  tokens/step/rank | fwd+bwd ms | AdamW step ms (share) | Muon step ms (share) | Muon/AdamW step "
        "| NS GFLOP/rank max (mean)"
    )
    for tokens in args.tokens:
        batch = max(1, tokens // args.seq)
        model, fwd_bwd = _model(args, device, mesh=mesh, batch=batch)
        t_fb = _time(fwd_bwd, args.repeats, device)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        muon = Muon(muon_param_groups(model), lr=1e-3, ns_dtype=getattr(torch, args.ns_dtype))
        adamw.step(), muon.step()  # warm-up (state, plans)
        t_a, t_m = _time(adamw.step, args.repeats, device), _time(muon.step, args.repeats, device)
        st = muon.last_step_stats
        fmax, fmean = _max(st["ns_flops"]), _sum(st["ns_flops"]) / dist.get_world_size()
        t_fb, t_a, t_m = _max(t_fb), _max(t_a), _max(t_m)
        out.append(
            f"  {batch * args.seq:16d} | {t_fb:10.1f} | {t_a:9.1f} ({t_a / (t_fb + t_a):5.1%}) | {t_m:9.1f} "
            f"({t_m / (t_fb + t_m):5.1%}) | {t_m / t_a:6.1f}x | {fmax / 1e9:.3f} ({fmean / 1e9:.3f})"
        )
        del model, adamw, muon


def _overlap_section(args, device, mesh, out) -> None:
    """Muon step unpipelined (1 chunk) vs pipelined (4 chunks): time, blocked-in-wait, NS time."""
    from raggedfsdp.optim import Muon, muon_param_groups

    model, _ = _model(args, device, mesh=mesh)
    mats = muon_param_groups(model)[0]["params"]
    out.append(
        f"Muon exchange overlap, {args.flavor}, world size {dist.get_world_size()} (mesh "
        f"{tuple(mesh.shape)}):"
    )
    res = {}
    for chunks in (1, 4):
        opt = Muon(mats, lr=1e-3, pipeline_chunks=chunks, ns_dtype=getattr(torch, args.ns_dtype))
        opt.step()
        ts, waits, nss = [], [], []
        for _ in range(args.repeats):
            ts.append(_time(opt.step, 1, device))
            waits.append(opt.last_step_stats["wait_s"] * 1e3)
            nss.append(opt.last_step_stats["ns_s"] * 1e3)
        st = opt.last_step_stats
        res[chunks] = (
            _max(statistics.median(ts)),
            _max(statistics.median(waits)),
            _max(statistics.median(nss)),
        )
        out.append(
            f"  pipeline_chunks={chunks}: step {res[chunks][0]:8.1f} ms | blocked in wait "
            f"{res[chunks][1]:7.1f} ms | Newton-Schulz {res[chunks][2]:7.1f} ms (max over ranks) | chunks "
            f"used {st['chunks']} | collectives {st['collectives']}"
        )
    out.append(
        f"  pipelined / unpipelined step = {res[4][0] / res[1][0]:.2f}; wait hidden = "
        f"{1 - res[4][1] / max(res[1][1], 1e-9):.0%}"
    )


SECTIONS = {
    "muon": _muon_section,
    "state": _state_section,
    "cost": _cost_section,
    "overlap": _overlap_section,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--skip-fsdp2-muon", action="store_true", help="skip torch.optim.Muon on FSDP2 DTensors")
    ap.add_argument(
        "--tokens", default="64,512,4096", help="tokens per step per rank of the cost table (comma list)"
    )
    ap.add_argument("--replicate", type=int, default=1, help="HSDP mesh (R, W/R); 1: plain FSDP")
    ap.add_argument(
        "--ns-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="Muon's Newton-Schulz dtype in the cost and overlap sections (torch's default: bfloat16)",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {','.join(SECTIONS)}")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    sections = args.sections.split(",")
    bad = [x for x in sections if x not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; choose from {sorted(SECTIONS)}")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, ws = dist.get_rank(), dist.get_world_size()
    if ws % args.replicate:
        raise ValueError(f"--replicate {args.replicate} must divide the world size {ws}")
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = (
        torch.device(args.device, torch.cuda.current_device())
        if args.device == "cuda"
        else torch.device("cpu")
    )
    torch.set_num_threads(1) if args.device == "cpu" else None
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp  # noqa: F401

    shape = (ws,) if args.replicate == 1 else (args.replicate, ws // args.replicate)
    mesh = init_device_mesh(
        args.device, shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None
    )
    out: list[str] = []
    for name in sections:
        SECTIONS[name](args, device, mesh, out)
    if rank == 0:
        print("\n".join(out), flush=True)
    from raggedfsdp.teardown import shutdown_process_group

    shutdown_process_group()  # barrier + store check-in, then destroy (no SIGABRT in a peer)


if __name__ == "__main__":
    main()
