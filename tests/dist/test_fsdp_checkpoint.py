"""DCP checkpoints of a fully_shard'ed model and its AdamW state: saved at 4 ranks (each rank writes
only its own RaggedShard pieces) with row blocks (``Shard(0)``, the default layout before issue 22),
loaded at 3 ranks and at 1 rank with today's default (element granularity: another layout), and
training resumes exactly as an uninterrupted single-process run."""

from __future__ import annotations

import copy

import pytest
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
from _toy_models import ToyLM, batches, full_params, lm_loss, shard_model

STEPS_BEFORE, STEPS_AFTER = 2, 2


def _step(model, opt, tok, tgt, rank, ws):
    per = tok.shape[0] // ws
    loss = lm_loss(model, tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per])
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    if ws > 1:
        dist.all_reduce(loss)
        loss /= ws
    return loss.item()


def _make(ws, rank, rows=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import raggedfsdp

    torch.manual_seed(0)
    model = ToyLM()
    kw = {"shard_placement_fn": lambda p: Shard(0)} if rows else {}
    shard_model(model, raggedfsdp.fully_shard, init_device_mesh("cpu", (ws,)), **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _dims(model):
    return {n: p.placements[-1].dims for n, p in model.named_parameters() if p.ndim == 2}


def _save(rank, ws, path):
    model, opt = _make(ws, rank, rows=True)
    assert set(_dims(model).values()) == {(0,)}, _dims(model)  # whole rows: the old default layout
    data = batches(STEPS_BEFORE, 12)
    for tok, tgt in data:
        _step(model, opt, tok, tgt, rank, ws)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    from raggedfsdp import RaggedShard

    assert any(isinstance(v.placements[-1], RaggedShard) for v in sd["model"].values())
    dcp.save(sd, checkpoint_id=path)


def _load_and_resume(rank, ws, path, expected_losses, expected_params):
    model, opt = _make(ws, rank)  # a fresh init: everything must come from the checkpoint
    assert set(_dims(model).values()) == {(0, 1)}, _dims(model)  # the default: element granularity
    # materialize optimizer state so that it can be loaded into
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    data = batches(STEPS_BEFORE + STEPS_AFTER, 12)[STEPS_BEFORE:]
    losses = [_step(model, opt, tok, tgt, rank, ws) for tok, tgt in data]
    for i, (a, b) in enumerate(zip(losses, expected_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"resumed at ws={ws}: step {i} loss {a} != uninterrupted {b}"
    got = full_params(model)
    for n, p in expected_params.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def _reference():
    torch.manual_seed(0)
    ref = ToyLM()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = [_step(ref, opt, tok, tgt, 0, 1) for tok, tgt in batches(STEPS_BEFORE + STEPS_AFTER, 12)]
    return losses[STEPS_BEFORE:], {n: p.detach().clone() for n, p in ref.named_parameters()}


def _save_shared(rank, ws):
    _save(rank, ws, case_tmpdir("fsdp"))


def _load_shared(rank, ws):
    _load_and_resume(rank, ws, case_tmpdir("fsdp"), *_reference())  # the reference: single-process, per rank


@pytest.mark.core
def test_dcp_save_at_4_resume_at_3_and_1():
    CHECKPOINTS.check(4, "fsdp_save")
    CHECKPOINTS.check(3, "fsdp_load")
    CHECKPOINTS.check(1, "fsdp_load")
    _ = copy


def _torch_save_case(rank, ws):
    """``torch.save(model.state_dict())`` per rank, as with torch's ``fully_shard``: a RaggedShard
    piece is a view at a storage offset into the unit's flat shard, and pickling such a DTensor raised
    "Attempted to access the data pointer on an invalid python storage". The saved shards load into a
    fresh model (its full parameters equal), train on exactly like the original, and the state dict
    stays views of the live shards (no copy)."""
    import io

    from torch.distributed.device_mesh import init_device_mesh

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    tok, tgt = batches(2, 2 * ws)[0]
    ref = ToyLM()
    shard_model(ref, torch_fully_shard, init_device_mesh("cpu", (ws,)))  # torch's: the same API call works
    torch.save(ref.state_dict(), io.BytesIO())
    model, opt = _make(ws, rank)
    _step(model, opt, tok, tgt, rank, ws)
    sd = model.state_dict()
    live = {n: p._local_tensor.data_ptr() for n, p in model.named_parameters()}
    assert all(sd[n]._local_tensor.data_ptr() == live[n] for n in live), "the state dict copied the shards"
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    other, opt2 = _make(ws, rank)
    other.load_state_dict(torch.load(buf, weights_only=False))
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # else both share the moment tensors
    assert all(torch.equal(a, b) for a, b in zip(full_params(model).values(), full_params(other).values()))
    _step(model, opt, tok, tgt, rank, ws)
    _step(other, opt2, tok, tgt, rank, ws)
    assert all(torch.equal(a, b) for a, b in zip(full_params(model).values(), full_params(other).values()))


def test_torch_save_of_the_sharded_state_dict():
    from _spawns import SPAWNS

    SPAWNS.check(3, "torch_save")
