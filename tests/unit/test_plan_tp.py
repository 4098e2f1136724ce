"""Planning with tensor parallelism (sizing/tp.py, ``plan`` / ``estimate-memory --tp``) against independent
references: the TP-local shapes and unit layouts that ``apply_tp`` + ``fully_shard`` really build on a fake
8-rank group (dp 4 x tp 2, and HSDP 2 x 2 x tp 2), LLaMA-3-70B's TP-local shapes written out by hand, and
FSDP2's ``Shard(0)`` padding by brute force."""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist

from raggedfsdp.app.sizing.archs import model_units
from raggedfsdp.app.sizing.tp import plan_model_tp, split_units_for_tp


@pytest.fixture
def fake_world16():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=11, world_size=16)
    yield
    dist.destroy_process_group()


def _units_of(model):
    """(world size, total numel, shard size, sorted (numel, block) pairs) of every FSDP unit ``fully_shard``
    built on ``model``."""
    groups = {}
    for m in model.modules():
        g = getattr(getattr(m, "_raggedfsdp_state", None), "group", None)
        if g is not None:
            groups[id(g)] = g
    return sorted(_sig(g.layout) for g in groups.values())


def _sig(lay):
    return lay.world_size, lay.total_numel, lay.shard_size, tuple(sorted(zip(lay.numels, lay.granularities)))


