"""DCP with RaggedShard: each rank writes only its own boxes; load into any layout / world size.

Saved at 4 ranks in one ragged layout (model + AdamW state), loaded exactly at 3 ranks in other
ragged layouts, Shard(0), Replicate, and into plain tensors in a single process.
"""

import os

import torch

from _cases import case_tmpdir
from _spawns import CHECKPOINTS  # one spawn per world size for the 4 checkpoint tests

SHAPES = [(8, 3), (5,), (4, 2, 3), (2, 3, 1, 2), (6, 1)]
UNITS4 = [
    ((0,), (1, 0, 2, 1)),
    ((0,), (0, 0, 5, 0)),
    ((0, 1, 2), (7, 0, 11, 6)),
    ((0, 1, 2, 3), (1, 2, 0, 9)),
    ((0,), (1, 1, 1, 3)),
]
UNITS3 = [((0, 1), (5, 1, 2)), ((0,), (1, 2, 2)), ((0,), (0, 4, 0)), ((0, 1), (0, 3, 3)), ((0, 1), (2, 0, 1))]


def _fulls():
    g = torch.Generator().manual_seed(42)
    return [torch.randn(s, generator=g) for s in SHAPES], [torch.randn(s, generator=g) for s in SHAPES]


def _ref_optim_state(fulls, grads):
    ps = [torch.nn.Parameter(f.clone()) for f in fulls]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt = torch.optim.AdamW(ps, lr=0.1)
    opt.step()
    return (
        [p.detach() for p in ps],
        [opt.state[p]["exp_avg"] for p in ps],
        [opt.state[p]["exp_avg_sq"] for p in ps],
    )


class _M(torch.nn.Module):
    def __init__(self, tensors):
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_parameter(f"p{i}", torch.nn.Parameter(t))


def _save(rank, ws, path):
    import torch.distributed.checkpoint as dcp
    from raggedfsdp import RaggedShard
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    fulls, grads = _fulls()
    pls = [RaggedShard(d, u) for d, u in UNITS4]
    m = _M([distribute_tensor(f, mesh, [p]) for f, p in zip(fulls, pls)])
    for prm, g, p in zip(m.parameters(), grads, pls):
        prm.grad = distribute_tensor(g, mesh, [p])
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    opt.step()
    msd, osd = get_model_state_dict(m), get_optimizer_state_dict(m, opt)
    assert osd["state"]["p0"]["exp_avg"].placements == (pls[0],)
    # each rank writes only its own boxes: a planner hook records the write items
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Rec(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            Rec.items = [
                (it.index.fqn, tuple(it.tensor_data.chunk.offsets), tuple(it.tensor_data.chunk.sizes))
                for it in plan.items
                if it.tensor_data is not None
            ]
            return plan

    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, planner=Rec())
    ref = [p.full_tensor() for p in m.parameters()]
    if rank == 0:
        torch.save(ref, path + ".ref.pt")
    # 2-D meshes: HSDP (Replicate, RS) and (RS, Shard(last)); replicas are deduplicated by DCP
    from torch.distributed.tensor import Replicate, Shard

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    sd2 = {
        "a": distribute_tensor(fulls[0], mesh2, [Replicate(), RaggedShard((0,), (1, 3))]),
        "b": distribute_tensor(fulls[2], mesh2, [RaggedShard((0,), (3, 1)), Shard(2)]),
        "c": distribute_tensor(fulls[3], mesh2, [Shard(2), RaggedShard((0, 1), (5, 1))]),
    }
    dcp.save(sd2, checkpoint_id=path + "_2d")
    vol = sum(torch.Size(s).numel() for f, o, s in Rec.items if f.startswith("model."))
    assert vol == sum(p.to_local().numel() for p in m.parameters()), (vol, Rec.items)


