"""Drop-in where users are (issue 39), each against torch's own ``fully_shard`` on the same script:

* ws 3: a ``@dataclass`` / NamedTuple / nested dict-list output fed to the next unit (and a dataclass
  input cast by ``param_dtype``) trains with torch's losses and parameters; ``checkpoint_wrapper(block)``,
  ``fully_shard(block)``, ``fully_shard(wrapper)`` (accelerate / HF Trainer activation checkpointing)
  trains as torch; ``dp_mesh_dims=None``; ``Shard(1)`` from ``shard_placement_fn``; a
  ``ShardPlacementResult`` on the unit's mesh (another mesh raises ``NotImplementedError``);
  ``set_all_reduce_hook``; ``share_comm_ctx``; ``raggedfsdp.patch_torch()``: framework code that imports
  ``torch.distributed.fsdp.fully_shard`` after the patch shards with raggedfsdp and trains as unpatched
  raggedfsdp, torch's own ``fully_shard`` still works while patched, ``undo()`` restores torch's.
* ws 2: ``dp_mesh_dims`` on full-DTensor models (torchtitan's ``full_dtensor`` mode): 1-D ``shard``,
  ``(dp, tp)`` with tp 1 and 2 (TP placements on the other dim), HSDP ``(replicate, shard)`` both ways,
  two flattened shard dims: losses and parameters == torch's; the unsupported cases raise.
* ws 4: int ``reshard_after_forward`` on a 2-D (HSDP) mesh == torch's.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed.fsdp  # noqa: F401  (the skip condition reads it at collection)
from _dist import run_distributed
from torch import nn


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    skip: torch.Tensor
    step: int = 0


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class ToDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x):
        return Hidden(torch.tanh(self.lin(x)), x.sum(-1, keepdim=True))


class DataclassToPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, hidden: Hidden):
        y = self.lin(hidden.h)
        return Pair(torch.relu(y), y * hidden.skip)


class PairToNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)

    def forward(self, pair: Pair):
        return {"out": [self.lin(pair.a), (self.lin(pair.b),)]}


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ToDataclass(), DataclassToPair(), PairToNested()])

    def forward(self, x):
        return self.blocks[2](self.blocks[1](self.blocks[0](x)))


class DataclassIn(nn.Module):  # the mixed-precision input cast must reach into the dataclass
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = DataclassToPair()
        self.head = nn.Linear(8, 6)

    def forward(self, x):
        pair = self.inner(Hidden(x, x[..., :1]))
        return self.head(pair.a + pair.b)


def _loss(out):
    if isinstance(out, dict):
        return out["out"][0].pow(2).mean() + out["out"][1][0].pow(2).mean()
    return out.pow(2).mean()


def _train(m, ws, d_in, steps=3, dtype=torch.float32, hook=None):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = _loss(m(torch.randn(2 * ws, d_in, generator=gen).to(dtype)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in m.parameters()]
    return losses, [t.detach().clone() for t in full]


def _same(a, b, what, atol=1e-6):
    (la, pa), (lb, pb) = a, b
    assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=atol, rtol=1e-5), (what, la, lb)
    assert len(pa) == len(pb), what
    for x, y in zip(pa, pb):
        assert x.dtype == y.dtype and torch.allclose(x, y, atol=atol, rtol=1e-5), (what, (x - y).abs().max())


def _libs():
    import raggedfsdp
    from raggedfsdp.fsdp._fully_shard import _TORCH_FULLY_SHARD

    return {"torch": _TORCH_FULLY_SHARD, "ours": raggedfsdp.fully_shard}


def _structures(ws):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    res = {}
    for name, fs in _libs().items():
        m = Structured()
        for b in m.blocks:
            fs(b)
        fs(m)
        for b in m.blocks:  # no backward prefetch: only the hooks on the outputs re-gather a unit
            b.set_modules_to_backward_prefetch([])
        res[name] = _train(m, ws, 6)
        # dataclass input, param_dtype float64 on a float32 model: the cast reaches the dataclass
        mp = MixedPrecisionPolicy(param_dtype=torch.float64)
        m = DataclassIn()
        fs(m.inner, mp_policy=mp)
        fs(m, mp_policy=mp)
        res[name + "_mp"] = _train(m, ws, 8)
    _same(res["ours"], res["torch"], "dataclass / NamedTuple / nested outputs")
    _same(res["ours_mp"], res["torch_mp"], "param_dtype cast of a dataclass input")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 6)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def _checkpoint_wrapper(ws):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    res = {}
    for name, fs in _libs().items():
        torch.manual_seed(0)
        m = nn.Sequential(*[checkpoint_wrapper(Block()) for _ in range(3)])
        for w in m:  # accelerate / the HF Trainer: the inner block, then its wrapper, then the root
            fs(w._checkpoint_wrapped_module)
            fs(w)
        fs(m)
        res[name] = _train(m, ws, 6)
    _same(res["ours"], res["torch"], "checkpoint_wrapper + fully_shard(inner) + fully_shard(wrapper)")


def _placements(ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.tensor import Shard

    # ShardPlacementResult and dp_mesh_dims are torch 2.13's (2.11 / 2.12 have neither)
    since_2_13 = hasattr(_fsdp_common, "ShardPlacementResult")
    mesh = init_device_mesh("cpu", (ws,))
    fns = {
        "dim1": lambda p: Shard(1) if p.ndim == 2 else None,
        "dim-1": lambda p: Shard(-1) if p.ndim == 2 else Shard(0),
    }
    if since_2_13:
        ShardPlacementResult = _fsdp_common.ShardPlacementResult
        info = _fsdp_common.FSDPMeshInfo(mesh, shard_mesh_dim=0)
        fns["result"] = lambda p: ShardPlacementResult(Shard(0), info)
    kw = {"dp_mesh_dims": None} if since_2_13 else {}
    res = {}
    for name, fs in _libs().items():
        for case, fn in fns.items():
            torch.manual_seed(0)
            m = nn.Sequential(Block(), Block())
            for b in m:
                fs(b, mesh=mesh, shard_placement_fn=fn, **kw)
            fs(m, mesh=mesh, **kw)
            res[name, case] = _train(m, ws, 6)
    for case in fns:
        _same(res["ours", case], res["torch", case], f"shard_placement_fn {case}")
    import raggedfsdp

    if since_2_13:
        sub = init_device_mesh("cpu", (ws,), mesh_dim_names=("other",))  # another mesh (same ranks)
        sub_info = _fsdp_common.FSDPMeshInfo(sub, shard_mesh_dim=0)
        with pytest.raises(NotImplementedError, match="per-parameter meshes"):
            raggedfsdp.fully_shard(
                Block(), mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(None, sub_info)
            )
    with pytest.raises(ValueError, match=r"Shard\(5\)"):
        raggedfsdp.fully_shard(Block(), shard_placement_fn=lambda p: Shard(5))


def _hooks_and_ctx(ws):
    from torch.distributed.fsdp import share_comm_ctx as torch_share

    import raggedfsdp

    share = {"torch": torch_share, "ours": raggedfsdp.share_comm_ctx}
    res = {}
    for name, fs in _libs().items():
        torch.manual_seed(0)
        m = nn.Sequential(Block(), Block())
        for b in m:
            fs(b)
        fs(m)
        m[0].set_all_reduce_hook(lambda t: t.mul_(0.5))  # halves block 0's gradients only
        res[name, "hook"] = _train(m, ws, 6)
        torch.manual_seed(0)
        stages = [Block(), Block()]  # two roots (pipeline stages) sharing one comm context
        for s in stages:
            fs(s)
        share[name](stages)
        stage_res = [_train(s, ws, 6) for s in stages]
        res[name, "share"] = (sum((r[0] for r in stage_res), []), sum((r[1] for r in stage_res), []))
    _same(res["ours", "hook"], res["torch", "hook"], "set_all_reduce_hook")
    _same(res["ours", "share"], res["torch", "share"], "share_comm_ctx")
    # the streams really are shared: fake stream objects at lazy init, before any forward
    import raggedfsdp.fsdp._comm as comm_mod

    real = comm_mod.new_stream
    comm_mod.new_stream = lambda device, priority=0: object()
    try:
        stages = [raggedfsdp.fully_shard(Block()), raggedfsdp.fully_shard(Block())]
        raggedfsdp.share_comm_ctx(stages)
        comms = []
        for s in stages:
            s._get_fsdp_state()._lazy_init()
            comms.append(s._get_fsdp_state().comm)
        assert comms[0] is not comms[1]
        assert comms[0].ag_stream is comms[1].ag_stream is not None
        assert comms[0].reduces.rs_stream is comms[1].reduces.rs_stream is not None
        assert comms[0].reduces.ar_stream is comms[1].reduces.ar_stream is not None
    finally:
        comm_mod.new_stream = real
    with pytest.raises(ValueError, match="share_comm_ctx"):
        raggedfsdp.share_comm_ctx([nn.Linear(2, 2)])


def _framework_code(ws):
    """What accelerate / the HF Trainer / torchtitan do: look the name up in torch at call time."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(Block(), Block())
    for b in m:
        fully_shard(b, dp_mesh_dims=None)
    fully_shard(m)
    assert all(isinstance(x, FSDPModule) for x in (m, m[0], m[1]))  # torch's class: the frameworks' check
    return m, _train(m, ws, 6)


