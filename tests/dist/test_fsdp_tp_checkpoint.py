"""DCP checkpoints of FSDP x TP across layouts (Note [FSDP x TP]): model + AdamW state saved at dp2 x tp2
(each
rank writes its own RaggedShard pieces of its TP-local block), loaded at dp4 x tp1, dp1 x tp2 and into the
single-process model, where training continues with the losses of the uninterrupted dp2 x tp2 run; torch
FSDP2 + TP checkpoints load into ours and ours into torch's, both continuing like the run that saved them."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from _cases import case_tmpdir
from _spawns import CHECKPOINTS  # one spawn per world size for the 4 checkpoint tests
from test_fsdp_tp import B, _batches, _loss, _model

BEFORE, AFTER = 2, 2


def _build(dp, tp, backend):
    """The Llama on a (dp, tp) mesh: TP plan over tp (if > 1), fully_shard over dp (if > 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.app.models import apply_fsdp, apply_tp

    m = _model()
    if dp * tp == 1:
        return m, None
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        apply_tp(m, mesh["tp"])
    apply_fsdp(m, mesh["dp"], backend=backend)
    return m, mesh


def _steps(model, mesh, batches):
    opt = model._opt
    dp = mesh["dp"].size() if mesh is not None else 1
    r = mesh["dp"].get_local_rank() if mesh is not None else 0
    rows = slice(r * B // dp, (r + 1) * B // dp)
    out = []
    for tok in batches:
        loss = _loss(model, tok[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(t, group=mesh["dp"].get_group())
        out.append(t.item() / dp)
    return out


def _make(dp, tp, backend):
    m, mesh = _build(dp, tp, backend)
    m._opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, mesh


def _sd(m):
    return {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, m._opt)}


def _load(m, path):
    sd = _sd(m)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(m, sd["model"])
    set_optimizer_state_dict(m, m._opt, sd["optim"])


def _save_2x2(rank, ws, tmp):
    from raggedfsdp import RaggedShard

    data = _batches(BEFORE + AFTER)
    res = {}
    for backend in ("ragged", "torch"):
        m, mesh = _make(2, 2, backend)
        _steps(m, mesh, data[:BEFORE])
        sd = _sd(m)
        if backend == "ragged":  # the optimizer state is a 2-D DTensor laid out like its parameter
            st = sd["optim"]["state"]["layers.0.attention.wo.weight"]["exp_avg"]
            assert isinstance(st.placements[0], RaggedShard) and st.placements[1].is_shard(1), st.placements
        dcp.save(sd, checkpoint_id=os.path.join(tmp, backend))
        res[backend] = _steps(m, mesh, data[BEFORE:])
    # load both ways at dp2 x tp2 (torch's checkpoint into ours, ours into torch's)
    for into, frm in (("ragged", "torch"), ("torch", "ragged")):
        m, mesh = _make(2, 2, into)
        _load(m, os.path.join(tmp, frm))
        res[f"{frm}->{into}"] = _steps(m, mesh, data[BEFORE:])
    # ours at dp4 x tp1 (plain FSDP over 4 ranks)
    m, mesh = _make(4, 1, "ragged")
    _load(m, os.path.join(tmp, "ragged"))
    res["dp4"] = _steps(m, mesh, data[BEFORE:])
    if rank == 0:
        with open(os.path.join(tmp, "res4.json"), "w") as f:
            json.dump(res, f)


def _load_at(rank, ws, tmp, dp, tp, name):
    m, mesh = _make(dp, tp, "ragged")
    _load(m, os.path.join(tmp, "ragged"))
    out = _steps(m, mesh, _batches(BEFORE + AFTER)[BEFORE:])
    if rank == 0:
        with open(os.path.join(tmp, f"{name}.json"), "w") as f:
            json.dump(out, f)


def _save_shared(rank, ws):
    _save_2x2(rank, ws, case_tmpdir("tp"))


def _load_shared(rank, ws, dp, tp, name):
    _load_at(rank, ws, case_tmpdir("tp"), dp, tp, name)


def test_tp_checkpoint_across_layouts():
    tmp = CHECKPOINTS.scratch("tp")
    CHECKPOINTS.check(4, "tp_save")
    CHECKPOINTS.check(2, "tp_load", 1, 2, "dp1tp2")
    CHECKPOINTS.check(1, "tp_load", 1, 1, "single")
    with open(os.path.join(tmp, "res4.json")) as f:
        res = json.load(f)
    for name in ("dp1tp2", "single"):
        with open(os.path.join(tmp, f"{name}.json")) as f:
            res[name] = json.load(f)
    want = res["ragged"]
    torch.testing.assert_close(res["torch"], want, rtol=1e-5, atol=0)
    for k in ("torch->ragged", "ragged->torch", "dp4", "dp1tp2", "single"):
        torch.testing.assert_close(res[k], want, rtol=1e-5, atol=0, msg=k)
