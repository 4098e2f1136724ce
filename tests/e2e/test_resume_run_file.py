"""``--resume auto`` with ``OUT/run.json`` deleted or corrupted (issue 41 item 2).

Before: the run restarted from step 0 with exit 0, overwrote ``metrics.jsonl`` (21 records replaced by
31 new ones) and called its own checkpoints "checkpoints of other runs". Now the run id is recovered
from the checkpoints' manifests (every ``step-N`` names the run that saved it): the run continues from
its newest checkpoint, ``metrics.jsonl`` keeps its records, a note says what happened and an
unreadable ``run.json`` is kept aside; when the manifests name several runs, the job is refused before
it starts, naming them and the ``--resume PATH`` that continues one. A one-process worker trains the
debug model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = [
    "--model", "debug",
    "--log-every", "1",
    "--batch-size", "4",
    "--seq-len", "32",
    "--data.max_bytes", "200000",
    "--optimizer.warmup_steps", "2",
    "--metrics.eval_batches", "1",
    "--checkpoint-interval", "2",
]  # fmt: skip


def _worker(out: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "raggedfsdp.app.launch.worker",
        *ARGS,
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=300, env=env, check=False)


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == sorted(set(steps)), steps  # one record per step, in order: nothing overwritten
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.timeout(900)
def test_resume_auto_without_run_json_continues_the_run_of_the_checkpoints(tmp_path):
    out = tmp_path / "out"
    proc = _worker(out, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    first = _losses(out)

    # run.json deleted: continues from step-4 as run run_id
    (out / "run.json").unlink()
    proc = _worker(out, 6, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ck = out / "checkpoints"
    assert f"resumed from {ck / 'step-4'}: step 4" in proc.stderr, proc.stderr[-3000:]
    assert f"run.json was missing; continuing run {run_id}" in proc.stderr, proc.stderr[-3000:]
    assert "other runs" not in proc.stderr
    assert json.loads((out / "run.json").read_text())["run_id"] == run_id

    # run.json corrupted: the same, and the unreadable file is kept
    (out / "run.json").write_text('{"run_id": ')
    proc = _worker(out, 8, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ck / 'step-6'}: step 6" in proc.stderr, proc.stderr[-3000:]
    assert "run.json was unreadable (JSONDecodeError" in proc.stderr, proc.stderr[-3000:]
    assert (out / "run.json.unreadable").read_text() == '{"run_id": '
    got = _losses(out)
    assert sorted(got) == list(range(1, 9))  # steps 5-8 continued the run
    assert {s: got[s] for s in first} == first  # the first run's records kept as they were

    # checkpoints of two runs and no run.json: refused before anything starts, nothing changed
    shutil.copytree(ck / "step-8", ck / "step-10")
    man = json.loads((ck / "step-10" / "manifest.json").read_text())
    (ck / "step-10" / "manifest.json").write_text(json.dumps({**man, "run_id": "other"}))
    (out / "run.json").unlink()
    before = (out / "metrics.jsonl").read_text()
    proc = _worker(out, 12, "--resume", "auto")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and "belong to 2 runs (run other: step-10; run " in last[0], last
    assert last[0].endswith(
        f"nothing was changed: continue one with --resume PATH, e.g. --resume {ck / 'step-10'}"
    )
    assert (out / "metrics.jsonl").read_text() == before and not (out / "run.json").exists()