def test_tp_plan_matches_apply_tp_and_fully_shard(fake_world16):
    """HSDP 2 x dp_shard 4 x tp 2 on a fake 16-rank group; then a second root mesh (dp 8 x tp 2) in the same
    process, whose ``tp`` sub-mesh equals the first's: torch gives the second model's TP parameters the first
    root's mesh, and ``fully_shard`` must take its twin (``fsdp/_tp.py: _twin_submesh``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from raggedfsdp.app.models import Llama, LlamaConfig, apply_fsdp, apply_tp
    from raggedfsdp.app.sizing.memory_estimate import estimate_memory
    from raggedfsdp.app.sizing.registry import model_units as our_units

    names = ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=names)
    from raggedfsdp.app.models import build_model

    with pytest.raises(ValueError, match=r"apply_tp: layers \[0, 1\] of MoE are mixture-of-experts.*EP x TP"):
        apply_tp(build_model("moe", "debug"), mesh["tp"])
    model = apply_tp(Llama(LlamaConfig.flavor("debug")), mesh["tp"])
    local = {
        n: tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
        for n, p in model.named_parameters()
    }
    units = our_units("llama", "debug")
    tp_units = split_units_for_tp(units, 2)
    got = {(n if u.name == "root" else f"{u.name}.{n}"): s for u in tp_units for n, s in u.params}
    assert got == local  # the TP-local shapes are apply_tp's
    assert any(g != s for u in tp_units for g, (_, s) in zip(u.global_shapes, u.params))
    apply_fsdp(model, mesh["dp_replicate", "dp_shard"])
    m = 4
    plan = plan_model_tp(units, m * 2, 2, align=4, order="best")  # the dp_shard x tp ranks of one replica
    assert plan.world_size == m
    want = sorted(_sig(u.layout) for u in plan.units)
    assert _units_of(model) == want  # fully_shard plans the TP-local shapes (and blocks) as the planner does
    est = estimate_memory(units=units, world_size=16, tp=2, replicate=2, recipe="fp32")
    assert est.shard_world == m and est.shard_numel == sum(w[2] for w in want)
    assert est.stage(3).params == 4 * est.shard_numel  # fp32 shards
    assert est.stage(0).params == 4 * sum(math.prod(s) for s in local.values())  # one TP rank's replica
    assert est.num_params == sum(u.numel for u in units)
    held = sum(m * w[2] for w in want) * 2  # every TP rank's shards over one FSDP group
    assert est.padding_numel == held - sum(math.prod(s) for s in local.values()) * 2

    other = init_device_mesh("cpu", (8, 2), mesh_dim_names=("dp", "tp"))
    model2 = apply_fsdp(apply_tp(Llama(LlamaConfig.flavor("debug")), other["tp"]), other["dp"])
    w = model2.layers[0].attention.wo.weight
    assert w.device_mesh.mesh_dim_names == ("dp", "tp") and w.device_mesh.mesh.shape == (8, 2), w.device_mesh
    want8 = sorted(_sig(u.layout) for u in plan_model_tp(units, 16, 2, align=4, order="best").units)
    assert _units_of(model2) == want8
    third = init_device_mesh("cpu", (8, 2), mesh_dim_names=("data", "model"))  # no twin in other's root
    with pytest.raises(ValueError, match="not derived from the same root mesh"):
        apply_fsdp(apply_tp(Llama(LlamaConfig.flavor("debug")), third["model"]), other["dp"])


def test_llama3_70b_tp8_shapes_by_hand_and_fsdp2_brute_force():
    units = model_units("llama3-70b")
    tp_units = split_units_for_tp(units, 8)
    H, F, KV, V = 8192, 28672, 8 * 128, 128256
    layer = {
        "self_attn.q_proj.weight": (H // 8, H),
        "self_attn.k_proj.weight": (KV // 8, H),
        "self_attn.v_proj.weight": (KV // 8, H),
        "self_attn.o_proj.weight": (H, H // 8),
        "mlp.gate_proj.weight": (F // 8, H),
        "mlp.up_proj.weight": (F // 8, H),
        "mlp.down_proj.weight": (H, F // 8),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }
    assert dict(tp_units[1].params) == {f"model.layers.0.{k}": v for k, v in layer.items()}
    assert dict(tp_units[0].params) == {"model.embed_tokens.weight": (V // 8, H)}
    assert dict(tp_units[-1].params) == {"model.norm.weight": (H,), "lm_head.weight": (V // 8, H)}
    plan = plan_model_tp(units, 1024, 8, align=8)
    assert plan.world_size == 128
    for u, pu in zip(tp_units, plan.units):
        shapes = [s for _, s in u.params]
        f2 = sum(-(-s[0] // 128) * 128 * math.prod(s[1:]) - math.prod(s) for s in shapes)  # brute force
        assert pu.fsdp2_padding == f2
        assert pu.layout.total_numel == sum(math.prod(s) for s in shapes)
        assert 128 * pu.layout.shard_size >= pu.layout.total_numel
    from raggedfsdp.app.sizing.memory_estimate import estimate_memory

    est = estimate_memory(units=units, world_size=1024, tp=8, replicate=2)
    assert est.shard_world == 64 and est.num_params == sum(u.numel for u in units)
    assert est.shard_numel == sum(
        u.layout.shard_size for u in plan_model_tp(units, 512, 8, align=8, order="best").units
    )


def test_plan_and_estimate_cli_tp(capsys):
    from raggedfsdp.app.cli import main as top_main

    assert top_main(["plan", "--model", "llama3-70b", "-m", "1024", "--tp", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    plan = plan_model_tp(model_units("llama3-70b"), 1024, 8, align=8)
    assert (d["tp"], d["fsdp_group"], d["world_size"]) == (8, 128, 128)
    assert [u["shard_size"] for u in d["units"]] == [u.layout.shard_size for u in plan.units]
    assert top_main(["plan", "--model", "llama3-70b", "-m", "1024", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "TP 8: world 1024 = 128 x 8" in out and "M=128" in out and "largest all-gather per TP rank" in out
    assert (
        top_main(["estimate-memory", "--model", "llama3-70b", "-m", "1024", "--tp", "8", "--replicate", "2"])
        == 0
    )
    assert "TP 8 (TP-local shapes sharded over FSDP groups of 64 ranks)" in capsys.readouterr().out
    for cmd, argv, match in (
        (
            "plan",
            ["--model", "llama3-70b", "-m", "1000", "--tp", "16"],
            "--tp 16 x --replicate 1 must divide",
        ),
        ("plan", ["--model", "gpt-oss-120b", "-m", "256", "--tp", "8"], "no tensor-parallel rule"),
        (
            "plan",
            ["--model", "gpt-oss-120b", "-m", "256", "--tp", "2", "--ep", "8"],
            "EP x TP is not supported",
        ),
        (
            "plan",
            ["--model", "llama3-70b", "-m", "1024", "--tp", "8", "--granularity", "rows:32"],
            "cut by the tensor-parallel split of dim 1",
        ),
        ("plan", ["--model", "llama3-70b", "-m", "1024", "--tp", "8", "--unit", "auto"], "--unit auto"),
        ("plan", ["--model", "llama3-70b", "-m", "1024", "--tp", "0"], "int >= 1"),
        (
            "estimate-memory",
            ["--model", "llama3-70b", "-m", "1024", "--tp", "3"],
            "must divide --world-size 1024",
        ),
        (
            "estimate-memory",
            ["--model", "llama3-70b", "-m", "1024", "--tp", "8", "--replicate", "256"],
            "must divide --world-size 1024",
        ),
        ("estimate-memory", ["--model", "gpt-oss-120b", "-m", "256", "--tp", "2", "--ep", "8"], "EP x TP"),
        ("estimate-memory", ["--params", "1e9", "-m", "8", "--tp", "2"], "needs units"),
        (
            "estimate-memory",
            ["--model", "llama3-70b", "-m", "1024", "--tp", "8", "--granularity", "rows:32"],
            "--granularity rows:32",
        ),
    ):
        assert top_main([cmd, *argv]) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and f"raggedfsdp {cmd}: error: " in err[0] and match in err[0], err
        assert "--tp" in err[0] or "--granularity" in err[0], err
