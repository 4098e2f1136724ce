"""Training parity of raggedfsdp.fully_shard against (a) single-process unsharded training and
(b) torch's own fully_shard with the same settings, at world sizes 1-5 and on HSDP meshes.

One process group per world size runs every case of that size (``SPAWNS`` in tests/dist/_spawns.py,
shared with test_optim_parity and test_fsdp_requires_grad_change: spawning costs seconds per rank);
each test asserts that its own case passed in it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _collectives import CollectiveLog
from _spawns import SPAWNS
from _toy_models import ToyLM, batches, full_params, lm_loss, shard_model

STEPS = 4
LOCAL_BATCH = 2


def _train(model, opt, data, rank, ws, dp_rank=None, dp_size=None, microbatches=1, sync_fn=None):
    """Train on this rank's slice of each global batch; return per-step global mean losses."""
    dp_rank = rank if dp_rank is None else dp_rank
    dp_size = ws if dp_size is None else dp_size
    losses = []
    for tok, tgt in data:
        per = tok.shape[0] // dp_size
        tok_l, tgt_l = tok[dp_rank * per : (dp_rank + 1) * per], tgt[dp_rank * per : (dp_rank + 1) * per]
        mb = per // microbatches
        total = torch.zeros(())
        for i in range(microbatches):
            if sync_fn is not None:
                sync_fn(i == microbatches - 1)
            loss = lm_loss(model, tok_l[i * mb : (i + 1) * mb], tgt_l[i * mb : (i + 1) * mb]) / microbatches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(total)
            total /= dp_size
        losses.append(total.item())
    return losses


def _reference(data, foreach=True):
    torch.manual_seed(0)
    ref = ToyLM()
    init = copy.deepcopy(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=foreach)
    losses = []
    for tok, tgt in data:
        loss = lm_loss(ref, tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return init, losses, {n: p.detach() for n, p in ref.named_parameters()}


def _assert_close_losses(a, b, rtol, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * abs(y) + 1e-7, f"{what}: step {i} loss {x} != {y}"


def _fp32_parity(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp
    from raggedfsdp.fsdp import fsdp_units

    data = batches(STEPS, LOCAL_BATCH * ws)
    init, ref_losses, ref_params = _reference(data)
    mesh = init_device_mesh("cpu", (ws,))
    for foreach in (True, False):
        model = ToyLM()
        model.load_state_dict(init)
        shard_model(model, raggedfsdp.fully_shard, mesh)
        placements = [p.placements[-1] for p in model.parameters()]
        assert all(isinstance(pl, raggedfsdp.RaggedShard) for pl in placements)
        if ws >= 3:
            assert any(0 in pl.local_units for pl in placements), "expected an empty piece on some rank"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
        with CollectiveLog() as log:
            losses = _train(model, opt, data, rank, ws)
        # the gradients took the reduce-scatter NCCL runs: one per unit and step (ws 1: a local copy)
        n_rs = len(fsdp_units(model)) * STEPS if ws > 1 else 0
        assert log.count("reduce_scatter_base") == n_rs, (n_rs, log.calls)
        _assert_close_losses(losses, ref_losses, 1e-5, f"ragged vs single-process (foreach={foreach})")
        got = full_params(model)
        for n, p in ref_params.items():
            torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    # same settings under torch's own fully_shard
    tmodel = ToyLM()
    tmodel.load_state_dict(init)
    shard_model(tmodel, torch_fully_shard, mesh)
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-2)
    tlosses = _train(tmodel, topt, data, rank, ws)
    _assert_close_losses(losses, tlosses, 1e-5, "ragged vs torch fully_shard")


@pytest.mark.parametrize(
    "ws", [1, 2, pytest.param(3, marks=pytest.mark.core), 4, pytest.param(5, marks=pytest.mark.core)]
)
def test_fp32_parity_with_single_process_and_torch_fsdp(ws):
    """fp32: per-step losses (rel 1e-5) and gathered params equal single-process AdamW (foreach and
    for-loop) and torch's fully_shard; ws>=3 has empty pieces and non-divisible sizes. At ws > 1 every
    unit's gradients take one ``reduce_scatter_single`` per step (counted at the c10d op)."""
    SPAWNS.check(ws, "fp32")


def _full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
        for n, p in model.named_parameters()
    }


def _grad_rel_errors(got: dict, ref: dict) -> dict[str, float]:
    return {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)) for n in ref}


