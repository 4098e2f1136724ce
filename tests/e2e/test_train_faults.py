"""Faults in training (issue 11): non-finite steps, strict and verified loads, foreign checkpoints,
full disks, interrupts, orphans and hung ranks.

Two kinds of tests: one 2-rank gloo spawn (``SharedSpawns``) drives ``Trainer`` directly through
many sub-cases (cheap: one spawn), and a few real ``raggedfsdp train`` launches for what only a
launcher shows (signals, the launcher's death, a hung rank's name, the last line the user sees).
Faults are injected with ``RAGGEDFSDP_FAULT`` (see ``raggedfsdp/app/train/faults.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raggedfsdp.app.cli import main as cli_main
from _cases import SharedSpawns, case_tmpdir

TINY = {
    "model.flavor": "debug",
    "training.steps": "4",
    "training.global_batch_size": "4",
    "training.seq_len": "32",
    "data.max_bytes": "200000",
    "metrics.log_every": "1",
    "metrics.eval_batches": "1",
    "optimizer.warmup_steps": "1",
}


def _cfg(out, **kw):
    from raggedfsdp.app.train.config import load_config

    over = {**TINY, "job.out": str(out), **{k.replace("__", "."): str(v) for k, v in kw.items()}}
    return load_config(None, over)


def _raises(exc, match, fn):
    import re

    try:
        fn()
    except exc as e:
        assert re.search(match, str(e)), f"{type(e).__name__}: {e!r} does not match {match!r}"
        return e
    raise AssertionError(f"{exc.__name__} not raised (wanted {match!r})")


def _trainer(cfg, fault=""):
    import torch

    from raggedfsdp.app.train.trainer import Trainer

    os.environ["RAGGEDFSDP_FAULT"] = fault
    try:
        return Trainer(cfg, device=torch.device("cpu"))
    finally:
        os.environ.pop("RAGGEDFSDP_FAULT")


def _locals(tr):
    return [p.to_local().detach().clone() for p in tr.model.parameters()]


def _cases(rank, world, tmp):
    import torch
    import torch.distributed as dist

    from raggedfsdp.app.checkpoint import integrity
    from raggedfsdp.app.checkpoint.dcp import CheckpointError, resolve_resume
    from raggedfsdp.app.train.guard import DivergenceError, FaultError, NonFiniteError

    tmp = Path(tmp)

    # 1. skip policy: a NaN loss on rank 1 at step 2 leaves every rank's params and AdamW state as
    #    they were after step 1; more than max_consecutive_skips in a row stops the job.
    tr = _trainer(_cfg(tmp / "skip", training__on_nonfinite="skip"), "nan@step2:rank1")
    tr.train_step(1)
    before, opt_steps = _locals(tr), [s["step"].clone() for s in tr.optimizer.state.values()]
    tr.train_step(2)
    assert not tr.last_applied and tr.last_stats.bad_loss_ranks == [1], tr.last_stats
    assert all(torch.equal(a, b) for a, b in zip(before, _locals(tr)))
    assert all(torch.equal(a, s["step"]) for a, s in zip(opt_steps, tr.optimizer.state.values()))
    tr.train_step(3)
    assert tr.last_applied and tr.guard.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, _locals(tr)))
    tr.close()
    cfg = _cfg(tmp / "skip2", training__on_nonfinite="skip", training__max_consecutive_skips=1)
    tr = _trainer(cfg, "inf@step1:rank0,nan@step2:rank0")
    tr.train_step(1)
    e = _raises(NonFiniteError, r"non-finite loss on rank 0 at step 2 .*2 non-finite steps in a row",
                lambda: tr.train_step(2))  # fmt: skip
    assert e.culprits == (0,)
    tr.close()

    # 2. stop policy (default): the run stops at step 3 naming rank 1 and its batch; step-2 is the
    #    newest checkpoint (keep_latest=1 pruned step-1, and nothing was saved at step 3).
    out = tmp / "stop"
    tr = _trainer(_cfg(out, checkpoint__interval=1, checkpoint__keep_latest=1), "nan@step3:rank1")
    _raises(NonFiniteError, r"non-finite loss on rank 1 at step 3 \(batch step3:rows2-3 \(rank 1, "
            r"micro-step 0\)\); stopped before the optimizer step, nothing saved", tr.train)  # fmt: skip
    tr.close()
    dist.barrier()
    assert [p.name for _, p in integrity.step_candidates(out / "checkpoints")] == ["step-2"]
    assert integrity.verify_step_folder(out / "checkpoints" / "step-2") is None
    step2 = out / "checkpoints" / "step-2"
    assert max(r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())) == 2

    # 3. strict loads: tying, fewer layers, another width: every key named; allow_partial loads.
    for i, (over, want) in enumerate([
        ({"model__tie_embeddings": "true"}, (r"unexpected in the checkpoint \(4\): model.output.weight, "
         r"optim.state.output.weight.exp_avg.*config differs \(1\): model.tie_embeddings: None -> True")),
        ({"model__n_layers": "1"}, r"unexpected in the checkpoint \(36\): model.layers.1.attention.wk.weight"),
        ({"model__dim": "48", "model__n_heads": "4", "model__n_kv_heads": "2"},
         r"shape mismatch \(\d+\): model.layers.0.attention.wk.weight \(checkpoint \[\d+, 32\], model \[\d+, 48\]\)"),
    ]):  # fmt: skip
        cfg = _cfg(tmp / f"strict{i}", checkpoint__resume=str(step2), **over)
        _raises(
            CheckpointError,
            f"checkpoint {step2} does not match the model: .*{want}",
            lambda cfg=cfg: _trainer(cfg),
        )
    cfg = _cfg(tmp / "partial", checkpoint__resume=str(step2), checkpoint__allow_partial="true",
               model__tie_embeddings="true")  # fmt: skip
    tr = _trainer(cfg)
    assert tr.start_step == 2  # optimizer state not loaded (its keys differ): still all zeros
    assert all(float(s["exp_avg"].to_local().abs().sum()) == 0 for s in tr.optimizer.state.values())
    tr.close()

    # 4. integrity + run identity: a byte flip in the newest checkpoint, a truncated shard, a foreign
    #    run's newer checkpoint. --resume auto takes the newest intact one of its own run; pruning
    #    keeps the foreign one.
    out = tmp / "integ"
    tr = _trainer(_cfg(out, checkpoint__interval=1, checkpoint__keep_latest=0))
    tr.train()
    run_id = tr.run_id
    tr.close()
    ck = out / "checkpoints"
    if rank == 0:
        f4 = ck / "step-4" / "__1_0.distcp"
        data = bytearray(f4.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
        f4.write_bytes(bytes(data))
        f3 = ck / "step-3" / "__0_0.distcp"
        f3.write_bytes(f3.read_bytes()[:100])
        shutil.copytree(ck / "step-1", ck / "step-9")
        man = json.loads((ck / "step-9" / "manifest.json").read_text())
        (ck / "step-9" / "manifest.json").write_text(json.dumps({**man, "run_id": "foreign"}))
    dist.barrier()
    notes = []
    assert resolve_resume("auto", ck, run_id=run_id, notes=notes) == ck / "step-2"
    assert notes == [
        f"--resume auto: skipping {ck / 'step-4'}: __1_0.distcp fails its SHA-256 check (corrupted on disk)",
        (
            f"--resume auto: skipping {ck / 'step-3'}: __0_0.distcp has 100 bytes, the manifest says "
            f"{integrity.read_manifest(ck / 'step-3')['files']['__0_0.distcp']['bytes']} (truncated?)"
        ),
        "--resume auto: ignoring checkpoints of other runs: step-9 (run foreign)",
    ], notes
    _raises(CheckpointError, r"corrupt checkpoint: .*step-4: __1_0.distcp fails its SHA-256",
            lambda: resolve_resume(str(ck / "step-4"), ck))  # fmt: skip
    tr = _trainer(_cfg(out, checkpoint__interval=1, checkpoint__keep_latest=1, checkpoint__resume="auto",
                       training__steps=5))  # fmt: skip
    assert tr.resumed_from == ck / "step-2" and tr.run_id == run_id
    tr.train()
    tr.close()
    dist.barrier()
    assert sorted(p.name for _, p in integrity.step_candidates(ck)) == ["step-5", "step-9"]
    _raises(ValueError, r"already holds a run \(run [0-9a-f]+; metrics.jsonl; checkpoints step-5, step-9\)",
            lambda: _trainer(_cfg(out)))  # fmt: skip

    # 4b. --resume auto where every checkpoint of the run is unreadable: refused, one line naming each
    #     and why, nothing overwritten; --job.overwrite true starts again from step 0 (issue 23 item 4).
    out = tmp / "unread"
    tr = _trainer(_cfg(out, checkpoint__interval=1, checkpoint__keep_latest=0, training__steps=2))
    tr.train()
    tr.close()
    dist.barrier()
    ck = out / "checkpoints"
    if rank == 0:
        for s in (1, 2):
            f = ck / f"step-{s}" / "__0_0.distcp"
            f.write_bytes(f.read_bytes()[:50])
    dist.barrier()
    metrics = (out / "metrics.jsonl").read_bytes()
    sizes = {s: (ck / f"step-{s}" / "__0_0.distcp").stat().st_size for s in (1, 2)}
    e = _raises(CheckpointError, rf"--resume auto: no readable checkpoint of run {tr.run_id} under {ck}: "
                rf"{ck / 'step-2'}: __0_0.distcp has 50 bytes, .*; {ck / 'step-1'}: __0_0.distcp has 50 bytes.*"
                r"nothing was changed.*--job.overwrite true",
                lambda: _trainer(_cfg(out, checkpoint__resume="auto", training__steps=3)))  # fmt: skip
    assert "\n" not in str(e)
    dist.barrier()
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert {s: (ck / f"step-{s}" / "__0_0.distcp").stat().st_size for s in (1, 2)} == sizes
    tr = _trainer(_cfg(out, checkpoint__resume="auto", job__overwrite="true"))
    assert tr.start_step == 0 and tr.resumed_from is None
    tr.close()

    # 5. a full disk during the save: one line naming the cause, the path and the rank; no step-1.
    out = tmp / "enospc"
    tr = _trainer(_cfg(out, checkpoint__interval=1), "enospc@step1:rank1")
    _raises(CheckpointError, r"cannot save checkpoint .*step-1: No space left on device: '.*__fault.distcp' "
            r"on rank 1$", tr.train)  # fmt: skip
    tr.close()
    dist.barrier()
    assert not (out / "checkpoints" / "step-1").exists()

    # 6. divergence (mechanism: ratio 0.5 trips at step 2), and no checkpoint of non-finite state.
    tr = _trainer(_cfg(tmp / "div", training__divergence_ratio=0.5))
    tr.train_step(1)
    _raises(DivergenceError, r"loss diverged at step 2: .* > training.divergence_ratio=0.5 x the run's first "
            r"loss", lambda: tr.train_step(2))  # fmt: skip
    if rank == 1:
        next(p for p in tr.model.parameters() if p.to_local().numel()).to_local().detach().view(-1)[0] = (
            float("nan")
        )
    _raises(FaultError, r"refusing to save step 2: the model or optimizer state holds NaN/Inf",
            lambda: tr.save(2, 1e-3))  # fmt: skip
    tr.close()
    assert not (tmp / "div" / "checkpoints" / "step-2").exists()

    # 7. a signal on one rank (here: rank 1's flag set by hand) stops every rank at the same step
    #    boundary, which is saved (checkpoint.on_interrupt) although the interval is not due.
    from raggedfsdp.app.train.trainer import Interrupted, Trainer
    from raggedfsdp.app.train.watchdog import Interrupts

    ints = Interrupts(f"[rank {rank}/2]", announce=False)  # not installed: no real signal here
    out = tmp / "sigint"
    tr = Trainer(_cfg(out, checkpoint__interval=100), device=torch.device("cpu"), interrupts=ints)
    tr.train_step = _flag_at(tr.train_step, ints, rank)
    e = _raises(Interrupted, r"interrupted by SIGINT \(rank\(s\) \[1\]\) after step 2: saved .*step-2",
                tr.train)  # fmt: skip
    assert e.signum == 2
    tr.close()
    dist.barrier()
    assert integrity.verify_step_folder(out / "checkpoints" / "step-2") is None
    # the interrupted step's metrics record is kept (issue 23 item 5)
    assert 2 in _losses(out), (out / "metrics.jsonl").read_text()

    # 8. a checkpoint folder this rank may not write: one line naming the cause, the path and the
    #    rank; nothing under step-1.
    out = tmp / "eacces"
    tr = _trainer(_cfg(out, checkpoint__interval=1), "eacces@step1:rank1")
    _raises(CheckpointError, r"cannot save checkpoint .*step-1: Permission denied: '.*step-1\.tmp/__fault.distcp' "
            r"on rank 1$", tr.train)  # fmt: skip
    tr.close()
    dist.barrier()
    assert not (out / "checkpoints" / "step-1").exists()

    # 9. out of memory inside step 2's forward (every rank, so that no rank waits in a collective):
    #    each rank's one line names itself, the step, its batch and the cause.
    tr = _trainer(_cfg(tmp / "oom"), "oom@step2")
    from raggedfsdp.app.train.guard import ResourceError

    e = _raises(ResourceError, rf"out of memory on rank {rank} \(cpu\) at step 2 \(batch step2:rows{2 * rank}-"
                rf"{2 * rank + 1} \(rank {rank}, micro-step 0\)\): OutOfMemoryError: CUDA out of memory\. Tried "
                r"to allocate 2\.00 GiB .*; use smaller micro-batches", tr.train)  # fmt: skip
    assert e.culprits == (rank,) and "\n" not in str(e)
    tr.close()


def _nonfinite_cases(rank, world, tmp):
    """Issue 23 item 3: non-finite gradients and parameters named by the rank that holds them."""
    from raggedfsdp.app.train.guard import NonFiniteError

    tmp = Path(tmp)
    # 10. a NaN only in rank 1's gradients (its loss finite) is rank 1's: the flag is taken before the
    #     reduce-scatter, which spreads it to every rank's shard; rank 1 names its FSDP units.
    tr = _trainer(_cfg(tmp / "nangrad"), "nangrad@step2:rank1")
    tr.train_step(1)
    mine = (
        r" \(its own gradients of FSDP unit\(s\) layers\.1, layers\.0, \w+, before the reduce-scatter\)"
        if rank == 1
        else ""
    )
    e = _raises(NonFiniteError, rf"non-finite gradients on rank 1 at step 2 \(batch step2:rows2-3 \(rank 1, "
                rf"micro-step 0\)\){mine}; stopped", lambda: tr.train_step(2))  # fmt: skip
    assert e.culprits == (1,)
    tr.close()

    # 11. a NaN written into one parameter shard on rank 0 after step 2's update, checkpointing off:
    #     step 3's guard names rank 0 and the tensor (not the NaN loss it causes on every rank).
    tr = _trainer(_cfg(tmp / "nanparam", checkpoint__interval=0), "nanparam@step2:rank0")
    first = next(n for n, p in tr.model.named_parameters() if p.to_local().numel()) if rank == 0 else ""
    mine = rf": tensor {first}; stopped" if rank == 0 else "; stopped"
    e = _raises(NonFiniteError, r"non-finite parameters on rank 0 at step 3 \(as left by step 2's optimizer "
                rf"step or written since\){mine}", tr.train)  # fmt: skip
    assert e.culprits == (0,)
    tr.close()

    # 12. rank 1 reads other data from step 2 on (its corpus swapped mid-run): step 2's batch checksums,
    #     folded into the step's all-reduce, stop it naming both ranks of the disagreeing pair.
    import torch.distributed as dist

    from raggedfsdp.app.train import data_identity
    from raggedfsdp.app.train.data import DataError

    tr = _trainer(_cfg(tmp / "swap"), "swapdata@step2:rank1")
    calls = []  # the step's checks ride in its one fused all-reduce: no collective of their own
    real = {
        name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast")
    }

    def counted(name, fn):
        def call(*a, **k):
            where = sys._getframe(1).f_code.co_filename
            if f"app{os.sep}train{os.sep}" in where:  # the trainer's own (not FSDP's) collectives
                calls.append((name, os.path.basename(where)))
            return fn(*a, **k)

        return call

    for name, fn in real.items():
        setattr(dist, name, counted(name, fn))
    try:
        tr.train_step(1)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    assert calls == [("all_reduce", "guard.py")], calls
    e = _raises(DataError, r"ranks read different data at step 2: rank 0's batch step2:rows0-1 .* has checksum "
                r"\d+ on rank 0 but \d+ as rank 1 reads it from .*disagreeing pairs: 0/1, 1/0\); every rank",
                lambda: tr.train_step(2))  # fmt: skip
    assert e.culprits == (0, 1)
    tr.close()

    # 13. the start's corpus agreement (issue 23 item 1; one all_gather): rank 1's corpus swapped after its
    #     load stops the job at step 0. Without the launcher's fingerprint two ranks cannot tell which is
    #     wrong (both blamed); with it (REFERENCE_ENV, as `raggedfsdp train` writes it), rank 1 alone.
    cfg = _cfg(tmp / "swap0")
    e = _raises(DataError, r"^ranks read different data at step 0 \(the start\): ranks 0, 1 read a corpus that "
                r"differs from rank 1's corpus: rank 0's \d+ of \d+ file\(s\) under .* differ: .*\.py \(same size, other "
                r"content\).*; every rank must read the same files", lambda: _trainer(cfg, "swapdata@step0:rank1"))  # fmt: skip
    assert e.culprits == (0, 1)
    cfg = _cfg(tmp / "swap0ref")
    ref = data_identity.write_reference(cfg, tmp / f"fingerprint{rank}.json")
    e = _raises(DataError, r"ranks read different data at step 0 \(the start\): rank 1 read a corpus that differs "
                rf"from the corpus the pre-launch check saw \(python stdlib .*digest {ref.digest}\): rank 1's \d+ of "
                r"\d+ file\(s\) under .* differ: .*; rank\(s\) 0 read it; every rank", lambda: _trainer(cfg, "swapdata@step0:rank1"))  # fmt: skip
    assert e.culprits == (1,)
    #     a file truncated after the pre-launch check (every rank reads the truncated one): named, with sizes
    data = tmp / "corpus"
    if rank == 0:
        data.mkdir()
        for name in ("a.txt", "b.txt"):
            (data / name).write_text("".join(f"line {i} of {name}\n" for i in range(400)))
    dist.barrier()
    cfg = _cfg(tmp / "trunc", data__path=str(data))
    data_identity.write_reference(cfg, tmp / f"fingerprint{rank}.json")
    dist.barrier()
    whole = (data / "b.txt").read_bytes()
    cut = whole[: whole.rindex(b"\n", 0, 3000) + 1]  # whole lines: no newline appended by the loader
    dist.barrier()
    if rank == 0:
        (data / "b.txt").write_bytes(cut)
    dist.barrier()
    e = _raises(DataError, r"ranks 0, 1 read a corpus that differs from the corpus the pre-launch check saw .*: "
                rf"rank 0's 1 of 2 file\(s\) under {data} differ: b.txt \({len(cut)} tokens, {len(whole)} in the pre-launch "
                r"check\); "
                r"every rank read the same changed data", lambda: _trainer(cfg))  # fmt: skip
    assert e.culprits == (0, 1)
    os.environ.pop(data_identity.REFERENCE_ENV)
    tr = _trainer(_cfg(tmp / "trunc2", data__path=str(data)))  # no reference: the ranks agree with each other
    tr.close()

    _straggler_case(rank, world, tmp)  # 14. issue 23 item 7, in this spawn
    _truncated_token_file_case(rank, world, tmp)  # 15. a .bin cut mid-run, in this spawn


def _truncated_token_file_case(rank, world, tmp):
    """A ``.bin`` cut to half its size in place between two steps (``truncate@stepN``, every rank: as a
    shared file system shows it to all) is a ``DataError`` on every rank, naming the rank, step, batch,
    file, token and byte offsets, the sizes and the fix, before any collective of that step (a
    memory-mapped read past the new end used to kill the rank with SIGBUS, nothing recorded)."""
    import re

    import numpy as np
    import torch.distributed as dist

    from raggedfsdp.app.train.data import BatchSampler, DataError, load_corpus, write_token_bin

    path = Path(tmp) / "tokens.bin"
    ids = np.frombuffer("".join(f"line {i}: the quick brown fox\n" for i in range(600)).encode(), np.uint8)
    if rank == 0:
        write_token_bin(path, [ids], vocab_size=256)
    dist.barrier()
    size = path.stat().st_size
    half = size // 2 // 4 * 4 // 2  # tokens left by the fault
    cfg = _cfg(Path(tmp) / "tbin", data__path=str(path), training__steps=20)
    corpus = load_corpus(str(path), max_bytes=cfg.data.max_bytes, val_fraction=cfg.data.val_fraction)
    # the batches are a function of (seed, step): the first step whose batch reads past the cut on every rank
    s = BatchSampler(corpus.train, seq_len=32, global_batch_size=4, world_size=world, seed=cfg.job.seed)
    t = s.seq_len + 1

    def past(step, r):  # the first window of rank r's batch that crosses the new end, or None
        return next((o for o in s.global_offsets(step)[s.rows(0, r).start : s.rows(0, r).stop] if o + t > half),
                    None)  # fmt: skip

    step = next(n for n in range(2, 20) if all(past(n, r) is not None for r in range(world)))
    tr = _trainer(cfg, f"truncate@step{step}")
    for n in range(1, step):
        tr.train_step(n)
    o = int(past(step, rank))
    _raises(DataError, rf"^rank {rank}, step {step}: batch step{step}:rows\d+-\d+ \(rank {rank}, micro-step 0\): "
            rf"token file '{re.escape(str(path))}' was truncated while the job read it: tokens {o}-{o + t - 1} \(bytes {2 * o}-"
            rf"{2 * (o + t) - 1}\) are past its end \({2 * half} bytes now, {size} when the job opened it\); a file "
            r"must not change while a job reads it: restore it \(or write a new one under another name\) and "
            r"resume with --resume auto$", lambda: tr.train_step(step))  # fmt: skip
    assert path.stat().st_size == 2 * half
    tr.close()


def _straggler_case(rank, world, tmp):
    """Issue 23 item 7: a rank made slow before one FSDP unit's forward is named, with that unit, in
    every log step's metrics.jsonl record and the console line; a slow step start is blamed on the
    first unit reached (the root)."""
    from raggedfsdp.app.train.straggler import describe

    for unit, want in (("layers.1", "layers.1"), ("", "root")):
        out = Path(tmp) / f"slow-{want}"
        cfg = _cfg(out, training__steps=3, debug__slow_rank=1, debug__slow_s=0.25, debug__slow_unit=unit)
        tr = _trainer(cfg)
        tr.train()
        tr.close()
        if rank == 0:
            recs = [
                r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
            ]
            assert len(recs) == 3 and all("straggler" in r for r in recs), recs
            for r in recs:
                st = r["straggler"]
                seen = [x["straggler"] for x in recs]
                assert (st["rank"], st["unit"]) == (1, want) and st["excess_pct"] > 100, seen
                assert 0.2 < st["excess_s"] < 0.6, seen
            assert describe(recs[-1]["straggler"]).startswith("slowest rank 1: +")
    _raises(ValueError, r"debug.slow_unit='nope' is not an FSDP unit of this model; one of \['root', 'layers.0'",
            lambda: _trainer(_cfg(Path(tmp) / "bad", debug__slow_rank=1, debug__slow_unit="nope")))  # fmt: skip


def test_data_changed_after_the_prelaunch_check_is_a_recorded_data_error(tmp_path):
    """Issue 23 item 5: a rank whose own check finds the data file truncated (here: empty) after the
    launcher's check records a DataError naming the file for the launcher's last line (it used to
    exit 2 "without recording an error"). One worker process as torchrun starts it, no launch."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from raggedfsdp.app.launch.failures import REPORTED_ENV, failure_report

    data = tmp_path / "data.txt"
    data.write_bytes(b"")  # what the pre-launch check saw was 200 kB; truncated since
    err_file = tmp_path / "error.json"
    env = {**_env(), "TORCHELASTIC_ERROR_FILE": str(err_file), REPORTED_ENV: "1"}
    cmd = [
        sys.executable,
        "-m",
        "raggedfsdp.app.launch.worker",
        *ARGS,
        "--data",
        str(data),
        "--out",
        str(tmp_path / "o"),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "error" not in proc.stderr, proc.stderr  # the launcher prints it
    failure = ProcessFailure(local_rank=0, pid=proc.pid if hasattr(proc, "pid") else 1, exitcode=2,
                             error_file=str(err_file))  # fmt: skip
    _, last = failure_report(ChildFailedError("w", {0: failure}), 2, details="OUT/failure.log")
    assert last == (
        f"raggedfsdp train: [rank 0/2] error: DataError: data file {str(data)!r} is empty (0 bytes) (found by rank 0 "
        "after the launch: changed after the pre-launch check?) (every rank's report: OUT/failure.log)"
    ), last


def _flag_at(train_step, ints, rank):
    def step(s):
        if s == 2 and rank == 1:
            ints.signum = signal.SIGINT  # as the handler does
        return train_step(s)

    return step


def _trainer_faults(rank, world):
    _cases(rank, world, case_tmpdir())


def _nonfinite(rank, world):
    _nonfinite_cases(rank, world, case_tmpdir())


# The Trainer sub-cases above share one 2-rank spawn (tests/_cases.py); each test asserts on its own part.
SPAWN = SharedSpawns(
    {"trainer_faults": "test_train_faults._trainer_faults", "nonfinite": "test_train_faults._nonfinite"},
    {2: [("trainer_faults", ()), ("nonfinite", ())]},
    timeout=600,
)


def test_trainer_faults_at_two_ranks():
    SPAWN.check(2, "trainer_faults")


def test_nonfinite_gradient_and_parameter_named_by_rank_at_two_ranks():
    SPAWN.check(2, "nonfinite")


# -- real launches -------------------------------------------------------------------------------

ARGS = [
    "--model", "debug", "--batch-size", "4", "--seq-len", "32", "--data.max_bytes", "200000",
    "--optimizer.warmup_steps", "1", "--metrics.eval_batches", "1", "--log-every", "1",
]  # fmt: skip


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("raggedfsdp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "raggedfsdp.app.cli"]


def _env(fault: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "RAGGEDFSDP_OUT_LOCK_HELD")}
    env["RAGGEDFSDP_FAULT"] = fault
    return env


def _last_line(stderr: str, out: Path) -> str:
    """A failed job ends in ONE error line, the root cause's, and prints no torchrun failure table, no
    torchrun log line and no error line of another rank (issue 23): returns that line."""
    lines = stderr.strip().splitlines()
    assert [ln for ln in lines if " error: " in ln] == [lines[-1]], stderr
    for noise in ("FAILED", "Root Cause", "closing signal", "exitcode", "Traceback", "frame #"):
        assert noise not in stderr, stderr
    assert lines[-1].endswith(f" (every rank's report: {out / 'failure.log'})"), lines[-1]
    assert lines[-1] in (out / "failure.log").read_text()
    return lines[-1]


def _fault_time(stderr: str) -> float:
    """The wall time of the injected fault (``faults.FaultPlan.take`` logs it)."""
    import re

    m = re.search(r"debug: injecting fault \S+ \(t=([0-9.]+)\)", stderr)
    assert m, stderr
    return float(m.group(1))


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(proc, text: str, timeout: float = 90) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} not seen in time:\n{''.join(lines)}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigint_saves_at_the_step_boundary_then_the_launchers_death_leaves_no_orphans(tmp_path):
    """Ctrl-C (SIGINT to the launcher): every rank stops at the same step boundary, the job saves
    that step, prints one line and exits 130; the saved step resumes. Then kill -9 of a launcher
    mid-run: its ranks exit within seconds (PR_SET_PDEATHSIG), none keeps training."""
    out = tmp_path / "int"
    cmd = [*_cli(), "train", "--nproc", "2", *ARGS, "--steps", "400", "--checkpoint-interval", "1000",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for(proc, "step   3/400")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert lines[-1] == f"raggedfsdp train: interrupted by SIGINT; resume with --resume auto --out {out}", err
    assert "Traceback" not in err and len(lines) < 40, err
    saved = [ln for ln in lines if "interrupted by SIGINT (rank(s) [0, 1]) after step" in ln]
    assert len(saved) == 1 and "saved " in saved[0], err
    step = int(saved[0].split("after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step-{step}" / "manifest.json").is_file()
    assert elapsed < 40, f"{elapsed:.1f}s from SIGINT to the job's end"

    # kill -9 the launcher of a second job: the ranks must not outlive it, nor print C++ stacks
    # (issue 23 item 5: their teardown no longer calls the store that died with the launcher).
    out2 = tmp_path / "orphan"
    cmd[cmd.index(str(out))] = str(out2)
    err_file = open(tmp_path / "orphan.err", "w")  # noqa: SIM115 (the ranks inherit it)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, env=_env())
    _wait_for(proc, "step   2/400")
    ranks = _children(proc.pid)
    assert len(ranks) == 2, ranks
    t0 = time.monotonic()
    proc.kill()
    proc.wait()
    while any(map(_alive, ranks)) and time.monotonic() - t0 < 20:
        time.sleep(0.1)
    assert not any(map(_alive, ranks)), f"orphaned ranks {ranks} still running"
    err_file.close()
    err = (tmp_path / "orphan.err").read_text()
    assert "frame #" not in err and "recvValue failed" not in err and "Traceback" not in err, err


def test_hung_rank_is_named_well_before_the_pg_timeout(tmp_path):
    """Rank 1 sleeps outside any collective at step 3: with --job.hang_timeout_s 3 (process-group
    timeout 120 s) the job ends in seconds and the last line names rank 1, not the waiting rank 0."""
    cmd = [*_cli(), "train", "--nproc", "2", *ARGS, "--steps", "6", "--out", str(tmp_path / "o"),
           "--job.hang_timeout_s", "3", "--job.pg_timeout_s", "120"]  # fmt: skip
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=150, env=_env("hang@step3:rank1")
    )
    elapsed = time.time() - _fault_time(proc.stderr)
    assert proc.returncode == 1, proc.stderr
    last = _last_line(proc.stderr, tmp_path / "o")
    assert last.startswith("raggedfsdp train: [rank 1/2] error: HangError: rank 1 made no progress for 3."), (
        last
    )
    assert "at step 3, phase: train" in last and "faults.py" in last and "not in a collective" in last, last
    assert "[rank 1/2] main thread's Python stack:" in proc.stderr
    assert elapsed < 40, f"{elapsed:.1f}s from the hang to the job's end (process-group timeout: 120 s)"


def test_rank_frozen_inside_a_save_is_named_before_the_pg_timeout(tmp_path):
    """Issue 23 item 2: rank 1 sleeps forever inside the checkpoint save of step 2, after writing its
    shards (``--debug.fail_mode savehang``), while rank 0 waits in DCP's collective. Saves are watched
    (they were not), with the longest limit below the process-group timeout (0.6 x 20 s), so the last
    line names rank 1, its step and "phase: save", not rank 0's collective timeout, within 45 s."""
    out = tmp_path / "o"
    cmd = [*_cli(), "train", "--nproc", "2", *ARGS, "--steps", "4", "--checkpoint-interval", "2", "--out",
           str(out), "--debug.fail_rank", "1", "--debug.fail_step", "2", "--debug.fail_mode", "savehang",
           "--job.pg_timeout_s", "20"]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=150, env=_env())
    elapsed = time.time() - _fault_time(proc.stderr)
    assert proc.returncode == 1, proc.stderr
    last = _last_line(proc.stderr, out)
    assert last.startswith(
        "raggedfsdp train: [rank 1/2] error: HangError: rank 1 made no progress for 12."
    ), last
    assert "(hang timeout 12s: in a save: 0.6 x job.pg_timeout_s=20) at step 2, phase: save" in last, last
    assert "faults.py" in last and "in write_data, not in a collective" in last, last
    assert elapsed < 45, f"{elapsed:.1f}s from the hang to the job's end"


