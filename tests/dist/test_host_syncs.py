"""Per-step host syncs outside the FSDP core (issue 21 item 4, the parts outside fsdp/), on CPU.

``torch.tensor(values, device=cuda)`` is a pageable host-to-device copy followed by a stream
synchronize. It used to sit in ``train/guard.py`` (the grad-norm weights, every step, before the
step's one documented sync) and ``train/trainer.py`` (loss and grad norm returned after
``optimizer.step()``, making the host wait for the optimizer step). And an unpinned CPU-offload
master was copied to the GPU with ``non_blocking=False``: a ``cudaStreamSynchronize`` per unshard,
where FSDP2 always copies host-to-device with ``non_blocking=True``. Without a GPU these are checked
by the calls themselves:

* ``local_sumsq`` makes no ``torch.tensor`` with a ``device=`` and equals a float64 oracle;
* ``Trainer.train_step``'s source makes no ``torch.tensor(..., device=...)``;
* under CPU offload (``pin_memory=False``) with a bf16 cast, every host -> compute-device copy of
  the master is issued with ``non_blocking=True`` (a dispatch-mode record of ``aten.copy_``).
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap

import torch
from _memory import run_fake_rank
from torch.utils._python_dispatch import TorchDispatchMode


def _case(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import raggedfsdp
    from raggedfsdp.app.train import guard

    mesh = init_device_mesh("cpu", (ws,))
    # ---- guard: no H2D-making torch.tensor(device=...) in the per-step reduction ------------------
    ts = [torch.randn(6, 3), torch.randn(5)]
    dts = [distribute_tensor(t, mesh, [Shard(0)]) for t in ts]
    made = []
    orig = torch.tensor

    def spy(*a, **k):
        if "device" in k:
            made.append(k["device"])
        return orig(*a, **k)

    torch.tensor = spy
    try:
        got = guard.local_sumsq(dts + [torch.randn(0)])
    finally:
        torch.tensor = orig
    # fake PG: every rank holds (the same-shaped) pieces; rank 0's pieces are the oracle of its sum
    want = sum(float(d.to_local().double().pow(2).sum()) for d in dts)
    assert not made, f"torch.tensor(..., device=...) in local_sumsq: {made}"
    assert abs(float(got) - want) <= 1e-6 * max(1.0, want), (float(got), want)  # fp32 norms, then float64

    # ---- offload without pinned memory: the H2D copy-in is non_blocking ----------------------------
    class Rec(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.flags = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (
                func is torch.ops.aten.copy_.default
                and args[1].dtype == torch.float32
                and args[0].dtype == torch.bfloat16
            ):
                self.flags.append(bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
            return func(*args, **kwargs)

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    m = copy.deepcopy(base)
    pol = raggedfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    off = raggedfsdp.CPUOffloadPolicy(pin_memory=False)
    raggedfsdp.fully_shard(m[0], mesh=mesh, mp_policy=pol, offload_policy=off)
    raggedfsdp.fully_shard(m, mesh=mesh, mp_policy=pol, offload_policy=off)
    with Rec() as r:
        m(torch.randn(4, 8))
    assert r.flags and all(r.flags), f"copy-in of the offloaded master with non_blocking={r.flags}"
    return True


def test_no_per_step_host_syncs_in_guard_and_offload_copy_in():
    assert run_fake_rank(_case, 2, 0)


def test_trainer_step_makes_no_device_tensors_from_host_values():
    from raggedfsdp.app.train.trainer import Trainer

    src = textwrap.dedent(inspect.getsource(Trainer.train_step))
    bad = [
        ast.unparse(n)
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) == "torch.tensor"
        and any(k.arg == "device" for k in n.keywords)
    ]
    assert not bad, f"host-to-device torch.tensor(...) in the optimizer step: {bad}"