def _bf16_parity(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    data = batches(STEPS, LOCAL_BATCH * ws)
    torch.manual_seed(0)
    init = ToyLM().state_dict()
    mesh = init_device_mesh("cpu", (ws,))
    # gradients after one backward, against the single-process bf16 model on the global batch
    # (AdamW hides a gradient scale error: it is nearly scale-invariant, so losses alone cannot fail)
    tok, tgt = data[0]
    ref = ToyLM()
    ref.load_state_dict(init)
    ref = ref.to(torch.bfloat16)
    lm_loss(ref, tok, tgt).backward()
    ref_grads = {n: p.grad.float() for n, p in ref.named_parameters()}
    per = tok.shape[0] // ws
    tok_l, tgt_l = tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]
    results, grad_errs = [], {}
    for name, fs, mp in (
        (
            "ragged",
            raggedfsdp.fully_shard,
            raggedfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        ),
        ("torch", torch_fully_shard, TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ):
        model = ToyLM()
        model.load_state_dict(init)
        shard_model(model, fs, mesh, mp_policy=mp)
        lm_loss(model, tok_l, tgt_l).backward()
        grads = _full_grads(model)
        assert all(g.dtype == torch.float32 for g in grads.values())
        grad_errs[name] = _grad_rel_errors(grads, ref_grads)
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(
            model.parameters(), lr=0.5
        )  # plain SGD: a gradient scale error shows in the losses
        losses = _train(model, opt, data, rank, ws)
        results.append((losses, full_params(model)))
    # bf16 round-off of the same computation is ~1e-2 at most here; a 2x gradient error would be 1.0
    worst = {b: max(e.items(), key=lambda kv: kv[1]) for b, e in grad_errs.items()}
    assert worst["torch"][1] < 3e-2, f"reference check: torch's bf16 grads vs single-process {worst}"
    for n, e in grad_errs["ragged"].items():
        assert e <= max(3e-2, 2 * grad_errs["torch"][n]), f"{n}: bf16 grad rel. error {e:.2e} ({worst})"
    (l1, p1), (l2, p2) = results
    _assert_close_losses(l1, l2, 2e-3, "bf16 ragged vs torch fully_shard (SGD)")
    for n in p1:
        assert p1[n].dtype == torch.float32
        torch.testing.assert_close(p1[n], p2[n], rtol=2e-2, atol=2e-3, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.core), 5])
def test_bf16_param_fp32_reduce_matches_torch_fsdp(ws):
    """param_dtype=bf16, reduce_dtype=fp32: gradients after one backward match the single-process bf16
    model (and torch's fully_shard) to bf16 round-off, and 4 plain-SGD steps match torch's fully_shard."""
    SPAWNS.check(ws, "bf16")


def _hsdp_parity(rank, ws, shape):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    data = batches(STEPS, LOCAL_BATCH * ws)
    init, ref_losses, ref_params = _reference(data)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = ToyLM()
    model.load_state_dict(init)
    shard_model(model, raggedfsdp.fully_shard, mesh)
    for p in model.parameters():
        assert len(p.placements) == 2 and p.placements[0].is_replicate()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _train(model, opt, data, rank, ws)
    _assert_close_losses(losses, ref_losses, 1e-5, f"HSDP {shape} vs single-process")
    got = full_params(model)
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("shape", [(2, 2), (2, 1), (1, 2)])
def test_hsdp_parity(shape):
    """HSDP (replicate, shard) meshes: reduce-scatter on shard dim + all-reduce on replicate dim."""
    SPAWNS.check(shape[0] * shape[1], "hsdp", shape)


