"""``raggedfsdp bench`` under NCCL semantics on CPU (issue 21 item 2).

``init_process_group("nccl")`` has no CPU backend: a collective on a CPU tensor raises "No backend
type associated with device type cpu". The bench once all-reduced its timings, memory figures,
final losses and replay timer as CPU tensors, so it could not finish on a GPU. Here the bench worker
(``raggedfsdp.app.bench.worker.run``, 2 gloo ranks, with ``--floor`` so the replay timer runs too) runs with
``torch.distributed``'s ``all_reduce`` / ``all_gather`` / ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` wrapped like an NCCL-only group: a call *from bench code* raises that error
unless its tensors were put on the process group's device by ``bench.measure.to_comm_device`` (here
marked, since on CPU that device is the CPU). Collectives issued by the FSDP runtimes are not wrapped.
The result must still agree between the systems (the numbers went through the collectives).
"""

from __future__ import annotations

import argparse
import sys
import weakref

import torch
import torch.distributed as dist
from _dist import run_distributed

_WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _case(rank, ws):
    from raggedfsdp.app.bench import measure, worker
    from raggedfsdp.app.bench.options import build_arg_parser

    on_device: dict = {}  # id -> weakref of the tensors to_comm_device returned
    calls = {"bench": 0}
    orig_to = getattr(measure, "to_comm_device", None)
    if orig_to is not None:

        def to_comm_device(t, device):
            d = orig_to(t, device).clone()  # a distinct tensor we can recognise as "on the PG's device"
            on_device[id(d)] = weakref.ref(d)
            return d

        measure.to_comm_device = to_comm_device

    def nccl_like(fn):
        def wrapped(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if "/raggedfsdp/app/bench/" in caller:
                calls["bench"] += 1
                for t in _tensors(list(args) + list(kwargs.values())):
                    ref = on_device.get(id(t))
                    if ref is None or ref() is not t:
                        raise RuntimeError(
                            f"No backend type associated with device type cpu ({fn.__name__} "
                            f"from {caller.rsplit('/', 1)[-1]})"
                        )
            return fn(*args, **kwargs)

        return wrapped

    for name in _WRAPPED:
        setattr(dist, name, nccl_like(getattr(dist, name)))
    argv = [
        "--model",
        "dense",
        "--flavor",
        "debug",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--batch",
        "1",
        "--seq",
        "16",
        "--quiet",
    ]
    args = build_arg_parser(argparse.ArgumentParser()).parse_args(argv)
    out = worker.run(args)
    assert calls["bench"] >= 5, calls  # timings, CPU times, final losses, memory, replay timer
    if rank == 0:
        assert abs(out["raggedfsdp"]["final_loss"] - out["torch"]["final_loss"]) < 1e-4, out
        assert (
            out["raggedfsdp"]["comm_only_seconds"] > 0
            and len(out["raggedfsdp"]["state_bytes_per_rank"]) == ws
        )


def test_bench_collectives_use_the_process_group_device():
    run_distributed(_case, 2)
