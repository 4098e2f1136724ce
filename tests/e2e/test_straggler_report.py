"""The straggler report over the whole step (``train/straggler.py``): a rank frozen periodically
(``RAGGEDFSDP_FAULT=freeze@stepN:rankR``: its process stopped with SIGSTOP F of every P seconds, so the
freezes land anywhere in its step, backward and optimizer included) is named; a healthy run names no
rank. Reference: the rank the fault froze (the healthy run: none). One 3-rank gloo spawn, two
``Trainer`` runs of the debug model driven directly (as ``test_train_faults.py``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from _cases import SharedSpawns, case_tmpdir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP / SIGCONT")

STEPS, LOG_EVERY = 12, 4


def _run(rank, out: Path, fault: str) -> list[dict]:
    import torch

    from raggedfsdp.app.train.config import load_config
    from raggedfsdp.app.train.trainer import Trainer

    over = {
        "model.flavor": "debug", "training.steps": str(STEPS), "training.global_batch_size": "6",
        "training.seq_len": "32", "data.max_bytes": "200000", "metrics.log_every": str(LOG_EVERY),
        "metrics.eval_batches": "1", "optimizer.warmup_steps": "1", "job.out": str(out),
    }  # fmt: skip
    os.environ["RAGGEDFSDP_FAULT"] = fault
    try:
        tr = Trainer(load_config(None, over), device=torch.device("cpu"))
    finally:
        os.environ.pop("RAGGEDFSDP_FAULT")
    try:
        tr.train()
    finally:
        tr.close()  # the freezer continues the rank and exits
    if rank != 0:
        return []
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _cases(rank, world):
    from raggedfsdp.app.train.faults import FREEZE_ENV
    from raggedfsdp.app.train.straggler import describe

    tmp = Path(case_tmpdir())
    # healthy: a record per log step, each naming no rank (the first step's window: never)
    recs = _run(rank, tmp / "healthy", "")
    if rank == 0:
        assert [r["step"] for r in recs] == [1, 4, 8, 12], recs
        assert not any(r["straggler"]["named"] for r in recs), [r["straggler"] for r in recs]
        assert recs[0]["straggler"]["warmup"], recs[0]
    # rank 1 frozen 0.6 s of every 0.7 s from step 2 on, the first stop at step 2's start: each window
    # that follows (3 or 4 steps of >= 50 ms) holds a stop, whatever the steps' speed
    os.environ[FREEZE_ENV] = "0.6/0.7"
    try:
        recs = _run(rank, tmp / "frozen", "freeze@step2:rank1")
    finally:
        os.environ.pop(FREEZE_ENV)
    if rank == 0:
        seen = [r["straggler"] for r in recs]
        assert [r["step"] for r in recs] == [1, 4, 8, 12], recs
        for st in seen[1:]:  # steps 2-4, 5-8 and 9-12: frozen about 3/4 of the time
            assert st["named"] and st["rank"] == 1 and st["own_excess_pct"] > 100, seen
            assert st["phase"] == "stalled" or st["excess_s"] > 0.05, seen
            assert describe(st).startswith("slowest rank 1: +"), seen


SPAWN = SharedSpawns({"report": "test_straggler_report._cases"}, {3: [("report", ())]}, timeout=300)


@pytest.mark.slow  # about 70 s on the shared 2-core machine
def test_periodically_frozen_rank_is_named_and_a_healthy_run_names_none():
    SPAWN.check(3, "report")
