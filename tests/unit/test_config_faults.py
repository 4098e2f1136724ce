"""Unit tests of the fault-handling pieces (issue 11) that need no process group: the
``RAGGEDFSDP_FAULT`` grammar, the step guard's decisions, batch checks and ids, key comparison,
manifests, the ``--out`` lock and policy, and the watchdog's classification of a stuck rank."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from raggedfsdp.app.checkpoint import integrity
from raggedfsdp.app.checkpoint.dcp import compare_keys
from raggedfsdp.app.train import run_dir
from raggedfsdp.app.train.config import TrainConfig, load_config
from raggedfsdp.app.train.data import BatchSampler, DataError, batch_id, check_batch, reproduce_batch
from raggedfsdp.app.train.faults import Fault, FaultPlan, parse_faults
from raggedfsdp.app.train.guard import DivergenceError, NonFiniteError, StepGuard, StepStats
from raggedfsdp.app.train.watchdog import Watchdog, in_collective


def test_fault_grammar_and_plan():
    assert parse_faults("nan@step3:rank1, hang@step5") == [Fault("nan", 3, 1), Fault("hang", 5, None)]
    for bad in ("nan@3", "nope@step1", "nan@step1:r1"):
        with pytest.raises(ValueError, match="RAGGEDFSDP_FAULT: bad item"):
            parse_faults(bad)
    plan = FaultPlan(parse_faults("nan@step3:rank1,inf@step4"), rank=1)
    assert not plan.take("nan", 2) and plan.take("nan", 3) and not plan.take("nan", 3)  # once
    assert not FaultPlan(parse_faults("nan@step3:rank1"), rank=0)
    dbg = TrainConfig().debug
    dbg.fail_rank, dbg.fail_step, dbg.fail_mode = 0, 2, "exit"
    assert FaultPlan.from_env(0, dbg).take("exit", 2)
    # the save faults (one per save), and oom inside the forward
    plan = FaultPlan(parse_faults("slowsave@step4,eacces@step2:rank1,oom@step3"), rank=1)
    assert plan.save_fault(2) == "eacces" and plan.save_fault(2) == "" and plan.save_fault(4) == "slowsave"
    plan.inject_forward(2)  # nothing at another step
    with pytest.raises(torch.OutOfMemoryError, match="injected by RAGGEDFSDP_FAULT=oom"):
        plan.inject_forward(3)


def test_out_of_memory_becomes_one_line_naming_rank_step_and_batch():
    from raggedfsdp.app.train.guard import ResourceError, out_of_memory

    ids = {1: "step3:rows2-3 (rank 1, micro-step 0)"}
    for e in (
        MemoryError(),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"),
    ):
        r = out_of_memory(e, 3, 1, torch.device("cpu"), ids)
        assert isinstance(r, ResourceError) and r.culprits == (1,)
        assert str(r).startswith(
            "out of memory on rank 1 (cpu) at step 3 (batch step3:rows2-3 (rank 1, micro-step 0)): "
        )
    other = RuntimeError("shape mismatch")
    assert out_of_memory(other, 3, 1, "cpu", ids) is other  # not an OOM: re-raised as it is


def _guard(**kw):
    return StepGuard(rank=0, world_size=2, device=torch.device("cpu"), **kw)


IDS = {0: "step7:rows0-1 (rank 0, micro-step 0)", 1: "step7:rows2-3 (rank 1, micro-step 0)"}


def test_guard_stop_names_the_rank_of_the_nonfinite_loss_not_every_nan_gradient():
    stats = StepStats(loss=float("nan"), grad_norm=float("nan"), bad_loss_ranks=[1], bad_grad_ranks=[0, 1])
    with pytest.raises(NonFiniteError) as e:
        _guard().check(7, stats, IDS)
    assert str(e.value).startswith(
        "non-finite loss on rank 1 at step 7 (batch step7:rows2-3 (rank 1, micro-step 0)); stopped before"
    )
    assert e.value.culprits == (1,) and "--reproduce-batch step7:rows2-3)" in str(e.value)
    finite = StepStats(loss=5.0, grad_norm=1.0)
    assert _guard().check(7, finite, IDS) is True


def test_guard_skip_policy_counts_and_stops_after_too_many():
    g = _guard(policy="skip", max_consecutive_skips=2)
    bad = StepStats(loss=1.0, grad_norm=float("inf"), bad_grad_ranks=[0])
    assert g.check(1, bad, IDS) is False and g.check(2, bad, IDS) is False
    assert g.check(3, StepStats(loss=5.0, grad_norm=1.0), IDS) is True  # resets the streak
    assert g.check(4, bad, IDS) is False and g.check(5, bad, IDS) is False
    with pytest.raises(NonFiniteError, match="3 non-finite steps in a row"):
        g.check(6, bad, IDS)
    assert g.skipped_steps == 5


def test_guard_divergence():
    g = _guard(divergence_ratio=3.0)
    assert g.check(1, StepStats(loss=5.5, grad_norm=1.0), IDS)
    assert g.check(2, StepStats(loss=16.0, grad_norm=1.0), IDS)
    with pytest.raises(DivergenceError, match=r"loss diverged at step 3: 17 > training.divergence_ratio=3 x"):
        g.check(3, StepStats(loss=17.0, grad_norm=1.0), IDS)
    assert _guard(divergence_ratio=0).check(1, StepStats(loss=1e9, grad_norm=1.0), IDS)


def test_batch_checks_name_rank_step_sample_and_offset():
    tokens = torch.arange(1000) % 256
    s = BatchSampler(
        tokens.to(torch.uint8), seq_len=8, global_batch_size=8, world_size=2, rank=1, grad_accum=2
    )
    inputs, targets = s.get(5, 1)
    assert batch_id(s, 5, 1, 1) == "step5:rows6-7 (rank 1, micro-step 1)"
    check_batch(inputs, targets, sampler=s, step=5, micro=1, vocab_size=256)
    bad = inputs.clone()
    bad[1, 3] = 300
    with pytest.raises(DataError) as e:
        check_batch(bad, targets, sampler=s, step=5, micro=1, vocab_size=256)
    off = int(s.global_offsets(5)[7])
    assert str(e.value) == (
        "rank 1, step 5: batch step5:rows6-7 (rank 1, micro-step 1): inputs hold token id 300 outside "
        f"[0, 256) at sample 1 (global row 7, corpus offset {off}), position 3"
    )
    with pytest.raises(DataError, match=r"inputs have shape \(1, 8\), expected \(2, 8\)"):
        check_batch(inputs[:1], targets[:1], sampler=s, step=5, micro=1, vocab_size=256)
    text = reproduce_batch(s, "step5:rows7-7")
    assert text.startswith(f"--- step 5, global row 7, corpus offset {off}:")
    with pytest.raises(ValueError, match="bad batch id"):
        reproduce_batch(s, "rows7")
    # the rows' own bytes: the text of the byte-level corpus at that offset
    assert text.split("\n", 1)[1] == bytes((tokens[off : off + 9]).tolist()).decode("utf-8", "replace")
    # a tokenized corpus (.bin, ids up to the vocab): the ids themselves, not bytes
    big = BatchSampler(
        torch.arange(1000) * 7, seq_len=8, global_batch_size=8, world_size=2, rank=1, grad_accum=2
    )
    o7 = int(big.global_offsets(5)[7])
    assert reproduce_batch(big, "step5:rows7-7").split("\n", 1)[1] == (
        f"token ids (9): {[7 * i for i in range(o7, o7 + 9)]}"
    )


def test_compare_keys():
    want = {"model.a": (2, 3), "model.b": (4,), "model.c": (1,)}
    saved = {"model.a": (2, 3), "model.b": (5,), "model.d": (1,)}
    assert compare_keys(want, saved) == (["model.c"], ["model.d"], ["model.b (checkpoint [5], model [4])"])


def test_manifest_verification(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"a" * 100)
    (tmp_path / ".metadata").write_bytes(b"m")
    files = {p.name: integrity.file_digest(p) for p in tmp_path.iterdir()}
    assert integrity.verify_step_folder(tmp_path).startswith("manifest.json missing")
    integrity.write_manifest(tmp_path, run_id="r", step=1, files=files)
    assert integrity.verify_step_folder(tmp_path) is None
    (tmp_path / "__0_0.distcp").write_bytes(b"a" * 99 + b"b")
    assert (
        integrity.verify_step_folder(tmp_path) == "__0_0.distcp fails its SHA-256 check (corrupted on disk)"
    )
    (tmp_path / "__1_0.distcp").write_bytes(b"")
    assert integrity.verify_step_folder(tmp_path) == "file(s) not in the manifest: __1_0.distcp"
    (tmp_path / "__1_0.distcp").unlink()
    (tmp_path / ".metadata").unlink()  # a deleted newest .metadata is not an older step's resume
    assert integrity.verify_step_folder(tmp_path) == ".metadata is missing"


def test_out_lock_and_policy(tmp_path):
    lock = run_dir.OutLock(tmp_path).acquire()
    with pytest.raises(ValueError, match=rf"--out {tmp_path} is in use by another job \(pid \d+ on "):
        run_dir.OutLock(tmp_path).acquire()
    stale = os.open(tmp_path / ".lock", os.O_RDWR)  # a job that opened the file before it was removed
    lock.release()
    assert not (tmp_path / ".lock").exists()  # a finished run leaves no .lock behind
    import fcntl

    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it holds a removed file: that locks nothing
    run_dir.OutLock(tmp_path).acquire().release()  # a new job locks the file at the path
    os.close(stale)
    run_dir.check_out_dir(str(tmp_path), str(tmp_path / "checkpoints"), resume="", overwrite=False)
    run_dir.write_run_file(tmp_path, "abc")
    with pytest.raises(ValueError, match="already holds a run \\(run abc\\); continue it with --resume auto"):
        run_dir.check_out_dir(str(tmp_path), str(tmp_path / "checkpoints"), resume="", overwrite=False)
    run_dir.check_out_dir(str(tmp_path), str(tmp_path / "c"), resume="", overwrite=True)
    run_dir.check_out_dir(str(tmp_path), str(tmp_path / "c"), resume="auto", overwrite=False)


def test_config_validation_of_the_fault_options():
    with pytest.raises(ValueError, match="training.on_nonfinite must be one of"):
        load_config(None, {"training.on_nonfinite": "ignore"})
    with pytest.raises(ValueError, match="--resume auto needs --out"):
        load_config(None, {"checkpoint.resume": "auto"})
    assert load_config(None, {"checkpoint.resume": "auto", "job.out": "o"}).checkpoint.verify is True
    assert TrainConfig().job.out == ""  # a fresh folder per run (chosen by the launcher)


def test_watchdog_names_a_peer_whose_heartbeat_stopped():
    import torch.distributed as dist

    store = dist.HashStore()
    wd = Watchdog(rank=0, world_size=3, tag="[rank 0/3]", timeout_s=5, store=store, interval_s=0.5)
    store.set("hb1", json.dumps({"t": time.time(), "step": 4, "where": "step 4 start"}))
    assert wd._frozen_peer() is None
    store.set("hb2", json.dumps({"t": time.time() - 30, "step": 3, "where": "step 3 micro-step 0"}))
    r, age, beat = wd._frozen_peer()
    assert r == 2 and age > 29 and beat["step"] == 3


def test_in_collective_classifies_the_innermost_frame():
    frame = sys._getframe()
    assert not in_collective(frame)
    import torch.distributed.distributed_c10d as c10d

    class F:  # a stand-in for a frame inside torch.distributed
        f_code = type("C", (), {"co_filename": c10d.__file__})()

    assert in_collective(F())
