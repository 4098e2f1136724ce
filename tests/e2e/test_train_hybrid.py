"""`raggedfsdp train --config hybrid-tiny` end to end on 2 ranks, one FSDP unit per super-block:
the loss falls, and the new metrics (MFU, peak memory) are in the line, the JSONL and TensorBoard."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_hybrid_preset_trains_with_metrics(tmp_path):
    # the default corpus (the Python stdlib sources): the same data on every machine
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "raggedfsdp.app.cli",
        "train",
        "--config",
        "hybrid-tiny",
        "--model",
        "debug",
        "--nproc",
        "2",
        "--steps",
        "8",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--lr",
        "1e-2",
        "--log-every",
        "4",
        "--job.peak_tflops",
        "0.1",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mfu " in run.stdout and "mem " in run.stdout
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(0 < r["mfu"] < 1 and r["peak_memory_bytes"] > 0 for r in train)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["name"] == "hybrid" and cfg["fsdp"]["unit"] == "superblock"
    pytest.importorskip("tensorboard")
    assert list((out / "tb").glob("events.out.tfevents.*"))