def test_rank_reading_other_data_is_named_at_the_start(tmp_path):
    """Issue 23 items 1 and 5: rank 1's corpus differs from what the pre-launch check saw (swapped after
    its load). The start's corpus agreement stops the job at step 0 and the last line is rank 1's (the
    launcher's fingerprint in OUT/data_fingerprint.json tells which rank is wrong; the tag used to
    name whichever rank exited first), naming the files."""
    out = tmp_path / "o"
    cmd = [*_cli(), "train", "--nproc", "2", *ARGS, "--steps", "3", "--out", str(out)]
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=150, env=_env("swapdata@step0:rank1")
    )
    assert proc.returncode == 1, proc.stderr
    last = _last_line(proc.stderr, out)
    digest = json.loads((out / "data_fingerprint.json").read_text())["digest"]
    assert last.startswith(
        "raggedfsdp train: [rank 1/2] error: DataError: ranks read different data at step 0 (the start): rank 1 "
        "read a corpus that differs from the corpus the pre-launch check saw (python stdlib"
    ), last
    assert f"digest {digest}): rank 1's " in last and ".py (same size, other content)" in last, last
    assert "rank(s) 0 read it" in last and not (out / "metrics.jsonl").exists(), last


def test_nonfinite_loss_stops_the_launched_job_naming_rank_step_and_batch(tmp_path):
    out = tmp_path / "o"
    cmd = [*_cli(), "train", "--nproc", "2", *ARGS, "--steps", "5", "--checkpoint-interval", "1",
           "--checkpoint.keep_latest", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=150, env=_env("nan@step3:rank1")
    )
    elapsed = time.time() - _fault_time(proc.stderr)
    assert proc.returncode == 1, proc.stderr
    last = _last_line(proc.stderr, out)  # printed once, by the launcher (not by rank 1, then rank 0)
    assert last.startswith(
        "raggedfsdp train: [rank 1/2] error: NonFiniteError: non-finite loss on rank 1 at step 3 "
        "(batch step3:rows2-3 (rank 1, micro-step 0)); stopped before the optimizer step, nothing saved"
    ), last
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    # the batch id of the error line reproduces the sample (no launch)
    rc = cli_main(["train", *ARGS, "--reproduce-batch", "step3:rows2-3"])
    assert rc == 0
    assert elapsed < 30, f"{elapsed:.1f}s from the fault to the job's end"


