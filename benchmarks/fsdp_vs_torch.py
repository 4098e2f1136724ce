"""raggedfsdp.fully_shard vs torch's fully_shard, measured in the same run.

Run (CPU, gloo):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp_vs_torch.py \
        --flavor small --steps 12 --batch 4 --seq 256
On a GPU machine add ``--device cuda`` (NCCL).

Both backends train the same model (same init, same data) with AdamW; steps are *interleaved*
(ragged step, torch step, ragged step, ...) so both see the same machine noise. Reported on rank 0:

* median step time of each backend and the ratio torch / ragged (> 1 means raggedfsdp is faster);
* bytes moved by copy kernels around the collectives per step (dispatch-mode count, see
  tests/dist/test_copy_accounting.py) and the ratio;
* padding of the collective buffers (elements) from both layouts;
* on CUDA: peak allocated / reserved memory of each backend (separate passes) and ratios.
* loss agreement of the two runs (they must match: same math).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
import torch.distributed as dist

from raggedfsdp.app.bench.copy_accounting import CopyCounter


def _build(args, backend, mesh, device):
    from raggedfsdp.app.models.llama import Llama, LlamaConfig
    from raggedfsdp.app.models.parallelize import apply_fsdp, make_mp_policy

    torch.manual_seed(0)
    model = Llama(LlamaConfig.flavor(args.flavor)).to(device)
    model.init_weights(0)
    mp = make_mp_policy(backend, param_dtype=args.param_dtype, reduce_dtype="fp32")
    apply_fsdp(model, mesh, backend=backend, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _step(model, opt, tok):
    logits = model(tok[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _padding(model, backend, ws):
    if backend == "ragged":
        from raggedfsdp.fsdp import fsdp_units

        return sum(int(u.layout.padding) for u in fsdp_units(model))
    pad = 0
    for p in model.parameters():  # FSDP2: each param padded on dim 0 to ceil(d0/ws)*ws rows
        d0 = p.shape[0]
        rows = -(-d0 // ws) * ws
        pad += (rows - d0) * (p.numel() // max(d0, 1))
    return pad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="per-rank batch")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()

    backend_name = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend_name)
    rank, ws = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
        device = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp  # noqa: F401  (installs the RaggedShard patches)

    mesh = init_device_mesh(args.device, (ws,))
    models = {b: _build(args, b, mesh, device) for b in ("ragged", "torch")}
    g = torch.Generator().manual_seed(1 + rank)
    times = collections.defaultdict(list)
    losses = collections.defaultdict(list)
    for step in range(args.warmup + args.steps):
        tok = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
        for b, (model, opt) in models.items():
            if args.device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            loss = _step(model, opt, tok)
            if args.device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[b].append(dt)
            losses[b].append(loss.item())
    copies = {}
    tok = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
    for b, (model, opt) in models.items():
        with CopyCounter() as c:
            _step(model, opt, tok)
        copies[b] = c.total_bytes
    mem = {}
    if args.device == "cuda":
        for b, (model, opt) in models.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                _step(model, opt, tok)
            torch.cuda.synchronize()
            mem[b] = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    if rank == 0:
        med = {b: statistics.median(t) for b, t in times.items()}
        print(
            f"model={args.flavor} ws={ws} batch/rank={args.batch} seq={args.seq} "
            f"param_dtype={args.param_dtype} device={args.device} steps={args.steps}"
        )
        print(
            f"step time median  ragged {med['ragged'] * 1e3:8.1f} ms   torch {med['torch'] * 1e3:8.1f} ms   "
            f"ratio torch/ragged {med['torch'] / med['ragged']:.3f}"
        )
        ratio = copies["torch"] / copies["ragged"] if copies["ragged"] else float("inf")
        print(
            f"copy bytes/step   ragged {copies['ragged']:>10d}      torch {copies['torch']:>10d}      "
            f"ratio torch/ragged {ratio if ratio != float('inf') else 'inf (ragged: 0)'}"
        )
        print(
            f"buffer padding    ragged {_padding(models['ragged'][0], 'ragged', ws):>10d} el   "
            f"torch {_padding(models['torch'][0], 'torch', ws):>10d} el"
        )
        for b in mem:
            print(
                f"peak memory {b:6s} allocated {mem[b][0] / 2**20:8.1f} MiB reserved "
                f"{mem[b][1] / 2**20:8.1f} MiB"
            )
        if mem:
            print(f"peak reserved ratio ragged/torch {mem['ragged'][1] / mem['torch'][1]:.3f}")
        print("losses ragged", [round(x, 4) for x in losses["ragged"]])
        print("losses torch ", [round(x, 4) for x in losses["torch"]])
        dl = max(abs(a - b) for a, b in zip(losses["ragged"], losses["torch"]))
        print(f"max |loss ragged - loss torch| over {len(losses['ragged'])} steps: {dl:.2e}")
    from raggedfsdp.teardown import shutdown_process_group

    shutdown_process_group()  # barrier + store check-in, then destroy (no SIGABRT in a peer)


if __name__ == "__main__":
    main()
