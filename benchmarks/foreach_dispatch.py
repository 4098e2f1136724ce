"""Host time of ``clip_grad_norm_`` + ``torch.optim.AdamW(foreach=True)`` steps on FSDP-sharded
params: raggedfsdp with its foreach fast path (``raggedfsdp/placement/_foreach.py``), raggedfsdp without it
(``RAGGEDFSDP_FOREACH_FAST_PATH=0``: torch's DTensor dispatch, as torch's own ``fully_shard`` gets),
and torch's ``fully_shard``.

    python benchmarks/foreach_dispatch.py [--layers 200] [--dim 64] [--world-size 2] [--json]

The model is ``--layers`` ``nn.Linear(dim, dim)`` (2 x layers params), sharded over rank 0 of a fake
world of ``--world-size`` (no real communication: only host work is measured). Each system runs in its
own process (DTensor's propagation caches live for a whole process) and times, wall clock:

* ``first``: the first ``clip_grad_norm_`` + ``optimizer.step()`` (sharding propagation of every
  foreach op, cold caches);
* ``steady``: a later step with the same params holding grads (the median of ``--steps``);
* ``new_set``: a step in which one param has no ``.grad`` -- a set of params not seen before (an MoE
  expert that got no token on any rank), so every foreach op's list is a new cache key.

On torch 2.13 / 2.14 ``first`` and ``new_set`` grow with the square of the param count under torch's
dispatch (its propagation walks the whole schema once per list index); results and commands are in
``benchmarks/README.md``, "Sharding propagation of foreach ops".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SYSTEMS = {  # name: (fully_shard backend, RAGGEDFSDP_FOREACH_FAST_PATH)
    "raggedfsdp": ("ragged", "1"),
    "raggedfsdp, fast path off": ("ragged", "0"),
    "torch fully_shard": ("torch", "1"),
}


def _measure(system: str, layers: int, dim: int, ws: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raggedfsdp.app.models import apply_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ws)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Stack()
    apply_fsdp(model, init_device_mesh("cpu", (ws,)), backend=SYSTEMS[system][0])  # a unit per layer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    params = list(model.parameters())
    x = torch.randn(4, dim)

    def step(drop=None) -> float:
        model(x).sum().backward()
        if drop is not None:
            params[drop].grad = None
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        return dt

    first = step()
    steady = statistics.median(step() for _ in range(steps))
    new_set = step(drop=len(params) // 2)
    dist.destroy_process_group()
    return dict(system=system, params=len(params), first=first, steady=steady, new_set=new_set)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=200, help="nn.Linear layers (2 params each); default 200")
    p.add_argument("--dim", type=int, default=64, help="their width; default 64")
    p.add_argument("--world-size", type=int, default=2, help="fake world size (rank 0 measured); default 2")
    p.add_argument("--steps", type=int, default=5, help="steady steps (median); default 5")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--system", choices=list(SYSTEMS), help=argparse.SUPPRESS)  # one child process
    args = p.parse_args(argv)
    for name in ("layers", "dim", "world_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.system:
        print(json.dumps(_measure(args.system, args.layers, args.dim, args.world_size, args.steps)))
        return
    rows = []
    for name, (_, fast) in SYSTEMS.items():
        env = dict(os.environ, RAGGEDFSDP_FOREACH_FAST_PATH=fast)
        cmd = [sys.executable, os.path.abspath(__file__), "--system", name]
        cmd += ["--layers", str(args.layers), "--dim", str(args.dim)]
        cmd += ["--world-size", str(args.world_size), "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"foreach_dispatch: the {name!r} run failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    import torch

    ours = rows[0]
    print(
        f"clip_grad_norm_ + AdamW(foreach=True) step, host wall time; {ours['params']} params, rank 0 of "
        f"a fake world of {args.world_size}, torch {torch.__version__}"
    )
    print(f"{'system':28s}{'first step':>13s}{'steady':>11s}{'new set of grads':>18s}")
    for r in rows:
        print(f"{r['system']:28s}{r['first']:12.3f}s{r['steady'] * 1e3:9.1f}ms{r['new_set']:17.3f}s")
    for r in rows[1:]:
        print(
            f"{r['system']} / raggedfsdp: first step x{r['first'] / ours['first']:.1f}, steady "
            f"x{r['steady'] / ours['steady']:.2f}, new set of grads x{r['new_set'] / ours['new_set']:.1f}"
        )


if __name__ == "__main__":
    main()
