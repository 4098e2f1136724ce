"""``run_dir.recover_run_file`` (issue 41 item 2): ``--resume auto`` with ``OUT/run.json`` missing or
unreadable continues the one run its checkpoints' manifests name, refuses when they name several or
when a fresh start would overwrite ``metrics.jsonl``; the end-to-end run is in
tests/e2e/test_resume_run_file.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raggedfsdp.app.checkpoint.integrity import write_manifest
from raggedfsdp.app.train.run_dir import read_run_id, recover_run_file, write_run_file


def _step(ck: Path, n: int, run_id: str) -> None:
    (ck / f"step-{n}").mkdir(parents=True)
    write_manifest(ck / f"step-{n}", run_id=run_id, step=n, files={})


def test_missing_run_json_is_recovered_from_the_manifests(tmp_path):
    ck = tmp_path / "checkpoints"
    _step(ck, 2, "abc")
    _step(ck, 4, "abc")
    (ck / "step-6.tmp").mkdir()  # an unfinished save names no run
    note = recover_run_file(tmp_path, ck)
    assert read_run_id(tmp_path) == "abc"
    assert note == (
        f"--resume auto: {tmp_path / 'run.json'} was missing; continuing run abc, named by the manifests of "
        "its checkpoints (step-4, step-2), and wrote run.json again"
    )
    assert recover_run_file(tmp_path, ck) is None  # intact now: nothing to do


def test_unreadable_run_json_is_kept_aside(tmp_path):
    ck = tmp_path / "checkpoints"
    _step(ck, 3, "abc")
    for bad in ("{not json", json.dumps({"created": 1}), json.dumps(["abc"])):
        (tmp_path / "run.json").write_text(bad)
        note = recover_run_file(tmp_path, ck)
        assert note is not None and "was unreadable (" in note and "kept as run.json.unreadable" in note
        assert read_run_id(tmp_path) == "abc"
        assert (tmp_path / "run.json.unreadable").read_text() == bad


def test_checkpoints_of_several_runs_are_refused_naming_them(tmp_path):
    ck = tmp_path / "checkpoints"
    _step(ck, 2, "old")
    _step(ck, 5, "new")
    with pytest.raises(ValueError) as e:
        recover_run_file(tmp_path, ck)
    msg = str(e.value)
    assert "run.json is missing and the checkpoints under" in msg
    assert "belong to 2 runs (run new: step-5; run old: step-2); nothing was changed" in msg
    assert msg.endswith(f"--resume {ck / 'step-5'}")
    assert not (tmp_path / "run.json").exists()


def test_no_checkpoint_but_metrics_is_refused_unless_overwrite(tmp_path):
    ck = tmp_path / "checkpoints"
    assert recover_run_file(tmp_path, ck) is None  # a first --resume auto into a new folder
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(
        ValueError, match=r"would start from step 0 and overwrite .*metrics.jsonl; start over"
    ):
        recover_run_file(tmp_path, ck)
    assert recover_run_file(tmp_path, ck, overwrite=True) is None
    write_run_file(tmp_path, "abc")
    assert recover_run_file(tmp_path, ck) is None  # run.json intact: not this function's business
