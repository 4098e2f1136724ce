"""What is live at the forward + backward peak of one training step: raggedfsdp vs torch's fully_shard.

Runs a ``raggedfsdp bench`` model family (``--model moe|dense``, the bench's registry, one FSDP unit
per block + root, AdamW ``foreach``, batch 2 x 128 tokens per rank, same init and data for both) for
two warm-up steps, then measures one step with the shared method
(``raggedfsdp.app.bench.memory.PeakMemory(breakdown=N)``, docs/memory.md) and prints, per system, the
peak (relative to just before the model was built) and the blocks allocated during the step that
are live at the peak, grouped by the op chain that allocated them and by category:

* ``params``: unsharded parameters (ours: ``raggedfsdp::unshard``; FSDP2: all-gather output and
  the per-parameter copy-out);
* ``grads``: unsharded gradients (ours: ``raggedfsdp::begin_grads``, the flat buffer, and its
  ``reduce_dtype`` copy; FSDP2:
  autograd's weight gradients, kept as ``.grad``) and reduce-scatter inputs;
* ``sharded grads``: reduce-scatter outputs / sharded gradient buffers;
* ``backend``: scratch of the process group (gloo's all-gather / reduce-scatter buffers);
* ``activations``: everything else (saved activations, autograd temporaries).

Backends: ``--backend fake`` (default; torch's single-threaded fake process group, one simulated rank,
exact and deterministic: every FSDP buffer as on NCCL, no backend scratch) or ``--backend gloo`` (run it
under torchrun: ``python -m torch.distributed.run --nproc-per-node 4 benchmarks/memory_breakdown.py
--backend gloo``; rank 0 prints).

    python benchmarks/memory_breakdown.py --model moe --nproc 4
    python benchmarks/memory_breakdown.py --model dense --nproc 4 --param-dtype bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

MiB = 2**20


def category(op: str, nbytes: int, unit_bytes: int) -> str:
    if "gloo" in op or "c10d::" in op:
        return "backend"
    if "raggedfsdp::unshard" in op or "FSDP::all_gather" in op:
        return "params"
    if "raggedfsdp::begin_grads" in op or "AccumulateGrad" in op:
        return "grads"
    if "raggedfsdp::install_grads" in op:
        return "sharded grads"
    if "raggedfsdp::reduce_scatter" in op or "FSDP::post_backward_reduce" in op:
        # the reduce-scatter's unsharded input (ours: the reduce_dtype copy; FSDP2: chunk_cat) or its output
        return "grads" if nbytes > unit_bytes // 3 else "sharded grads"
    if "Backward" in op and op.startswith("aten::mm"):
        return "grads (weight grads / temporaries)"
    return "activations"


def forward_backward(model, tok) -> None:
    logits = model(tok[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
    aux = getattr(model, "aux_loss", None)
    (loss + aux if aux is not None else loss).backward()


def measure(args, backend: str, mesh, rank: int) -> dict:
    from raggedfsdp.app.bench.registry import get_bench_model
    from raggedfsdp.app.bench.memory import PeakMemory, enable_cpu_allocator_accounting

    enable_cpu_allocator_accounting()  # before the models are built (docs/memory.md)
    from raggedfsdp.app.models import make_mp_policy

    ns = argparse.Namespace(
        flavor=None, n_layers=None, n_experts=None, top_k=None, experts=args.experts, seed=0
    )
    spec = get_bench_model(args.model)
    gen = torch.Generator().manual_seed(1 + rank)
    toks = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen) for _ in range(3)]
    gc.collect()
    with PeakMemory(breakdown=100_000) as m:
        model = spec.build(ns)
        mp = make_mp_policy(backend, param_dtype=args.param_dtype, reduce_dtype="fp32")
        spec.wraps["layer"](model, mesh, backend, mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        for t in toks[:2]:
            forward_backward(model, t)
            opt.step()
            opt.zero_grad(set_to_none=True)
        gc.collect()
        m.reset()
        forward_backward(model, toks[2])
        m.reset()
        opt.step()
        opt.zero_grad(set_to_none=True)
        m.reset()
        unit_bytes = max(sum(p.numel() for p in blk.parameters()) for blk in model.layers) * 4
        del model, opt
    build, fb, _, _ = m.windows
    origin = build.baseline_bytes
    by_op: dict[str, list[int]] = {}
    by_cat: dict[str, int] = {}
    for n, op in m.window_owners[1]:
        e = by_op.setdefault(op, [0, 0])
        e[0] += n
        e[1] += 1
        c = category(op, n, unit_bytes)
        by_cat[c] = by_cat.get(c, 0) + n
    return dict(
        state_bytes=fb.baseline_bytes - origin,
        fwd_bwd_peak_bytes=fb.baseline_bytes + fb.peak_bytes - origin,
        unit_bytes=unit_bytes,
        by_category=by_cat,
        by_op=sorted(([n, c, op] for op, (n, c) in by_op.items()), reverse=True),
    )


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="moe", choices=["moe", "dense"])
    ap.add_argument("--experts", default=None, choices=[None, "separate", "fused"])
    ap.add_argument("--nproc", type=int, default=4, help="fake backend: world size")
    ap.add_argument("--rank", type=int, default=0, help="fake backend: the simulated rank")
    ap.add_argument("--backend", default="fake", choices=["fake", "gloo"])
    ap.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--top", type=int, default=12, help="op chains to print per system")
    ap.add_argument(
        "--comm",
        default=None,
        choices=["never", "done", "backend"],
        help="what raggedfsdp's collectives report to its early-free poll (Note [early free]): 'never' "
        "(the worst case; default with the fake backend), 'done' (communication that keeps up), "
        "'backend' (what the backend reports; default on gloo)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.backend == "gloo":
        dist.init_process_group("gloo")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.nproc)
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp  # noqa: F401

    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    if args.comm is None:
        args.comm = "never" if args.backend == "fake" else "backend"
    if args.comm != "backend":  # fix what our collectives report to the early-free poll (Note [early free])
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from _memory import comm_completion

        with comm_completion(args.comm):
            res = {"ragged": measure(args, "ragged", mesh, rank)}
    else:
        res = {"ragged": measure(args, "ragged", mesh, rank)}
    res["torch"] = measure(args, "torch", mesh, rank)
    dist.destroy_process_group()
    if rank != 0:
        return None
    res["ratio_fwd_bwd_peak"] = res["ragged"]["fwd_bwd_peak_bytes"] / res["torch"]["fwd_bwd_peak_bytes"]
    if args.json:
        print(json.dumps(res))
        return res
    print(
        f"# {args.model} ({args.param_dtype}), {args.backend} backend (comm: {args.comm}), ws {ws}, rank "
        f"{rank}; largest unit {res['ragged']['unit_bytes'] / MiB:.2f} MiB fp32"
    )
    for b in ("ragged", "torch"):
        r = res[b]
        cats = ", ".join(
            f"{c} {n / MiB:.2f}" for c, n in sorted(r["by_category"].items(), key=lambda kv: -kv[1])
        )
        print(
            f"{b:6s}: fwd+bwd peak {r['fwd_bwd_peak_bytes'] / MiB:.2f} MiB (state at step start "
            f"{r['state_bytes'] / MiB:.2f}); allocated in the step and live at the peak (MiB): {cats}"
        )
        for n, c, op in r["by_op"][: args.top]:
            print(f"    {n / MiB:8.3f} MiB x{c:4d}  {op[:150]}")
    print(f"ratio ragged/torch fwd+bwd peak: {res['ratio_fwd_bwd_peak']:.3f}")
    return res


if __name__ == "__main__":
    main()
