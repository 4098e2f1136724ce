"""End-to-end checkpoint/resume of `raggedfsdp train` (DCP, any world size).

One uninterrupted 8-step run at 2 ranks is the reference. A second 2-rank run crashes at step 5
(an injected failure) after saving step-2 and step-4; it is resumed with ``--resume auto`` at 1 rank
into the same output folder, and the reference's step-6 checkpoint is resumed at 3 ranks. Every
per-step loss and the final eval loss must match the reference (fp32, relative 1e-5).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raggedfsdp.app.cli import main as cli_main

STEPS = 8
# Batch 12 splits over 1, 2 and 3 ranks; log every step so that every loss is compared.
ARGS = [
    "--model", "debug",
    "--steps", str(STEPS),
    "--log-every", "1",
    "--batch-size", "12",
    "--seq-len", "64",
    "--data.max_bytes", "300000",
    "--optimizer.warmup_steps", "3",
    "--metrics.eval_batches", "1",
    "--checkpoint-interval", "2",
]  # fmt: skip
RTOL = 1e-5


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("raggedfsdp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "raggedfsdp.app.cli"]


def _run(cmd: list[str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env.pop("RANK", None)  # never inherit a launcher's environment
    start = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - start


def _losses(out: Path) -> tuple[dict[int, float], list[float]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["loss"] for r in recs if "loss" in r}
    return train, [r["eval_loss"] for r in recs if "eval_loss" in r]


def _assert_same(got: dict[int, float], want: dict[int, float], steps) -> None:
    for s in steps:
        assert s in got, f"step {s} missing from the resumed run's metrics: {sorted(got)}"
        assert got[s] == pytest.approx(want[s], rel=RTOL), f"step {s}: {got[s]} != {want[s]}"


def _steps_saved(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / ".metadata").is_file())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """8 steps straight at 2 ranks, checkpointing every 2 steps; `--resume auto` with nothing saved."""
    out = tmp_path_factory.mktemp("ref")
    proc, _ = _run([*_cli(), "train", "--nproc", "2", *ARGS, "--out", str(out), "--resume", "auto"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"--resume auto: no checkpoint under {out / 'checkpoints'}, starting from step 0" in proc.stderr
    return out


def test_reference_checkpoints_and_meta(reference):
    ckpt = reference / "checkpoints"
    assert _steps_saved(ckpt) == [6, 8]  # keep_latest = 2 pruned step-2 and step-4
    assert not list(ckpt.glob("*.tmp"))
    meta = json.loads((ckpt / "step-8" / "meta.json").read_text())
    assert meta["step"] == 8 and meta["world_size"] == 2 and len(meta["config_hash"]) == 16
    assert json.loads((reference / "config.json").read_text())["resolved"]["resumed_from"] is None


def test_crash_then_resume_auto_at_1_rank_and_resume_path_at_3_ranks(reference, tmp_path):
    want, want_eval = _losses(reference)
    assert sorted(want) == list(range(1, STEPS + 1))

    # 2 ranks, rank 1 crashes at step 5: step-2 and step-4 are on disk.
    out = tmp_path / "crashed"
    proc, _ = _run(
        [*_cli(), "train", "--nproc", "2", *ARGS, "--out", str(out),
         "--debug.fail_rank", "1", "--debug.fail_step", "5"]
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _steps_saved(out / "checkpoints") == [2, 4]

    # Resume where it stopped, at 1 rank (a plain process), into the same OUT.
    proc, _ = _run(
        [sys.executable, "-m", "raggedfsdp.app.launch.worker", *ARGS, "--out", str(out), "--resume", "auto"]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {out / 'checkpoints' / 'step-4'}: step 4" in proc.stderr
    got, got_eval = _losses(out)
    _assert_same(got, want, range(1, STEPS + 1))  # 1..4 kept from the crashed run, 5..8 resumed
    assert got_eval == pytest.approx(want_eval, rel=RTOL) and len(got_eval) == 1
    assert _steps_saved(out / "checkpoints") == [6, 8]
    assert json.loads((out / "checkpoints" / "step-8" / "meta.json").read_text())["world_size"] == 1

    # The reference's step-6 (saved at 2 ranks), resumed at 3 ranks into a new OUT.
    out3 = tmp_path / "three"
    step6 = reference / "checkpoints" / "step-6"
    proc, _ = _run([*_cli(), "train", "--nproc", "3", *ARGS, "--out", str(out3), "--resume", str(step6)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got, got_eval = _losses(out3)
    assert sorted(got) == [7, 8]
    _assert_same(got, want, [7, 8])
    assert got_eval == pytest.approx(want_eval, rel=RTOL)


@pytest.mark.core
@pytest.mark.parametrize("kind", ["missing", "no_metadata", "corrupt_metadata", "empty_parent", "a_file"])
def test_bad_resume_path_is_a_one_line_error_before_launch(tmp_path, capsys, kind):
    """Checked by the launcher (in-process here: it returns before starting torchrun)."""
    path = tmp_path / "ckpt" / "step-4"
    if kind != "missing":
        path.parent.mkdir(parents=True)
    if kind in ("no_metadata", "corrupt_metadata"):
        path.mkdir()
    if kind == "corrupt_metadata":
        (path / ".metadata").write_bytes(b"not a pickle")
    if kind == "a_file":
        path.write_text("x")
    if kind == "empty_parent":
        path = path.parent
    out = tmp_path / "o"
    rc = cli_main(["train", "--nproc", "2", *ARGS, "--out", str(out), "--resume", str(path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("raggedfsdp train: error: ") and str(path) in last, last
    assert "launching" not in err and not out.exists()


def test_corrupt_shard_file_fails_before_launch_or_at_load_with_exit_2(reference, tmp_path, capsys):
    """A truncated .distcp fails the manifest check before the launch (one line); with
    --checkpoint.verify false it passes that check and fails at load, also with exit code 2."""
    bad = tmp_path / "step-6"
    shutil.copytree(reference / "checkpoints" / "step-6", bad)
    for f in bad.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    rc = cli_main(["train", "--nproc", "1", *ARGS, "--out", str(tmp_path / "o1"), "--resume", str(bad)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(
        f"raggedfsdp train: error: corrupt checkpoint: {bad}: __0_0.distcp has 100 bytes"
    ), last
    proc, _ = _run(
        [*_cli(), "train", "--nproc", "1", *ARGS, "--out", str(tmp_path / "o"), "--resume", str(bad),
         "--checkpoint.verify", "false"]
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"CheckpointError: cannot load checkpoint {bad}" in last, last
