"""DCP checkpoints of an expert-parallel MoE across layouts, 4 real gloo ranks.

Saved at dp 2 x ep 2 (``apply_ep`` + ``apply_fsdp(experts_mesh=)``, expert stacks ``(RaggedShard, Shard(0))``
after 2 AdamW steps) with ``torch.distributed.checkpoint``; loaded into dp 4 x ep 1 (plain
``fully_shard`` over 4, every rank all experts' shards), dp 1 x ep 4 (one expert pair per rank) and a
single-process model (plain tensors, every rank reads all): the full parameters equal the saved ones
exactly, and every layout's logits on the same tokens equal the saved model's (fp32, rel 1e-5). Then the
HF export of that EP-trained checkpoint (``read_dcp_model`` + ``write_moe_safetensors``, what
``raggedfsdp convert --to safetensors`` runs) loaded by transformers' ``MixtralForCausalLM`` gives the
same logits.
"""

from __future__ import annotations

import pytest
import torch
from _spawns import SLOW  # the slow 4-rank cases share one spawn (tests/dist/_spawns.py)
from _toy_models import full_params


def _build():
    from raggedfsdp.app.models import build_model

    m = build_model("moe", "debug", experts="fused", n_experts=8, top_k=2, n_shared_experts=0)  # Mixtral
    m.init_weights(3)
    return m


def _sharded(dp, ep):
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.app.models import apply_ep, apply_fsdp

    model = _build()
    if ep == 1:
        return apply_fsdp(model, init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",)))
    world = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    apply_ep(model, world["ep"])
    return apply_fsdp(model, world["dp", "ep"]._flatten(f"dp_ep_{dp}x{ep}"), experts_mesh=world["dp"])


def _ckpt(rank, ws, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    tok = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))  # the same on every rank
    model = _sharded(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(10 + 4 * s + rank))
        logits = model(x[:, :-1])
        (F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()) + model.aux_loss).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        want_logits = model(tok)
    want = full_params(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    dist.barrier()

    for dp, ep in ((4, 1), (1, 4), (None, None)):
        tag = "single process" if dp is None else f"dp{dp}xep{ep}"
        m = _build() if dp is None else _sharded(dp, ep)
        for p in m.parameters():  # the load must replace every value
            (p.to_local() if hasattr(p, "to_local") else p).data.zero_()
        sd = get_model_state_dict(m)
        dcp.load({"model": sd}, checkpoint_id=path)
        set_model_state_dict(m, sd)
        got = full_params(m)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), f"{tag}: {k} differs after load"
        with torch.no_grad():
            torch.testing.assert_close(
                m(tok), want_logits, rtol=1e-5, atol=1e-6, msg=lambda s, t=tag: f"{t}: {s}"
            )

    if rank == 0:
        from transformers import MixtralForCausalLM

        from raggedfsdp.app.checkpoint.hf import read_dcp_model
        from raggedfsdp.app.checkpoint.hf_moe import write_moe_safetensors

        hf_dir = write_moe_safetensors(path + "-hf", read_dcp_model(path), _build().cfg)
        hf = MixtralForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(tok).logits, want_logits, rtol=1e-5, atol=1e-6)
    dist.barrier()


@pytest.mark.slow
def test_moe_ep_checkpoint_dp2xep2_to_dp4_ep4_and_single_process():
    SLOW.check(4, "moe_ep_ckpt")


def _ckpt_shared(rank, ws):
    import os

    from _cases import case_tmpdir

    _ckpt(rank, ws, os.path.join(case_tmpdir(), "ckpt"))
