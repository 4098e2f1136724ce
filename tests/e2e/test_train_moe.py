"""``raggedfsdp train --model.name moe`` trains the MoE on the default corpus: loss falls as the dense
model's does (tests/e2e/test_train_cli.py), and the load-balancing loss is logged."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_train_cli import SMALL, _cli


def test_train_moe_two_ranks_loss_falls_and_aux_loss_logged(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = subprocess.run(
        [*_cli(), "train", "--nproc", "2", *SMALL, "--model.name", "moe", "--model.experts", "fused",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "| aux " in proc.stdout  # console line shows the load-balancing loss
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    assert train[0]["loss"] == pytest.approx(5.55, abs=0.15)  # ~ln(256) at init
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    cfg = json.loads((tmp_path / "config.json").read_text())["resolved"]["model"]
    assert cfg["experts"] == "fused" and cfg["n_experts"] == 8
    # coef * sum over the 2 MoE layers of X * sum_e f_e P_e (about 1 per layer near uniform routing, <= X)
    for r in train:
        assert 0.01 * 2 * 0.5 <= r["aux_loss"] <= 0.01 * 2 * 8
