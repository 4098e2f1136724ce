"""Hugging Face in and out: a DCP checkpoint saved by 3 sharded ranks converts (no process group)
to a safetensors folder that HF transformers' LlamaForCausalLM loads with logits equal to ours;
the same folder loads back into a model sharded over 3 ranks, piece by piece, bit-exactly."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _full_params(model):
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _roundtrip(rank, ws, tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.app.checkpoint.dcp import save_checkpoint
    from raggedfsdp.app.checkpoint.hf import load_hf_weights, read_dcp_model, write_safetensors
    from raggedfsdp.app.models import apply_fsdp, build_model

    mesh = init_device_mesh("cpu", (ws,))
    model = build_model("llama", "debug")
    model.init_weights(7)
    apply_fsdp(model, mesh)
    ref = _full_params(model)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(f"{tmp}/ckpt", 5, model=model, optimizer=opt, lr=0.1, seed=7, keep_latest=0, meta={})
    if rank == 0:  # the library path that `raggedfsdp convert` runs, here inside a process group
        write_safetensors(f"{tmp}/hf_inproc", read_dcp_model(f"{tmp}/ckpt/step-5"), model.cfg)
    dist.barrier()
    fresh = build_model("llama", "debug")
    fresh.init_weights(99)  # other weights: the load must overwrite every one
    apply_fsdp(fresh, mesh)
    load_hf_weights(fresh, f"{tmp}/hf_inproc")
    got = _full_params(fresh)
    for n, t in ref.items():
        assert torch.equal(got[n], t), n


@pytest.mark.slow
def test_dcp_to_hf_logits_and_back(tmp_path):
    from transformers import AutoModelForCausalLM

    from raggedfsdp.app.cli import main
    from raggedfsdp.app.models import build_model

    run_distributed(_roundtrip, 3, str(tmp_path))
    out = tmp_path / "hf"
    assert (
        main(
            [
                "convert",
                str(tmp_path / "ckpt"),
                "--to",
                "safetensors",
                str(out),
                "--model-config",
                "llama:debug",
            ]
        )
        == 0
    )
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours = build_model("llama", "debug")
    ours.init_weights(7)
    tok = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tok).logits, ours(tok), rtol=1e-5, atol=1e-5)
    assert main(["convert", str(tmp_path / "ckpt"), "--to", "torch", str(tmp_path / "m.pt")]) == 0
    sd = torch.load(tmp_path / "m.pt")
    for n, p in ours.named_parameters():
        assert torch.equal(sd[n], p.detach()), n


def test_tied_model_and_errors(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from raggedfsdp.app.checkpoint.hf import write_safetensors
    from raggedfsdp.app.cli import main
    from raggedfsdp.app.models import build_model

    ours = build_model("llama", "debug", tie_embeddings=True)
    ours.init_weights(1)
    write_safetensors(tmp_path / "tied", {n: p for n, p in ours.state_dict().items()}, ours.cfg)
    # the file follows the umask like config.json (safetensors alone writes 0600)
    import os
    import stat

    for name in ("model.safetensors", "config.json"):
        mode = stat.S_IMODE(os.stat(tmp_path / "tied" / name).st_mode)
        umask = os.umask(0)
        os.umask(umask)
        assert mode == 0o666 & ~umask, (name, oct(mode))
    # the README's `raggedfsdp train --model.init_from DIR` says it loaded them (one process, one step)
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "raggedfsdp.app.launch.worker", "--config", "debug",
                          "--model.tie_embeddings", "true", "--model.init_from", str(tmp_path / "tied"),
                          "--steps", "1", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"loaded the initial weights from {tmp_path / 'tied'}" in run.stderr, run.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tied")).eval()
    tok = torch.randint(0, 256, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(tok).logits, ours(tok), rtol=1e-5, atol=1e-5)
    assert main(["convert", str(tmp_path / "nope"), "--to", "torch", str(tmp_path / "x.pt")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
