"""End-to-end: ``raggedfsdp train --parallel.tp 2 --nproc 4`` (dp2 x tp2: the Llama's TP plan, fully_shard
over the dp dim, Note [FSDP x TP]) trains like ``--nproc 4`` without TP (dp4: the same global batches), and
bad parallel layouts fail before launch in one line."""

from __future__ import annotations

import pytest
from test_train_cli import SMALL, _cli, _records, _run

from raggedfsdp.app.cli import main as cli_main


def test_train_tp2_matches_dp4(tmp_path):
    runs = {}
    for name, extra in (("dp4", []), ("tp2", ["--parallel.tp", "2"])):
        out = tmp_path / name
        proc, _ = _run([*_cli(), "train", "--nproc", "4", *SMALL, *extra, "--out", str(out)], 300)
        assert proc.returncode == 0, f"{name} run failed:\n{proc.stdout}\n{proc.stderr}"
        runs[name] = _records(out)
    (dp4, dp4_eval), (tp2, tp2_eval) = runs["dp4"], runs["tp2"]
    assert tp2[-1]["loss"] < tp2[0]["loss"] - 0.5
    for a, b in zip(dp4, tp2):  # same math, other reduction orders (TP splits the matmuls)
        assert a["loss"] == pytest.approx(b["loss"], abs=2e-3), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2), (a, b)
    assert dp4_eval[0]["eval_loss"] == pytest.approx(tp2_eval[0]["eval_loss"], abs=2e-3)


@pytest.mark.core
@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--nproc", "4", "--parallel.tp", "3"],
            "parallel.dp_replicate * parallel.tp = 1 * 3 does not divide --nproc 4",
        ),
        (["--nproc", "8", "--parallel.tp", "8"], "n_heads=4 is not divisible by tp=8"),
        (["--nproc", "8", "--parallel.tp", "2", "--parallel.dp_replicate", "3"], "does not divide --nproc 8"),
        (["--parallel.tp", "2", "--model.name", "moe"], "model.name='llama' only"),
    ],
)
def test_bad_parallel_layouts_fail_before_launch(argv, message, capsys):
    assert cli_main(["train", "--model", "debug", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.core
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "dense", "--tp", "3", "--nproc", "4"], "--tp 3 must divide --nproc 4"),
        (["--model", "moe", "--tp", "2"], "--tp 2 applies to --model dense"),
        (
            ["--model", "dense", "--flavor", "debug", "--tp", "8", "--nproc", "8"],
            "n_heads=4 is not divisible by tp=8",
        ),
    ],
)
def test_bench_tp_bad_input_fails_before_launch(argv, message, capsys):
    assert cli_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