def _patch(ws):
    import torch.distributed.fsdp as torch_fsdp

    import raggedfsdp
    from raggedfsdp.fsdp._fully_shard import _TORCH_FULLY_SHARD

    assert torch_fsdp.fully_shard is _TORCH_FULLY_SHARD
    with raggedfsdp.patch_torch():
        m, patched = _framework_code(ws)
        assert type(m).__module__ == "raggedfsdp.fsdp" and m._raggedfsdp_state is not None
        torch.manual_seed(0)  # torch's own fully_shard still works while patched
        t = nn.Sequential(Block(), Block())
        for b in t:
            _TORCH_FULLY_SHARD(b)
        _TORCH_FULLY_SHARD(t)
        assert type(t).__module__ != "raggedfsdp.fsdp"
        torch_while_patched = _train(t, ws, 6)
    assert torch_fsdp.fully_shard is _TORCH_FULLY_SHARD
    m, unpatched = _framework_code(ws)
    assert type(m).__module__ != "raggedfsdp.fsdp"  # torch's again
    torch.manual_seed(0)
    ours = nn.Sequential(Block(), Block())
    for b in ours:
        raggedfsdp.fully_shard(b)
    raggedfsdp.fully_shard(ours)
    _same(patched, _train(ours, ws, 6), "patched torch name == raggedfsdp.fully_shard")
    _same(torch_while_patched, unpatched, "torch's fully_shard while patched == unpatched")


