"""Host cost of raggedfsdp's DTensor op handlers on DTensors that are *not* RaggedShard (a tensor-parallel
user's ``Shard`` / ``Replicate`` DTensors): per op, microseconds per call with raggedfsdp's patches
installed vs plain torch, each in its own process (DTensor's sharding caches live for a process).

    python benchmarks/dtensor_handler_cost.py [--world-size 4] [--calls 300] [--repeats 7] [--rounds 3]

Installing raggedfsdp's patches (``RaggedShard(...)``, ``fully_shard``) puts custom handlers in front of
every DTensor call of some ops (``DTensor._op_dispatcher._custom_op_handlers``; the list is
``raggedfsdp.placement._patches.patched_symbols()``): random fills, reductions, ``.item()``,
squeeze/unsqueeze and the foreach ops. On a non-RaggedShard operand each hands the call back to
torch's dispatch (raggedfsdp/placement/_ops.py ``call_torch_dispatch``) or runs its own fast path
(foreach). This measures what that costs a TP user, next to control ops that have no handler
(``add``, ``mm``). One process, a fake process group of ``--world-size`` ranks (no communication:
only host work), a 1-D mesh; the median over ``--repeats`` of the mean of ``--calls`` calls after
warm-up, the minimum of that over ``--rounds`` alternated runs of the two systems.
Results and the command: benchmarks/README.md, "DTensor handler cost for non-RaggedShard DTensors".

    python benchmarks/dtensor_handler_cost.py --handback-ab [--ab-rounds 60]

compares, in ONE process (so a shared machine's drift hits both alike), raggedfsdp's hand-back
(``_patches.dispatch_without_handler``: a per-thread view of torch's handler dict) with the design it
replaced (pop the handler from torch's shared dict under a lock, dispatch, put it back: not
thread-safe; run on torch's own dispatcher class, so the control ops show what the view's property
costs every DTensor op), alternated per measurement of 100 calls (either first, by turns); min and
10th percentile over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _cases(torch, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(32, 32), mesh, [Replicate()])
    s = distribute_tensor(torch.tensor(3.0), mesh, [Replicate()])
    xs = [distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]) for _ in range(32)]
    ys = [distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]) for _ in range(32)]
    return {
        # ops with a raggedfsdp handler
        "sum(dim=1)": lambda: x.sum(dim=1),
        "mean()": lambda: x.mean(),
        "amax()": lambda: x.amax(),
        "max(dim=1)": lambda: x.max(dim=1),
        "any()": lambda: (x > 0).any(),
        "linalg.vector_norm": lambda: torch.linalg.vector_norm(x),
        "unsqueeze(0)": lambda: x.unsqueeze(0),
        "squeeze(0) of (1,64,32)": (lambda u: lambda: u.squeeze(0))(x.unsqueeze(0)),
        ".item() (Replicate)": lambda: s.item(),
        "uniform_": lambda: x.uniform_(),
        "_foreach_add_ (32 tensors)": lambda: torch._foreach_add_(xs, ys),
        "_foreach_norm (32 tensors)": lambda: torch._foreach_norm(xs),
        # controls: no raggedfsdp handler
        "control: add": lambda: x + x,
        "control: mm": lambda: torch.mm(x, w),
    }


def _worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))
    if args.system == "raggedfsdp":
        from raggedfsdp import RaggedShard

        RaggedShard((0,), (1,) * args.world_size)  # installs the patches, as fully_shard does
    torch.manual_seed(0)
    cases = _cases(torch, mesh)
    out = {}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        reps = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            reps.append((time.perf_counter() - t0) / args.calls * 1e6)
        out[name] = statistics.median(reps)
    dist.destroy_process_group()
    return out


def _handback_ab(args) -> int:
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raggedfsdp import RaggedShard
    from raggedfsdp.placement import _ops, _random
    from raggedfsdp.placement import _patches as tp

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))
    RaggedShard((0,), (1,) * args.world_size)
    lock = threading.RLock()

    def pop_under_lock(op_call, a, kw):  # the replaced design
        handlers = DTensor._op_dispatcher._custom_op_handlers
        with lock:
            mine = handlers.pop(op_call)
            try:
                return op_call(*a, **kw)
            finally:
                handlers[op_call] = mine

    disp = DTensor._op_dispatcher
    view_cls, torch_cls = type(disp), type(disp).__mro__[1]  # raggedfsdp's subclass (item 12), torch's

    def use_view(on: bool) -> None:  # the pop design ran on torch's class: a plain instance dict
        if on and type(disp) is not view_cls:
            del vars(disp)["_custom_op_handlers"]
            disp.__class__ = view_cls
        elif not on and type(disp) is view_cls:
            disp.__class__ = torch_cls
            vars(disp)["_custom_op_handlers"] = tp._HandlerView.current

    designs = {
        "pop under a lock": (pop_under_lock, False),
        "per-thread view": (tp.dispatch_without_handler, True),
    }
    torch.manual_seed(0)
    cases = {k: v for k, v in _cases(torch, mesh).items() if "foreach" not in k}
    res = {d: {k: [] for k in cases} for d in designs}
    for fn in cases.values():
        for _ in range(20):
            fn()
    try:
        for r in range(args.ab_rounds):
            order = list(designs.items())[:: 1 if r % 2 else -1]  # either design first, alternately
            for name, fn in cases.items():
                for d, (impl, view) in order:
                    use_view(view)
                    _ops.dispatch_without_handler = _random.dispatch_without_handler = impl
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(100):
                        fn()
                    res[d][name].append((time.perf_counter() - t0) / 100 * 1e6)
    finally:
        use_view(True)
        _ops.dispatch_without_handler = _random.dispatch_without_handler = tp.dispatch_without_handler
    dist.destroy_process_group()
    print(
        f"{'op (non-RaggedShard DTensor)':30s}"
        + "".join(f"{d + ' us':>22s}" for d in designs)
        + f"{'diff us':>9s}"
    )
    for name in cases:
        mins = [min(res[d][name]) for d in designs]
        q10 = [sorted(res[d][name])[len(res[d][name]) // 10] for d in designs]
        cells = "".join(f"{m:12.2f} (p10 {q:5.1f})" for m, q in zip(mins, q10))
        print(f"{name:30s}{cells}{mins[1] - mins[0]:+9.2f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3, help="alternated runs of each system (min over them)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--handback-ab", action="store_true", help="in-process A/B of the hand-back designs")
    p.add_argument("--ab-rounds", type=int, default=60)
    p.add_argument("--system", choices=["torch", "raggedfsdp"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.handback_ab:
        return _handback_ab(args)
    if args.system:
        print(json.dumps(_worker(args)))
        return 0
    res = {"torch": {}, "raggedfsdp": {}}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(args.rounds):  # alternated, so a shared machine's drift hits both; min over rounds
        for system in ("torch", "raggedfsdp"):
            cmd = [sys.executable, __file__, "--system", system, "--world-size", str(args.world_size),
                   "--calls", str(args.calls), "--repeats", str(args.repeats)]  # fmt: skip
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            for name, us in json.loads(done.stdout).items():
                res[system][name] = min(us, res[system].get(name, us))
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{'op (non-RaggedShard DTensor)':30s}{'torch us':>10s}{'raggedfsdp us':>15s}{'ratio':>8s}")
    for name in res["torch"]:
        a, b = res["torch"][name], res["raggedfsdp"][name]
        print(f"{name:30s}{a:10.1f}{b:15.1f}{b / a:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
