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
        [
            *_cli(),
            "train",
            "--nproc",
            "2",
            *SMALL,
            "--model.name",
            "moe",
            "--model.experts",
            "fused",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
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


@pytest.mark.slow
def test_train_moe_expert_parallel_matches_ep1(tmp_path):
    """``--parallel.ep 2 --nproc 4`` (experts split over 2 EP ranks, all-to-all dispatch, experts FSDP over
    2 ranks, the rest over 4) trains the same model on the same batches as ``--parallel.ep 1``: the loss
    curves agree (fp32, AdamW: rel 2e-3 after 12 steps) and fall."""
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    losses = {}
    for ep in (2, 1):
        out = tmp_path / f"ep{ep}"
        proc = subprocess.run(
            [
                *_cli(),
                "train",
                "--nproc",
                "4",
                *SMALL,
                "--model.name",
                "moe",
                "--model.experts",
                "fused",
                "--batch-size",
                "8",
                "--parallel.ep",
                str(ep),
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[ep] = [(r["step"], r["loss"], r["aux_loss"]) for r in recs if "loss" in r]
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["parallel"]["ep"] == ep and cfg["resolved"]["model"]["experts"] == "fused"
    assert [s for s, _, _ in losses[2]] == [s for s, _, _ in losses[1]]
    for (s, a, x), (_, b, y) in zip(losses[2], losses[1]):
        assert a == pytest.approx(b, rel=2e-3) and x == pytest.approx(y, rel=2e-3), (s, a, b, x, y)
    assert losses[2][-1][1] < losses[2][0][1] - 0.3


@pytest.mark.core
def test_train_ep_bad_combinations_fail_before_launch(capsys):
    """Checked by the launcher before torchrun starts: in-process (no interpreter start per case)."""
    from raggedfsdp.app.cli import main as cli_main

    for argv, match in (
        (["--nproc", "3", "--parallel.ep", "2"], "must divide the number of ranks (3"),
        (["--nproc", "2", "--parallel.ep", "3"], "must divide the 8 experts"),
        (["--nproc", "2", "--parallel.ep", "2", "--model.experts", "separate"], "splits fused expert stacks"),
    ):
        try:
            rc = cli_main(["train", *SMALL, "--model.name", "moe", *argv])
        except SystemExit as e:  # an argparse error exits 2 as the console script does
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and match in err and "launching" not in err, (argv, rc, err[-2000:])