def _ws3(rank, ws):
    _structures(ws)
    _checkpoint_wrapper(ws)
    _placements(ws)
    _hooks_and_ctx(ws)
    _patch(ws)


def test_api_dropin_ws3():
    run_distributed(_ws3, 3, timeout=600)


# ---- dp_mesh_dims (full-DTensor models, torchtitan's full_dtensor mode) -------------------------------


def _spmd_model(mesh, names, tp):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    for mod in (m[0], m[2]):
        for pn, p in list(mod.named_parameters(recurse=False)):
            pl = [Replicate()] * len(names)
            if tp:  # colwise then rowwise on the last ("tp") dim
                pl[-1] = Shard(0) if mod is m[0] else (Shard(1) if pn == "weight" else Replicate())
            mod.register_parameter(pn, nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))
    return m


def _spmd_train(fs, ws, shape, names, dims, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    m = _spmd_model(mesh, names, tp)
    for unit in (m[0], m[2], m):
        fs(unit, mesh=mesh, dp_mesh_dims=dims)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    data_pl = [Replicate() if n == "tp" else Shard(0) for n in names]
    losses = []
    for _ in range(3):
        x = distribute_tensor(torch.randn(4 * ws, 4, generator=gen), mesh, data_pl)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    return (losses, [p.full_tensor().detach().clone() for p in m.parameters()]), m


def _dp_mesh_dims(rank, ws):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims as D
    from torch.distributed.tensor import DTensor

    import raggedfsdp

    cases = [
        ((2,), ("dp",), D(shard="dp"), False),
        ((2, 1), ("dp", "tp"), D(shard="dp"), True),
        ((1, 2), ("dp", "tp"), D(shard="dp"), True),
        ((2, 1), ("r", "s"), D(shard="s", replicate="r"), False),
        ((1, 2), ("r", "s"), D(shard="s", replicate="r"), False),
        ((2, 1), ("s", "cp"), D(shard=("s", "cp")), False),
    ]
    for shape, names, dims, tp in cases:
        what = f"dp_mesh_dims={dims} on {shape} {names}"
        ref, _ = _spmd_train(_libs()["torch"], ws, shape, names, dims, tp)
        got, m = _spmd_train(raggedfsdp.fully_shard, ws, shape, names, dims, tp)
        _same(got, ref, what)
        p = next(m.parameters())
        assert isinstance(p, DTensor) and len(p.placements) == p.device_mesh.ndim, what
    # unsupported / misuse: clear errors naming the case
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("tp", "dp"))
    m = _spmd_model(mesh, ("tp", "dp"), False)
    with pytest.raises(NotImplementedError, match="DP dims first"):
        raggedfsdp.fully_shard(m, mesh=mesh, dp_mesh_dims=D(shard="dp"))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with pytest.raises(NotImplementedError, match="no shard dim"):
        raggedfsdp.fully_shard(_spmd_model(mesh, ("dp",), False), mesh=mesh, dp_mesh_dims=D(replicate="dp"))
    with pytest.raises(ValueError, match="must be DTensors"):
        raggedfsdp.fully_shard(nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=D(shard="dp"))
    with pytest.raises(ValueError, match="not found in mesh"):
        raggedfsdp.fully_shard(_spmd_model(mesh, ("dp",), False), mesh=mesh, dp_mesh_dims=D(shard="x"))
    with pytest.raises(NotImplementedError, match="reshard_after_forward as int"):
        raggedfsdp.fully_shard(
            _spmd_model(mesh, ("dp",), False), mesh=mesh, dp_mesh_dims=D(shard="dp"), reshard_after_forward=2
        )
    dist.barrier()


@pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"), reason="dp_mesh_dims is torch >= 2.13's"
)
def test_dp_mesh_dims_vs_torch():
    run_distributed(_dp_mesh_dims, 2, timeout=600)


def _int_reshard_hsdp(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    res = {}
    for name, fs in _libs().items():
        for shape in ((1, 4), (2, 2)):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("r", "s"))
            k = 2 if shape == (1, 4) else 1  # a non-trivial divisor of shard size 4; k=1 means False
            torch.manual_seed(0)
            m = nn.Sequential(Block(), Block(), Block())
            for b in m:
                fs(b, mesh=mesh, reshard_after_forward=k)
            fs(m, mesh=mesh)
            res[name, shape] = _train(m, ws, 6)
    for shape in ((1, 4), (2, 2)):
        _same(res["ours", shape], res["torch", shape], f"int reshard_after_forward on HSDP {shape}")


def test_int_reshard_after_forward_on_2d_mesh():
    run_distributed(_int_reshard_hsdp, 4, timeout=600)
