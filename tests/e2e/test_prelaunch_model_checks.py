"""Refusals that came only after a ~40 s launch now come before it, one line each with the cause
first: ``--model.init_from`` a folder that is missing (two tracebacks, then the line; an empty run
folder left) or holds no safetensors; resuming a checkpoint of another model (a 1,786-character line
whose cause came last, suggesting ``--checkpoint.allow_partial true``, which cannot help when every
shape differs); resuming with another ``--optim`` (a rank's list of every missing state key).
In-process ``raggedfsdp train``: it returns before starting torchrun. The checkpoint is a real
``save_checkpoint`` of the debug LLaMA at one gloo rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_distributed

from raggedfsdp.app.cli import main as cli_main

ARGS = ["--nproc", "2", "--model", "debug", "--steps", "4", "--batch-size", "4", "--seq-len", "32",
        "--data.max_bytes", "200000"]  # fmt: skip


def _train(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = cli_main(["train", *ARGS, *argv])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.core
@pytest.mark.parametrize("kind", ["missing", "a_file", "empty"])
def test_init_from_without_safetensors_is_refused_before_the_launch(tmp_path, capsys, kind):
    src = tmp_path / "hf"
    if kind == "a_file":
        src.write_text("x")
    elif kind == "empty":
        src.mkdir()
        (src / "config.json").write_text("{}")
    out = tmp_path / "out"
    rc, err = _train(capsys, "--model.init_from", str(src), "--out", str(out))
    why = {
        "missing": "not found",
        "a_file": "is a file, not a folder",
        "empty": "holds no *.safetensors file",
    }
    assert rc == 2 and err == [
        f"raggedfsdp train: error: --model.init_from {src}: {why[kind]} (expected a Hugging Face safetensors "
        "folder, e.g. one written by raggedfsdp convert --to safetensors)"
    ], err
    assert not out.exists()  # no run folder left behind


def _save(rank, ws, folder):
    from raggedfsdp.app.checkpoint.dcp import save_checkpoint
    from raggedfsdp.app.models import build_model

    model = build_model("llama", "debug")
    model.init_weights(3)
    opt = torch.optim.AdamW(model.parameters())
    meta = {
        "config": {"model": {"name": "llama", "flavor": "debug", "dim": None}, "optimizer": {"name": "adamw"}}
    }
    save_checkpoint(
        folder, 2, model=model, optimizer=opt, lr=0.1, seed=0, keep_latest=0, meta=meta, run_id="r1"
    )


@pytest.fixture(scope="module")
def debug_ckpt(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("other") / "checkpoints"
    run_distributed(_save, 1, str(folder))
    return folder / "step-2"


@pytest.mark.core
def test_resuming_another_models_checkpoint_is_refused_before_the_launch(debug_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    wide = ["--model.dim", "48", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
    rc, err = _train(capsys, *wide, "--out", str(out), "--resume", str(debug_ckpt))
    assert rc == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith(f"raggedfsdp train: error: --resume: {debug_ckpt} holds another model: "), line
    assert "tensors have another shape (e.g. model." in line and "saved with model.dim: None -> 48" in line, (
        line
    )
    assert "resume it with the model it was saved with, or start a new run with another --out" in line, line
    assert len(line) < 500, len(line)
    assert not out.exists()
    # fewer layers: the remaining tensors match, so allow_partial is offered; with it, no refusal here
    rc, err = _train(capsys, "--model.n_layers", "1", "--out", str(out), "--resume", str(debug_ckpt))
    assert rc == 2 and err[-1].endswith("--checkpoint.allow_partial true to load the 12 that match"), err
    # the checkpoint's own model passes the check (it would launch: only the check is called here)
    from raggedfsdp.app.train.config import load_config
    from raggedfsdp.app.train.resume_check import check_resume_model

    cfg = load_config(None, {"model.name": "llama", "model.flavor": "debug"}, validate=False)
    check_resume_model(cfg, debug_ckpt)


@pytest.mark.core
def test_resuming_with_another_optimizer_is_refused_before_the_launch(debug_ckpt, tmp_path, capsys):
    """The same model saved with AdamW, resumed with ``--optim muon``: one line before the launch (it
    came after a ~20 s launch, as a rank's list of every missing ``momentum_buffer``)."""
    ckpt = debug_ckpt
    out = tmp_path / "out"
    rc, err = _train(capsys, "--optim", "muon", "--out", str(out), "--resume", str(ckpt))
    assert rc == 2 and err == [
        f"raggedfsdp train: error: --resume: {ckpt} was saved with --optim adamw and this run uses --optim "
        "muon: the adamw state cannot be loaded into muon; resume with --optim adamw, start a new run with "
        "another --out, or pass --checkpoint.allow_partial true to load the model weights only (muon starts "
        "with fresh state)"
    ], err
    assert not out.exists()
    from raggedfsdp.app.train.config import load_config
    from raggedfsdp.app.train.resume_check import check_resume_model

    same = {"model.name": "llama", "model.flavor": "debug", "optimizer.name": "adamw"}
    check_resume_model(load_config(None, same, validate=False), ckpt)  # the saved optimizer passes
