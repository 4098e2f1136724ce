"""The gradient reduce-scatter that NCCL runs is the one these CPU ranks run: one
``reduce_scatter_single`` per FSDP unit and backward (``c10d._reduce_scatter_base_``), with the op and
divide factor chosen by the same code on every backend (``raggedfsdp/fsdp/_reduce.py: launch_reduce``),
never an all-reduce in its place.

World sizes 3 and 5 on ``ToyLM`` (every parameter has an empty piece on some rank at 5, some at 3),
one backward per configuration, the sharded gradients gathered and compared with a float64
single-process oracle on the global batch (and with torch's ``fully_shard`` where it has the same
setting). Gradients after one backward, not losses after AdamW steps: AdamW is nearly scale-invariant,
so a reduce-scatter that doubles its output would pass a loss check. Configurations:

* fp32, default divide (``AVG`` in the collective, written straight into the sharded grads);
* ``set_gradient_divide_factor(2 * ws)`` (``SUM`` in the collective, then one division);
* two backwards without ``zero_grad`` (the second is added to the first: the installed, not direct,
  path);
* ``param_dtype=bf16, reduce_dtype=fp32`` (a fused cast into the reduce-scatter input) and
  ``param_dtype=bf16`` with ``reduce_dtype`` left unset (a bf16 reduce-scatter on torch <= 2.14).

Each backward must issue exactly one ``_reduce_scatter_base_`` per unit, and no all-reduce larger than
the used-parameter flags (``tests/_collectives.py`` counts the c10d ops).
"""

from __future__ import annotations

import pytest
import torch

from _collectives import CollectiveLog
from _spawns import SPAWNS
from _toy_models import ToyLM, batches, lm_loss, shard_model


def _oracle_grads(init, tok, tgt) -> dict[str, torch.Tensor]:
    ref = ToyLM()
    ref.load_state_dict(init)
    ref = ref.double()
    lm_loss(ref, tok, tgt).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}


def _rel_errors(got, ref) -> dict[str, float]:
    return {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref}


def _backward(model, tok_l, tgt_l, n_units, what):
    """One backward under the collective log; check it issued one reduce-scatter per unit."""
    with CollectiveLog() as log:
        lm_loss(model, tok_l, tgt_l).backward()
    rs = log.count("reduce_scatter_base")
    assert rs == n_units, f"{what}: {rs} reduce-scatters for {n_units} FSDP units ({log.calls})"
    smallest_rs = min(log.sizes("reduce_scatter_base"))
    big_ar = [s for s in log.sizes("allreduce") if s >= smallest_rs]
    assert not big_ar, f"{what}: all-reduces as large as a unit's reduce-scatter: {big_ar} ({log.calls})"


def _cases(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp
    from raggedfsdp.fsdp import fsdp_units

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    init = ToyLM().state_dict()
    per = 2
    tok, tgt = batches(1, per * ws)[0]
    tok_l, tgt_l = tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]
    oracle = _oracle_grads(init, tok, tgt)  # grads of the global mean loss = mean of the ranks' means

    def build(fs, **kw):
        model = ToyLM()
        model.load_state_dict(init)
        return shard_model(model, fs, mesh, **kw)

    bf16_mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    configs = [  # name, mp kwargs for (ours, torch's) or None, divide factor, backwards, oracle scale
        ("fp32 AVG", {}, {}, None, 1, 1.0),
        ("fp32 SUM + divide", {}, None, 2.0 * ws, 1, 0.5),
        ("fp32 accumulated", {}, {}, None, 2, 2.0),
        ("bf16 params, fp32 reduce", bf16_mp, bf16_mp, None, 1, 1.0),
        (
            "bf16 params and reduce",
            dict(param_dtype=torch.bfloat16),
            dict(param_dtype=torch.bfloat16),
            None,
            1,
            1.0,
        ),
    ]
    for name, mp, torch_mp, factor, n_backward, scale in configs:
        model = build(raggedfsdp.fully_shard, mp_policy=raggedfsdp.MixedPrecisionPolicy(**mp))
        pieces = [p.placements[-1].local_units for p in model.parameters()]
        assert any(0 in lu for lu in pieces), f"{name}: expected an empty piece on some rank: {pieces}"
        n_units = len(fsdp_units(model))
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        for _ in range(n_backward):
            _backward(model, tok_l, tgt_l, n_units, name)
        want = {n: scale * g for n, g in oracle.items()}
        errs = _rel_errors(_full_grads(model), want)
        if torch_mp is None:  # no torch counterpart: the oracle alone, at fp32 round-off
            bound = dict.fromkeys(errs, 1e-5)
        else:
            tmodel = build(torch_fully_shard, mp_policy=TorchMP(**torch_mp))
            for _ in range(n_backward):
                lm_loss(tmodel, tok_l, tgt_l).backward()
            terrs = _rel_errors(_full_grads(tmodel), want)
            tol = 1e-5 if not mp else 3e-2  # bf16 round-off of the same computation: ~1e-2 here
            assert max(terrs.values()) < tol, f"{name}: reference check, torch's grads vs the oracle {terrs}"
            bound = {n: max(tol, 2 * terrs[n]) for n in errs}
        bad = {n: e for n, e in errs.items() if e > bound[n]}
        assert not bad, f"{name} at ws {ws}: grad rel. errors vs the float64 oracle above bound: {bad}"


@pytest.mark.parametrize("ws", [3, 5])
def test_reduce_scatter_path_matches_float64_oracle(ws):
    """One ``reduce_scatter_single`` per unit and backward, no grad-sized all-reduce; gathered gradients
    equal the float64 single-process oracle (and torch's ``fully_shard``) for AVG, SUM + divide,
    accumulation, and bf16 params with fp32 / bf16 reduce, empty pieces included."""
    SPAWNS.check(ws, "rs_path")
