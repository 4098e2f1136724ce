"""``estimate_memory`` against the lesson's arithmetic and against measured allocations.

Measured = the bytes of the distinct storages behind each rank's local parameter shards, gradient
shards and optimizer-state tensors after a real training step of the tiny models under
``raggedfsdp.fully_shard`` (and of the unsharded model for stage 0). The parameter shards live in
the unit's flat sharded ``DBuffer``, so their storage must equal the planner's shard size exactly
(padding included); gradients and AdamW moments are per-parameter (``zeros_like``), so they lie
between the unpadded local numel and the estimate.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed

from raggedfsdp.app.sizing.memory_estimate import RECIPES, estimate_memory, format_bytes, format_report


def test_lesson_figures_27b_on_64_ranks():
    est = estimate_memory(27e9, world_size=64)
    assert est.total_bytes == 432e9
    totals = [s.total for s in est.stages]
    # 16 B/param replicated; then 4 + 12/64, 2 + 14/64, 16/64 bytes/param.
    assert totals == [432e9, 27e9 * (4 + 12 / 64), 27e9 * (2 + 14 / 64), 27e9 * 16 / 64]
    assert [format_bytes(t) for t in totals] == ["432 GB", "113 GB", "59.9 GB", "6.75 GB"]
    text = format_report(est)
    for s in ("432 GB", "113 GB", "59.9 GB", "6.75 GB"):
        assert s in text


def test_recipes_hsdp_and_errors():
    assert {k: r.total for k, r in RECIPES.items()} == {
        "mixed": 16,
        "bf16": 8,
        "fp32": 16,
        "muon": 12,
        "adamw8bit": 2 + 2 + 4 + 2 + 8 / 1024,
        "shampoo": 2 + 2 + 4 + 8 + 16,
    }
    # HSDP: 4 replicas of 16 ranks shard like plain FSDP on 16 ranks.
    a = estimate_memory(27e9, world_size=64, replicate=4)
    b = estimate_memory(27e9, world_size=16)
    assert [s.total for s in a.stages] == [s.total for s in b.stages]
    assert estimate_memory(10, world_size=3).shard_numel == 4  # ceil(10 / 3)
    with pytest.raises(ValueError, match="replicate=5 must divide world_size=64"):
        estimate_memory(1e9, world_size=64, replicate=5)
    with pytest.raises(ValueError, match="unknown recipe 'adam'"):
        estimate_memory(1e9, world_size=8, recipe="adam")
    with pytest.raises(ValueError, match="whole number"):
        estimate_memory(1.5, world_size=8)
    with pytest.raises(ValueError, match="exactly one"):
        estimate_memory(world_size=8)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _measure_step(model) -> dict[str, int]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tok = torch.randint(0, model.cfg.vocab_size, (2, 17))
    loss = F.cross_entropy(model(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())
    loss.backward()
    opt.step()  # grads are kept (no zero_grad): the state between two steps plus the grads
    params = [_local(p) for p in model.parameters()]
    states = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(_local(p.grad) for p in model.parameters()),
        "optim": _storage_bytes(_local(t) for t in states),
        "local_numel": sum(p.numel() for p in params),
    }


CASES = [("llama", "debug", "layer"), ("hybrid", "debug", "layer"), ("hybrid", "debug", "superblock")]


def _zero3_measured(rank, ws):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.app.models import apply_fsdp, build_model
    from raggedfsdp.app.sizing.registry import model_units

    mesh = init_device_mesh("cpu", (ws,))
    for name, flavor, unit in CASES:
        torch.manual_seed(0)
        model = build_model(name, flavor)
        model.init_weights(0)
        apply_fsdp(model, mesh, backend="ragged", unit=unit)
        got = _measure_step(model)
        est = estimate_memory(units=model_units(name, flavor, unit), world_size=ws, recipe="fp32")
        z3 = est.stage(3)
        where = f"{name}/{flavor} unit={unit} ws={ws} rank={rank}: measured {got}, estimate {z3}"
        # The flat sharded buffers: exactly the planner's shard size (fp32: 4 B/element).
        assert got["params"] == z3.params, where
        pad_bytes = 4 * (est.shard_numel - got["local_numel"])
        assert 0 <= pad_bytes, where
        assert z3.grads - pad_bytes <= got["grads"] <= z3.grads, where
        assert z3.optim - 2 * pad_bytes <= got["optim"] <= z3.optim, where
        # Summed over ranks, the unpadded pieces are the whole model exactly once.
        n = torch.tensor([got["local_numel"]])
        dist.all_reduce(n)
        assert n.item() == est.num_params, where


def test_estimate_matches_measured_zero3_allocations():
    run_distributed(_zero3_measured, 3)


def test_estimate_matches_measured_unsharded_allocations():
    from raggedfsdp.app.models import build_model
    from raggedfsdp.app.sizing.registry import model_units

    for name, flavor, _ in CASES[:2]:
        torch.manual_seed(0)
        model = build_model(name, flavor)
        model.init_weights(0)
        got = _measure_step(model)
        est = estimate_memory(units=model_units(name, flavor), world_size=1, recipe="fp32")
        z0 = est.stage(0)
        assert (got["params"], got["grads"], got["optim"]) == (z0.params, z0.grads, z0.optim), name
        assert est.num_params == model.cfg.num_params()


def test_cli(capsys):
    import json

    from raggedfsdp.app.cli import main

    assert main(["estimate-memory", "--params", "27e9", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "432 GB" in out and "113 GB" in out and "59.9 GB" in out and "6.75 GB" in out
    assert (
        main(["estimate-memory", "--model", "hybrid:debug", "--unit", "superblock", "-m", "3,5", "--json"])
        == 0
    )
    recs = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in recs] == [3, 5] and all(r["shapes_known"] for r in recs)
    assert main(["estimate-memory", "--params", "1e9", "--world-size", "6", "--replicate", "4"]) == 2
    assert "replicate=4 must divide world_size=6" in capsys.readouterr().err
    assert main(["estimate-memory", "--model", "llama:debug", "--unit", "superblock", "-m", "2"]) == 2
    assert "needs a hybrid model" in capsys.readouterr().err
