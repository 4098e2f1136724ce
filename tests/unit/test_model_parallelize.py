"""``apply_fsdp`` / ``make_mp_policy`` on a 1-rank gloo group in this process (multi-rank: tests/e2e)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from raggedfsdp.app.models import apply_fsdp, build_model, make_mp_policy

BACKENDS = [
    "torch",
    "ragged",
]


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def test_mp_policy_and_errors():
    pol = make_mp_policy("torch", param_dtype="bf16", reduce_dtype="fp32")
    assert pol.param_dtype == torch.bfloat16 and pol.reduce_dtype == torch.float32
    assert make_mp_policy("torch").param_dtype is None
    with pytest.raises(ValueError, match="unknown dtype 'fp16'"):
        make_mp_policy("torch", param_dtype="fp16")
    with pytest.raises(ValueError, match="unknown FSDP backend 'ddp'"):
        make_mp_policy("ddp")


def test_apply_fsdp_needs_layers(mesh):
    with pytest.raises(ValueError, match="model.layers to be an nn.ModuleList"):
        apply_fsdp(nn.Linear(2, 2), mesh, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_model_matches_plain_model(mesh, backend):
    torch.manual_seed(0)
    ref = build_model("llama", "debug")
    ref.init_weights(seed=0)
    model = build_model("llama", "debug")
    model.init_weights(seed=0)
    apply_fsdp(model, mesh, backend=backend)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    tokens = torch.randint(0, 256, (2, 16))
    ref_loss = ref(tokens).logsumexp(-1).mean()
    loss = model(tokens).logsumexp(-1).mean()
    torch.testing.assert_close(loss, ref_loss)
    ref_loss.backward()
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_init_then_shard_matches_eager(mesh, backend):
    eager = build_model("llama", "debug")
    eager.init_weights(seed=0)
    with torch.device("meta"):
        model = build_model("llama", "debug")
    apply_fsdp(model, mesh, backend=backend)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(_full(p), q), name