def _load(rank, ws, path):
    import torch.distributed.checkpoint as dcp
    from raggedfsdp import RaggedShard
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    fulls, grads = _fulls()
    _, ravg, rsq = _ref_optim_state(fulls, grads)
    rparams = torch.load(path + ".ref.pt")  # exactly what was saved
    layouts = [[RaggedShard(d, u) for d, u in UNITS3], [Shard(0)] * len(SHAPES), [Replicate()] * len(SHAPES)]
    for pls in layouts:
        pls = [p if isinstance(p, RaggedShard) else p for p in pls]
        m = _M([distribute_tensor(torch.zeros(s), mesh, [p]) for s, p in zip(SHAPES, pls)])
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        for prm in m.parameters():  # materialize optimizer state in the target layout
            prm.grad = torch.zeros_like(prm)
        opt.step()
        msd, osd = get_model_state_dict(m), get_optimizer_state_dict(m, opt)
        ptrs = [v.to_local().data_ptr() for v in msd.values()]
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        assert ptrs == [v.to_local().data_ptr() for v in msd.values()], "load must write in place"
        for i, (prm, f) in enumerate(zip(m.parameters(), fulls)):
            assert torch.equal(msd[f"p{i}"].full_tensor(), rparams[i]), (pls[i], i)
            st = osd["state"][f"p{i}"]
            torch.testing.assert_close(st["exp_avg"].full_tensor(), ravg[i], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(st["exp_avg_sq"].full_tensor(), rsq[i], atol=1e-6, rtol=1e-5)
            assert st["exp_avg"].placements == (pls[i],)
    # exact: model params equal what rank 4 saved (re-load into ragged twice -> identical)
    pls = [RaggedShard(d, u) for d, u in UNITS3]
    m = _M([distribute_tensor(torch.zeros(s), mesh, [p]) for s, p in zip(SHAPES, pls)])
    msd = get_model_state_dict(m)
    dcp.load({"model": msd}, checkpoint_id=path)
    full_sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    # full_state_dict gathers the ragged pieces
    for i, f in enumerate(rparams):
        assert torch.equal(full_sd[f"p{i}"], f)
    # set_model_state_dict(full_state_dict=True[, broadcast_from_rank0]) into ragged params
    for bcast in (False, True):
        m2 = _M([distribute_tensor(torch.zeros(s), mesh, [p]) for s, p in zip(SHAPES, pls)])
        sd = {k: v.clone() for k, v in full_sd.items()} if (rank == 0 or not bcast) else {}
        set_model_state_dict(
            m2, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast)
        )
        for i, prm in enumerate(m2.parameters()):
            assert prm.placements == (pls[i],)
            assert torch.equal(prm.full_tensor(), full_sd[f"p{i}"])
            assert torch.equal(prm.to_local(), pls[i].shard_full(full_sd[f"p{i}"], rank))
    # the 2-D-mesh checkpoint loads into 1-D ragged layouts at 3 ranks, exactly
    sd2 = {
        "a": distribute_tensor(torch.zeros(SHAPES[0]), mesh, [RaggedShard((0, 1), (1, 1, 4))]),
        "b": distribute_tensor(torch.zeros(SHAPES[2]), mesh, [RaggedShard((0,), (0, 1, 1))]),
        "c": distribute_tensor(torch.zeros(SHAPES[3]), mesh, [Replicate()]),
    }
    dcp.load(sd2, checkpoint_id=path + "_2d")
    for k, i in (("a", 0), ("b", 2), ("c", 3)):
        assert torch.equal(sd2[k].full_tensor(), fulls[i]), k
    # the optimizer state dict API sees the ragged placement too
    osd = get_optimizer_state_dict(m, torch.optim.AdamW(m.parameters()))
    assert isinstance(osd, dict)


def _save_shared(rank, ws):
    _save(rank, ws, os.path.join(case_tmpdir("ragged"), "ckpt"))


def _load_shared(rank, ws):
    _load(rank, ws, os.path.join(case_tmpdir("ragged"), "ckpt"))


def test_dcp_save_4_load_3_and_plain():
    path = os.path.join(CHECKPOINTS.scratch("ragged"), "ckpt")
    CHECKPOINTS.check(4, "ragged_save")
    CHECKPOINTS.check(3, "ragged_load")
    # into plain tensors, no process group (single process)
    import torch.distributed.checkpoint as dcp

    import raggedfsdp  # noqa: F401

    rparams = torch.load(path + ".ref.pt")
    sd = {"model": {f"p{i}": torch.zeros(s) for i, s in enumerate(SHAPES)}}
    dcp.load(
        sd, checkpoint_id=path, no_dist=True
    ) if "no_dist" in dcp.load.__code__.co_varnames else dcp.load(sd, checkpoint_id=path)
    for i, f in enumerate(rparams):
        assert torch.equal(sd["model"][f"p{i}"], f)