@pytest.mark.core
def test_prelaunch_refusals(tmp_path, capsys):
    """No launch: a byte-flipped --resume PATH, a second job on a locked --out, a fresh run into an
    --out that holds one, --resume auto without --out: one line each, exit 2."""
    from raggedfsdp.app.train.run_dir import OutLock

    out = tmp_path / "o"
    step = out / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (out / "run.json").write_text('{"run_id": "abc"}')
    # a minimal DCP-looking folder whose manifest does not match its shard
    import torch
    import torch.distributed.checkpoint as dcp

    from raggedfsdp.app.checkpoint.integrity import file_digest, write_manifest

    dcp.save({"model": {"w": torch.ones(3)}, "train": {"step": torch.tensor(2)}}, checkpoint_id=str(step),
             no_dist=True)  # fmt: skip
    files = {p.name: file_digest(p) for p in step.iterdir()}
    write_manifest(step, run_id="abc", step=2, files=files)
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    cases = [
        (["--resume", str(step), "--out", str(tmp_path / "new")],
         f"corrupt checkpoint: {step}: {shard.name} fails its SHA-256 check"),
        (["--out", str(out)], f"--out {out} already holds a run (run abc; checkpoints step-2)"),
        (["--resume", "auto"], "--resume auto needs --out"),
    ]  # fmt: skip
    lock = OutLock(out).acquire()
    try:
        cases.append((["--out", str(out), "--resume", "auto"], f"--out {out} is in use by another job (pid"))
        for argv, want in cases:
            rc = cli_main(["train", "--nproc", "2", *ARGS, "--steps", "3", *argv])
            err = capsys.readouterr().err
            assert rc == 2, err
            assert err.strip().splitlines()[-1].startswith(f"raggedfsdp train: error: {want}"), err
    finally:
        lock.release()
    assert not (tmp_path / "new").exists()


