"""Measured step time of ``raggedfsdp.fully_shard`` training, the input of the step-time model's fit.

``measure_steps(model, flavor, nproc, ...)`` launches ``nproc`` gloo ranks with torchrun running this
module, each training a built-in model (``raggedfsdp.models``, one FSDP unit per block, AdamW) and
timing ``steps`` steps after ``warmup`` (barrier before each step, slowest rank per step, the minimum
over steps). Used by ``raggedfsdp estimate-time --calibrate`` and its test; it measures, it does not model
(:mod:`raggedfsdp.sizing.steptime` models).
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


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.launch.teardown import shutdown_process_group
    from raggedfsdp.models import apply_fsdp, build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = build_model(args.model, args.flavor)
    model.init_weights(0)
    apply_fsdp(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(1 + rank)
    times, cpu = [], []
    for i in range(args.warmup + args.steps):
        tok = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c = torch.tensor(cpu, dtype=torch.float64)
    dist.all_reduce(c, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "step_seconds_median": statistics.median(t.tolist()),
                    "step_seconds_min": min(t.tolist()),
                    "cpu_seconds_min": min(c.tolist()),
                    "step_seconds": t.tolist(),
                },
                f,
            )
    shutdown_process_group()


def measure_steps(
    model: str,
    flavor: str,
    nproc: int,
    *,
    batch: int = 2,
    seq: int = 128,
    steps: int = 8,
    warmup: int = 2,
    timeout: float = 600.0,
    clock: str = "cpu",
) -> float:
    """Fastest step of ``nproc`` gloo ranks training ``model``/``flavor``, in seconds (slowest rank per
    step; the minimum over ``steps`` resists a busy machine).

    ``clock="cpu"`` (default): the CPU seconds a rank's process spends in the step (all its threads),
    which more ranks than cores, or other jobs on the box, do not inflate; ``"wall"``: elapsed time.

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
            f"--nproc-per-node={nproc}",
            "-m",
            "raggedfsdp.bench.steptime",
            "--model",
            model,
            "--flavor",
            flavor,
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
            return json.load(f)["cpu_seconds_min" if clock == "cpu" else "step_seconds_min"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m raggedfsdp.bench.steptime")
    for k, v in (("--model", "llama"), ("--flavor", "small"), ("--out", "steps.json")):
        p.add_argument(k, default=v)
    for k, v in (("--batch", 2), ("--seq", 128), ("--steps", 6), ("--warmup", 2)):
        p.add_argument(k, type=int, default=v)
    _worker(p.parse_args(argv))


if __name__ == "__main__":
    main()
