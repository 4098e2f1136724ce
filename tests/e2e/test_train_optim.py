"""`raggedfsdp train --optim muon|adamw8bit|shampoo` through the README's command path (2 gloo ranks, debug
model)."""

from __future__ import annotations

import json

import pytest
from test_train_cli import SMALL, _cli, _records, _run

from raggedfsdp.app.cli import main as cli_main


@pytest.mark.parametrize("optim", ["muon", "adamw8bit", "shampoo"])
def test_train_with_structure_aware_optimizer(optim, tmp_path):
    proc, _ = _run([*_cli(), "train", "--nproc", "2", *SMALL, "--optim", optim, "--out", str(tmp_path)], 240)
    assert proc.returncode == 0, f"{optim} run failed:\n{proc.stdout}\n{proc.stderr}"
    recs, evals = _records(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["optimizer"]["name"] == optim
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.2, [r["loss"] for r in recs]
    assert evals


@pytest.mark.core
def test_structure_aware_optimizer_needs_the_ragged_backend(capsys):
    assert cli_main(["train", "--optim", "muon", "--backend", "torch"]) == 2
    assert "fsdp.backend='ragged'" in capsys.readouterr().err