def _stderr_reader(proc):
    """Collect ``proc``'s stderr lines in a thread; returns the list (appended to as they come)."""
    import threading

    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return lines


def _wait_line(lines, text, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not any(text in ln for ln in lines):
        assert proc.poll() is None and time.monotonic() < deadline, f"{text!r} not seen:\n{''.join(lines)}"
        time.sleep(0.05)


def _losses(out):
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc")
def test_ctrl_c_mid_save_keeps_the_previous_checkpoint_and_resumes_exactly(tmp_path):
    """Ctrl-C (SIGINT to the job's whole process group, as a terminal sends it) while step 4 is being
    written (``slowsave``: each rank sleeps between its shard files and the ``.metadata``/manifest/rename).

    1. Ctrl-C twice: the ranks give up at once (exit 130, one last line); what is on disk is a partial
       ``step-4.tmp`` (shards, no ``.metadata``, no manifest), which ``--resume auto`` ignores; step-2 survives.
    2. ``--resume auto`` resumes step-2 and repeats steps 3-4 bit for bit (same losses); a single Ctrl-C
       during its save of step 4 lets that save complete, then the job stops (exit 130) instead of
       training on; step-4 verifies and the stale ``step-4.tmp`` is gone."""
    from raggedfsdp.app.checkpoint import integrity
    from raggedfsdp.app.checkpoint.dcp import resolve_resume

    out = tmp_path / "o"
    ck = out / "checkpoints"
    cmd = [*_cli(), "train", "--nproc", "2", *ARGS, "--steps", "6", "--checkpoint-interval", "2",
           "--out", str(out)]  # fmt: skip
    env = {**_env("slowsave@step4"), "RAGGEDFSDP_FAULT_SLEEP_S": "60"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    err = _stderr_reader(proc)
    _wait_line(err, "debug: slow save", proc)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(2.5)  # past the ranks' grace period (train/watchdog.py: GRACE_S): the second one is final
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)
    elapsed = time.monotonic() - t0
    time.sleep(0.2)
    lines = "".join(err).strip().splitlines()
    assert proc.returncode == 130, "".join(err)
    assert lines[-1] == f"raggedfsdp train: interrupted by SIGINT; resume with --resume auto --out {out}", (
        lines
    )
    assert "Traceback" not in "".join(err), "".join(err)
    assert elapsed < 30, f"{elapsed:.1f}s from the first Ctrl-C to the job's end"
    partial = ck / "step-4.tmp"
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4.tmp"]
    assert list(partial.glob("*.distcp")) and not (partial / "manifest.json").exists()
    assert integrity.verify_step_folder(ck / "step-2") is None
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    notes: list[str] = []
    assert resolve_resume("auto", ck, run_id=run_id, notes=notes) == ck / "step-2"
    assert notes and "ignoring unfinished save(s) step-4.tmp" in notes[0], notes
    before = _losses(out)
    assert set(before) >= {1, 2, 3, 4}, before

    env["RAGGEDFSDP_FAULT_SLEEP_S"] = "3"
    proc = subprocess.Popen([*cmd, "--resume", "auto"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    err = _stderr_reader(proc)
    _wait_line(err, "debug: slow save", proc)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=90)
    time.sleep(0.2)
    text = "".join(err)
    assert proc.returncode == 130, text
    assert "ignoring unfinished save(s) step-4.tmp" in text, text
    done = [ln for ln in text.splitlines() if "during the save of step 4, which completed: saved" in ln]
    assert len(done) == 1 and "interrupted by SIGINT (rank(s) [0, 1])" in done[0], text
    assert text.strip().splitlines()[-1].startswith("raggedfsdp train: interrupted"), text
    after = _losses(out)
    assert max(after) == 4, after  # stopped after the save: step 5 never ran
    assert [after[s] for s in (3, 4)] == [before[s] for s in (3, 4)], (before, after)
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4"]
    assert integrity.verify_step_folder(ck / "step-4") is None


@pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("setpriv")),
    reason="needs root and setpriv to run the launcher as an unprivileged user",
)
def test_unwritable_out_is_one_line_before_the_launch(tmp_path):
    """``--out`` under a folder the user may not write (a real EACCES: the launcher runs as
    ``nobody``): exit 2, one line naming the cause and the path, no launch."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o755)  # root's; nobody may not create anything in it (nor pass pytest's 0700 base)
    home = tmp_path / "home"
    home.mkdir(mode=0o777)
    home.chmod(0o777)
    cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *_cli(), "train", *ARGS,
           "--steps", "2", "--out", str(locked / "o")]  # fmt: skip
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=120, env={**_env(), "HOME": str(home)}
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    o = locked / "o"  # the path named is the first one the user could not touch (o, or o/run.json)
    assert last.startswith(f"raggedfsdp train: error: cannot use --out {o}: Permission denied: '{o}"), (
        proc.stderr
    )
    assert last.endswith("' (choose a path this user can write)"), proc.stderr
    assert "Traceback" not in proc.stderr and "launching" not in proc.stderr
