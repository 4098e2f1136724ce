"""End-to-end: `raggedfsdp train --compile true` (each block compiled before fully_shard, docs/fsdp.md
"torch.compile") trains, and its losses match the eager run's step for step.

The trainer's own module hooks (the straggler probe's timers) must stay out of the compiled graph;
until 2026-12 they broke `--compile true` at the first forward (a user trial found it: dynamo cannot
trace ``time.perf_counter``).

The compiled run has a short hang timeout (15 s; the first step's compile takes 20-60 s on 2 cores with
inductor's caches off):
the job's own watchdog killed it as hung (``HangError ... no progress for 60.1s``, issue 41 item 12)
until the watchdog learnt to tell torch.compile's compiler on the stack from a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = ["--config", "debug", "--steps", "4", "--log-every", "1", "--metrics.eval_batches", "1"]


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("raggedfsdp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "raggedfsdp.app.cli"]


def _losses(out: Path, *extra: str, **more_env: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "RANK"} | more_env
    proc = subprocess.run(
        [*_cli(), "train", *ARGS, "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, f"train {extra} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


def test_compile_true_trains_like_eager(tmp_path):
    eager = _losses(tmp_path / "eager")
    # inductor's caches off: a first compile as a new user's (a warm cache compiles in seconds)
    compiled = _losses(
        tmp_path / "compiled",
        "--compile",
        "true",
        "--job.hang_timeout_s",
        "15",
        TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
    )
    assert len(compiled) == len(eager) == 4
    # the same math, other kernels (inductor fuses): agreement to float32 round-off, not bitwise
    assert compiled == pytest.approx(eager, abs=2e-4)
