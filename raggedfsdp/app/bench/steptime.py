"""Measured step time of ``raggedfsdp.fully_shard`` training, the input of the step-time model's fit.

``measure_steps(models, world_sizes, ...)`` launches ``max(world_sizes)`` gloo ranks with torchrun
running this module, once. For each built-in model (``raggedfsdp.app.models``, one FSDP unit per block,
AdamW) and each world size ``n`` it trains a copy on the first ``n`` ranks (a process group of those
ranks; the others wait at a barrier, idle) and times ``steps`` steps after ``warmup``: a barrier of
the group before each step, the slowest rank per step, the median over steps. The copies step in
turn, one step each per round (the order reversed every other round), so the machine's load over the
run reaches every size alike; one launch for all the sizes keeps it short (torch's import and the
rendezvous are paid once).

Each step is timed twice: elapsed (``time.perf_counter``) and the rank process's CPU seconds
(``time.process_time``: all its threads, gloo's included). With more ranks than cores, or other jobs
on the machine, the elapsed time is the OS scheduler's share; the CPU seconds are the step's work,
which :mod:`raggedfsdp.app.sizing.steptime` models for a CPU host (its ``cpu`` cluster). Used by
``raggedfsdp estimate-time --calibrate`` and its test; it measures, it does not model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


class _System:
    """One (model, world size): the model and optimizer on the first ``n`` ranks, its timings."""

    def __init__(self, spec: str, group, rank: int, member: bool):
        self.spec, self.group, self.member = spec, group, member
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.cpu_opt: list[float] = []
        if not member:
            return
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        from raggedfsdp.app.models import apply_fsdp, build_model

        fam, flavor = spec.split(":")
        torch.manual_seed(0)
        self.model = build_model(fam, flavor)
        self.model.init_weights(0)
        apply_fsdp(self.model, DeviceMesh.from_group(group, "cpu"))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.gen = torch.Generator().manual_seed(1 + rank)

    def step(self, args, timed: bool) -> None:
        import torch
        import torch.distributed as dist

        tok = torch.randint(0, 256, (args.batch, args.seq + 1), generator=self.gen)
        dist.barrier(self.group)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = self.model(tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
        loss.backward()
        c1 = time.process_time()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if timed:
            self.wall.append(time.perf_counter() - t0)
            self.cpu.append(time.process_time() - c0)
            self.cpu_opt.append(time.process_time() - c1)

    def result(self, args) -> dict:
        import torch
        import torch.distributed as dist

        t = torch.tensor([self.wall, self.cpu, self.cpu_opt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # the slowest rank per step
        w, c, o = t.tolist()
        return {
            "model": self.spec,
            "world_size": self.group.size(),
            "batch": args.batch,
            "seq": args.seq,
            "wall_s": statistics.median(w),
            "cpu_s": statistics.median(c),
            "cpu_min_s": min(c),
            "cpu_opt_s": statistics.median(o),
            "cpu_opt_min_s": min(o),
            "wall_steps": w,
            "cpu_steps": c,
        }


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from raggedfsdp.teardown import shutdown_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = [int(x) for x in args.world_sizes.split(",")]
    systems = []
    for spec in args.models.split(","):
        for n in sizes:
            group = dist.new_group(list(range(n)))  # collective over the world, members or not
            systems.append(_System(spec, group, rank, rank < n))
    # interleaved: one step of every (model, size) per round, the order reversed every other round,
    # so a change of the machine's load over the run reaches every size alike
    for i in range(args.warmup + args.steps):
        for s in systems if i % 2 == 0 else systems[::-1]:
            if s.member:
                s.step(args, timed=i >= args.warmup)
            dist.barrier()  # the others wait, idle
    rows = [s.result(args) for s in systems if s.member]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"cores": os.cpu_count(), "rows": rows}, f)
    shutdown_process_group()


def measure_steps(
    models: list[str],
    world_sizes: list[int],
    *,
    batch: int = 2,
    seq: int = 128,
    steps: int = 6,
    warmup: int = 2,
    timeout: float = 600.0,
) -> list[dict]:
    """Measure each of ``models`` (``"llama:small"``, ``"moe:moe-small"``, ...) at each of
    ``world_sizes`` in one torchrun launch of ``max(world_sizes)`` gloo ranks (one thread each).

    Returns one dict per (model, world size), in that order: ``model``, ``world_size``, ``batch``,
    ``seq``, ``cpu_s`` / ``cpu_min_s`` (median / fastest over steps of the slowest rank's CPU seconds
    per step), ``cpu_opt_s`` / ``cpu_opt_min_s`` (the same for the optimizer step alone), ``wall_s``
    (elapsed, median), ``cpu_steps`` / ``wall_steps`` (every timed step).

    Raises:
        RuntimeError: the launch failed (its stderr tail in the message).
    """
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "steps.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={max(world_sizes)}",
            "-m",
            "raggedfsdp.app.bench.steptime",
            "--models",
            ",".join(models),
            "--world-sizes",
            ",".join(map(str, world_sizes)),
            "--batch",
            str(batch),
            "--seq",
            str(seq),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--out",
            out,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
        if r.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"measure_steps: {' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["rows"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m raggedfsdp.app.bench.steptime")
    for k, v in (("--models", "llama:small"), ("--world-sizes", "1,2"), ("--out", "steps.json")):
        p.add_argument(k, default=v)
    for k, v in (("--batch", 2), ("--seq", 128), ("--steps", 6), ("--warmup", 2)):
        p.add_argument(k, type=int, default=v)
    _worker(p.parse_args(argv))


if __name__ == "__main__":
    main()