def _accum_parity(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    micro = 4
    data = batches(STEPS, LOCAL_BATCH * micro * ws)
    init, ref_losses, ref_params = _reference(data)
    mesh = init_device_mesh("cpu", (ws,))
    model = ToyLM()
    model.load_state_dict(init)
    shard_model(model, raggedfsdp.fully_shard, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _train(
        model,
        opt,
        data,
        rank,
        ws,
        microbatches=micro,
        sync_fn=lambda last: model.set_requires_gradient_sync(last),
    )
    _assert_close_losses(losses, ref_losses, 1e-5, "accumulation over 4 microbatches vs one big batch")
    got = full_params(model)
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("ws", [2, 3])
def test_grad_accumulation_no_sync_equals_big_batch(ws):
    """4 microbatches with gradient sync off for the first 3 equal one big batch."""
    SPAWNS.check(ws, "accum")


def _hsdp_deferred_all_reduce(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    micro = 2
    data = batches(STEPS, LOCAL_BATCH * micro * ws)
    init, ref_losses, ref_params = _reference(data)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = ToyLM()
    model.load_state_dict(init)
    shard_model(model, raggedfsdp.fully_shard, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    deferred = []

    def sync(last):
        if last:  # the previous microbatch kept its shard-reduced grads instead of all-reducing them
            deferred.append(model.layers[0]._raggedfsdp_state.group.grads.partial_reduce is not None)
        model.set_requires_all_reduce(last)

    losses = _train(model, opt, data, rank, ws, microbatches=micro, sync_fn=sync)
    assert deferred and all(deferred), deferred
    _assert_close_losses(losses, ref_losses, 1e-5, "HSDP with the replicate all-reduce deferred")
    got = full_params(model)
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    from test_fsdp_frozen import _frozen_cases

    _frozen_cases(rank, ws, mesh_shape=(2, 2))  # frozen params (compacted grad layout) under HSDP


def test_hsdp_set_requires_all_reduce_false_defers_the_all_reduce():
    """HSDP microbatches reduce-scatter only; the last one all-reduces the sum over replicas."""
    SPAWNS.check(4, "hsdp_deferred")


def _bf16_default_reduce(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    data = batches(STEPS, LOCAL_BATCH * ws)
    torch.manual_seed(0)
    init = ToyLM().state_dict()
    mesh = init_device_mesh("cpu", (ws,))
    tok, tgt = data[0]
    per = tok.shape[0] // ws
    tok_l, tgt_l = tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]
    # torch 2.15 (peers-2026-12 2.15-b): reduce_dtype=None reduces in the params' dtype (fp32), before in bf16
    want = (
        torch.float32
        if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 15)
        else torch.bfloat16
    )
    grads = {}
    for name, fs, mp in (
        ("ragged", raggedfsdp.fully_shard, raggedfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        ("torch", torch_fully_shard, TorchMP(param_dtype=torch.bfloat16)),
    ):
        model = ToyLM()
        model.load_state_dict(init)
        shard_model(model, fs, mesh, mp_policy=mp)
        if name == "ragged":
            groups = [
                m._raggedfsdp_state.group for m in model.modules() if getattr(m, "_raggedfsdp_state", None)
            ]
            assert groups and all(g.reduce_dtype == want for g in groups if g is not None)
        lm_loss(model, tok_l, tgt_l).backward()
        grads[name] = _full_grads(model)
    errs = _grad_rel_errors(grads["ragged"], grads["torch"])
    assert max(errs.values()) < 3e-2, errs


def test_bf16_param_default_reduce_dtype_matches_torch_fsdp():
    """reduce_dtype=None follows the installed torch: bf16 reduce on <= 2.14, fp32 (the params' dtype) on
    2.15."""
    SPAWNS.check(3, "bf16_default")
