"""`raggedfsdp train --fsdp.all_gather_dtype fp8_e4m3|int8 --fsdp.reduce_scatter_wire_dtype bf16` (issue 40):
2 gloo ranks on ``configs/debug_cpu.toml`` against the unquantized run of the same command (the reference:
the full-precision all-gather and reduce-scatter of the same model, data and seed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_cli import _cli, _records, _run

from raggedfsdp.app.cli import main as cli_main

STEPS = "40"
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug_cpu.toml")


def _train(tmp_path, name, *flags):
    out = tmp_path / name
    cmd = [*_cli(), "train", "--nproc", "2", "--config", CONFIG, "--steps", STEPS]
    proc, _ = _run([*cmd, *flags, "--out", str(out)], 240, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, f"{name} run failed:\n{proc.stdout}\n{proc.stderr}"
    if flags:  # the run's first log line names what is quantized
        assert f"all-gather {flags[1]}" in proc.stdout + proc.stderr
    return out


def test_quantized_all_gather_final_loss_within_3_percent(tmp_path):
    base = _train(tmp_path, "none")
    runs = {
        "fp8": _train(tmp_path, "fp8", "--fsdp.all_gather_dtype", "fp8_e4m3"),
        "int8_bf16wire": _train(
            tmp_path,
            "int8_bf16wire",
            "--fsdp.all_gather_dtype",
            "int8",
            "--fsdp.reduce_scatter_wire_dtype",
            "bf16",
        ),
    }
    ref, ref_eval = _records(base)
    for name, out in runs.items():
        cfg = json.loads((out / "config.json").read_text())["fsdp"]
        assert cfg["all_gather_dtype"] in ("fp8_e4m3", "int8")
        recs, evals = _records(out)
        assert [r["step"] for r in recs] == [r["step"] for r in ref]
        # the quantized run really is quantized: its losses are not the unquantized run's bits
        assert any(a["loss"] != b["loss"] for a, b in zip(recs, ref)), name
        assert recs[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=0.03), name
        assert evals[-1]["eval_loss"] == pytest.approx(ref_eval[-1]["eval_loss"], rel=0.03), name
        assert recs[-1]["loss"] < recs[0]["loss"] - 1.0, name  # it trains


@pytest.mark.core
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--backend", "torch", "--fsdp.all_gather_dtype", "fp8_e4m3"], "fsdp.all_gather_dtype='fp8_e4m3'"),
        (["--backend", "torch", "--fsdp.reduce_scatter_wire_dtype", "bf16"], "fsdp.backend='ragged'"),
        (["--fsdp.all_gather_dtype", "fp4"], "fsdp.all_gather_dtype must be one of"),
        (["--fsdp.reduce_scatter_wire_dtype", "fp16"], "fsdp.reduce_scatter_wire_dtype must be one of"),
    ],
)
def test_quantized_flags_bad_input(flags, needle, capsys):
    assert cli_main(["train", *flags]) == 2
    assert needle in capsys.readouterr().err
