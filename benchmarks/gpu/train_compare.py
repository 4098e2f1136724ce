"""Stages C1 / C2 of benchmarks/gpu/run.sh: a ~1B model, raggedfsdp vs torch's fully_shard vs no FSDP.

One GPU, NCCL world size 1, bf16 params / fp32 reduce (the no-FSDP floor: fp32 params under
``torch.autocast(bf16)``), AdamW, same init (one state dict loaded into every model) and same data.

* ``memory``: each system measured on its own with ``raggedfsdp.app.bench.memory.measure_train_step``
  (after one discarded "settle" measurement that takes the CUDA libraries' one-time allocations)
  (build inside the measured region, one warm-up step, then one step; the other systems do not
  exist at that time, and ``torch.cuda.empty_cache()`` runs between them): ``state_bytes`` (params,
  grads kept between steps, optimizer state), ``fwd_bwd_peak_bytes`` and ``optim_peak_bytes``, all
  relative to just before the build (CUDA allocator counters).
* ``speed``: the three systems live together and step *interleaved* (ragged, torch, floor, ragged,
  ...) so they see the same clocks and noise; ``warmup`` untimed rounds, then ``steps`` timed ones.
  Per step: wall time between host syncs (tokens/s), CUDA-event time of forward / backward /
  optimizer (``torch.cuda.Event(enable_timing=True)``), host time until ``optimizer.step()`` returns
  (``host_enqueue_s``; << wall time means the host runs ahead) and that thread's CPU time. Ratios
  are torch / ragged for time (> 1: raggedfsdp faster) and ragged / torch for memory (< 1: less).
* ``loss``: per-step losses of the three systems and max |ragged - torch|.

``--model dense``: Llama dim 2048, 20 layers, 16 heads / 8 kv heads, ffn 5632, vocab 32000
(~1.08 B params). ``--model moe``: dim 1024, 16 layers, 16 fused experts of width 1408, top-2,
vocab 32000 (~1.2 B total params). Batch 4 x seq 2048 per step. ``--dry-run``: tiny shapes on CPU (gloo).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Result, device_for, init_pg, section, shard, shutdown_pg, sync, write_stdout_json

SYSTEMS = ("ragged", "torch", "floor")


def config(model: str, dry_run: bool):
    """(model class, config, batch, seq)."""
    from raggedfsdp.app.models.llama import Llama, LlamaConfig
    from raggedfsdp.app.models.moe import MoE, MoEConfig

    if model == "dense":
        if dry_run:
            return (
                Llama,
                LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64),
                2,
                32,
            )
        return (
            Llama,
            LlamaConfig(
                dim=2048,
                n_layers=20,
                n_heads=16,
                n_kv_heads=8,
                ffn_dim=5632,
                vocab_size=32000,
                max_seq_len=2048,
            ),
            4,
            2048,
        )
    if dry_run:
        return (
            MoE,
            MoEConfig(
                dim=64,
                n_layers=1,  # dry run: one MoE block (+ the root unit) covers the code paths
                n_heads=4,
                n_kv_heads=2,
                ffn_dim=96,
                max_seq_len=64,
                n_experts=4,
                top_k=2,
                expert_dim=32,
                experts="fused",
            ),
            2,
            32,
        )
    return (
        MoE,
        MoEConfig(
            dim=1024,
            n_layers=16,
            n_heads=16,
            n_kv_heads=8,
            vocab_size=32000,
            max_seq_len=2048,
            n_experts=16,
            top_k=2,
            expert_dim=1408,
            experts="fused",
        ),
        4,
        2048,
    )


class Bench:
    """Builds the systems of one model from one state dict and runs timed steps."""

    def __init__(self, cls, cfg, dev, mesh, batch, seq):
        self.cls, self.cfg, self.dev, self.mesh, self.batch, self.seq = cls, cfg, dev, mesh, batch, seq
        torch.manual_seed(0)
        with torch.device(dev):
            ref = cls(cfg)
        ref.init_weights(0)  # CPU generator per parameter (deterministic); once per stage
        self.state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        self.n_params = sum(p.numel() for p in ref.parameters())
        del ref
        g = torch.Generator().manual_seed(1)
        self.tokens = [
            torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(dev) for _ in range(4)
        ]

    def build(self, system: str):
        with torch.device(self.dev):
            model = self.cls(self.cfg)
        model.load_state_dict(self.state)
        if system != "floor":
            shard(model, system, self.mesh, torch.bfloat16, torch.float32)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def loss(self, system, model, tok):
        ctx = torch.autocast(self.dev.type, dtype=torch.bfloat16) if system == "floor" else _null()
        with ctx:
            logits = model(tok[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
            aux = getattr(model, "aux_loss", None)
            if aux is not None:
                loss = loss + aux.float()
        return loss

    def step(self, system, model, opt, tok) -> dict:
        cuda = self.dev.type == "cuda"
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
        sync(self.dev)
        t0, c0 = time.perf_counter(), time.thread_time()
        if cuda:
            ev[0].record()
        loss = self.loss(system, model, tok)
        if cuda:
            ev[1].record()
        loss.backward()
        if cuda:
            ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            ev[3].record()
        host, cpu = time.perf_counter() - t0, time.thread_time() - c0
        sync(self.dev)
        wall = time.perf_counter() - t0
        r = {"wall_s": wall, "host_enqueue_s": host, "host_cpu_s": cpu, "loss": float(loss)}
        if cuda:
            r.update(
                forward_ms=ev[0].elapsed_time(ev[1]),
                backward_ms=ev[1].elapsed_time(ev[2]),
                optimizer_ms=ev[2].elapsed_time(ev[3]),
            )
        return r


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def memory(bench: Bench, res: Result) -> None:
    from raggedfsdp.app.bench.memory import measure_train_step

    out = {}
    # The first system measured in a process also pays what CUDA libraries allocate once and keep
    # (cuBLAS / cuBLASLt workspaces: 64 MiB on the first H200 run, where raggedfsdp, measured first,
    # showed exactly +64 MiB of "state"). A discarded first measurement ("settle") takes that.
    for key, s in (("settle", "ragged"), *((x, x) for x in SYSTEMS)):
        with section(res, f"memory_{key}"):
            if bench.dev.type == "cuda":
                torch.cuda.empty_cache()
            m = measure_train_step(
                lambda s=s: bench.build(s),
                lambda model, s=s: bench.loss(s, model, bench.tokens[0]),
                bench.dev,
                warmup_steps=1,
            )._asdict()
            m.pop("fwd_bwd_peak_owners", None)
            out[key] = {k: v for k, v in m.items()}
            res.set("memory", out)
    if "ragged" in out and "torch" in out:
        for k in ("state_bytes", "fwd_bwd_peak_bytes", "optim_peak_bytes"):
            out[f"ratio_{k.removesuffix('_bytes')}_ragged_over_torch"] = out["ragged"][k] / max(
                out["torch"][k], 1
            )
        res.set("memory", out)
    if bench.dev.type == "cuda":
        torch.cuda.empty_cache()


def speed(bench: Bench, res: Result, warmup: int, steps: int) -> None:
    systems = {}
    for s in SYSTEMS:
        with section(res, f"build_{s}"):
            systems[s] = bench.build(s)
    rows: dict = {s: [] for s in systems}
    for i in range(warmup + steps):
        tok = bench.tokens[i % len(bench.tokens)]
        for s, (model, opt) in systems.items():
            r = bench.step(s, model, opt, tok)
            if i >= warmup:
                rows[s].append(r)
        if i >= warmup:
            res.set("speed", summarize(rows, bench.batch * bench.seq))
    del systems


def summarize(rows: dict, tokens_per_step: int) -> dict:
    out: dict = {"tokens_per_step": tokens_per_step}
    for s, rs in rows.items():
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "loss"}
        med["tokens_per_s"] = tokens_per_step / med["wall_s"]
        med["losses"] = [round(r["loss"], 5) for r in rs]
        out[s] = med
    if "ragged" in out and "torch" in out:
        r, t = out["ragged"], out["torch"]
        out["tokens_per_s_ratio_ragged_over_torch"] = r["tokens_per_s"] / t["tokens_per_s"]
        out["max_abs_loss_diff_ragged_torch"] = max(abs(a - b) for a, b in zip(r["losses"], t["losses"]))
        if "floor" in out:
            out["tokens_per_s_ragged_over_floor"] = r["tokens_per_s"] / out["floor"]["tokens_per_s"]
            out["tokens_per_s_torch_over_floor"] = t["tokens_per_s"] / out["floor"]["tokens_per_s"]
            out["max_abs_loss_diff_ragged_floor"] = max(
                abs(a - b) for a, b in zip(r["losses"], out["floor"]["losses"])
            )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["dense", "moe"], default="dense")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = device_for(args.dry_run)
    cls, cfg, batch, seq = config(args.model, args.dry_run)
    if args.dry_run:
        args.warmup, args.steps = 1, 1
    res = Result(
        args.out,
        stage=f"train_{args.model}",
        device=str(dev),
        config=cfg.to_dict(),
        batch=batch,
        seq=seq,
        param_dtype="bf16",
        reduce_dtype="fp32",
        floor="fp32 params + torch.autocast(bf16), no FSDP",
    )
    mesh = init_pg(dev)
    bench = Bench(cls, cfg, dev, mesh, batch, seq)
    res.set("n_params", bench.n_params)
    if not args.skip_memory:
        memory(bench, res)
    with section(res, "speed"):
        speed(bench, res, args.warmup, args.steps)
    sp = res.data.get("speed", {})
    losses = [x for s in SYSTEMS for x in sp.get(s, {}).get("losses", [float("nan")])]
    finite = all(math.isfinite(x) for x in losses)
    res.set("ok", "error" not in sp and finite)
    shutdown_pg()
    write_stdout_json(res.data)


if __name__ == "__main__":
    main()
