"""``train/run_dir.prepare``: a job verifies an explicit ``--resume PATH`` once and validates the config
once per process (issue 18), and the launcher's marks reach the ranks.

One 1-rank gloo process drives the launcher's and a rank's steps in turn, the way ``raggedfsdp train``
and ``launch/worker.py`` call them, with the SHA-256 verification (``verify_step_folder``) and
``TrainConfig.validate`` counted. The reference: the same resume without the launcher's marks hashes
the checkpoint again, and the resumed Trainer starts at the saved step with the saved parameters.
"""

from __future__ import annotations

import os
from pathlib import Path

from _dist import run_distributed

TINY = {
    "model.flavor": "debug",
    "training.steps": "2",
    "training.global_batch_size": "4",
    "training.seq_len": "32",
    "data.max_bytes": "200000",
    "metrics.eval_batches": "1",
    "optimizer.warmup_steps": "1",
}


def _body(rank, world, tmp):
    import torch

    import raggedfsdp.app.checkpoint.dcp as dcp
    import raggedfsdp.app.checkpoint.integrity as integrity
    from raggedfsdp.app.train import run_dir
    from raggedfsdp.app.train.config import TrainConfig, load_config
    from raggedfsdp.app.train.trainer import Trainer

    tmp = Path(tmp)
    cpu = torch.device("cpu")
    tr = Trainer(
        load_config(None, {**TINY, "job.out": str(tmp / "a"), "checkpoint.interval": "2"}), device=cpu
    )
    tr.train()
    saved = [p.full_tensor().clone() for p in tr.model.parameters()]
    tr.close()
    step2 = tmp / "a" / "checkpoints" / "step-2"
    assert step2.is_dir()

    hashed, validated = [], []
    verify, validate = integrity.verify_step_folder, TrainConfig.validate
    dcp.verify_step_folder = integrity.verify_step_folder = lambda p: hashed.append(p) or verify(p)
    TrainConfig.validate = lambda self, world_size=None: (
        validated.append(world_size) or validate(self, world_size)
    )
    over = {**TINY, "job.out": str(tmp / "b"), "training.steps": "3", "checkpoint.resume": str(step2)}
    saved_env = {k: os.environ.get(k) for k in (run_dir.LOCK_HELD_ENV, run_dir.RESUME_VERIFIED_ENV)}
    try:
        # the launcher (commands/train.py): load without validating, prepare once, hand to the ranks
        cfg = load_config(None, over, validate=False)
        launcher = run_dir.prepare(cfg, 1)
        run_dir.hand_to_workers(cfg, launcher)
        assert (len(hashed), validated) == (1, [1]), (hashed, validated)
        assert launcher.resume_path == step2 and launcher.lock is not None
        # a rank (launch/worker.py), in the launched process: the launcher's marks, no second hash
        cfg = load_config(None, over, validate=False)
        run = run_dir.prepare(cfg, 1, rank=0)
        assert run.resume_path == step2 and run.lock is None  # the launcher holds OUT/.lock
        tr = Trainer(cfg, device=cpu, run=run)
        assert (len(hashed), validated) == (1, [1, 1]), (hashed, validated)
        assert tr.start_step == 2 and tr.resumed_from == step2
        assert all(torch.equal(a, p.full_tensor()) for a, p in zip(saved, tr.model.parameters()))
        tr.close()
        launcher.lock.release()
        # the reference: without the launcher's marks a rank verifies the checkpoint itself
        os.environ.pop(run_dir.RESUME_VERIFIED_ENV)
        os.environ.pop(run_dir.LOCK_HELD_ENV)
        run = run_dir.prepare(load_config(None, over, validate=False), 1, rank=0)
        assert len(hashed) == 2 and run.lock is not None
        run.lock.release()
    finally:
        dcp.verify_step_folder = integrity.verify_step_folder = verify
        TrainConfig.validate = validate
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_prepare_verifies_resume_once_and_validates_once_per_process(tmp_path):
    run_distributed(_body, 1, str(tmp_path))
