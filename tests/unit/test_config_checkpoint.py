"""[checkpoint] config: defaults, TOML/CLI, validation, and --resume path resolution."""

from __future__ import annotations

import argparse

import pytest

from raggedfsdp.app.checkpoint.dcp import CheckpointError, config_hash, resolve_resume
from raggedfsdp.app.train.config import TrainConfig, add_config_args, load_config, overrides_from_args


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(argv)
    return load_config(args.config, overrides_from_args(args))


def test_defaults():
    c = TrainConfig().checkpoint
    assert (c.interval, c.folder, c.keep_latest, c.resume) == (0, "", 2, "")
    assert c.resolved_folder("outputs/x") == "outputs/x/checkpoints"


def test_toml_and_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[checkpoint]\ninterval = 50\nfolder = "/ck"\nkeep_latest = 0\n')
    cfg = _parse(["--config", str(path), "--resume", "auto", "--checkpoint-interval", "10"])
    c = cfg.checkpoint
    assert (c.interval, c.folder, c.keep_latest, c.resume) == (10, "/ck", 0, "auto")
    assert c.resolved_folder("ignored") == "/ck"


@pytest.mark.parametrize("key", ["interval", "keep_latest"])
def test_negative_is_an_error(key):
    with pytest.raises(ValueError, match=f"checkpoint.{key} must be >= 0"):
        _parse([f"--checkpoint.{key}", "-1"])


def test_config_hash_ignores_output_and_checkpoint_options():
    a, b = TrainConfig(), TrainConfig()
    b.job.out, b.checkpoint.interval, b.metrics.log_every = "elsewhere", 5, 3
    assert config_hash(a.to_dict()) == config_hash(b.to_dict())
    b.optimizer.lr = 1.0
    assert config_hash(a.to_dict()) != config_hash(b.to_dict())


def test_resolve_resume(tmp_path):
    assert resolve_resume("", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "nothing") is None
    (tmp_path / "step-3").mkdir()  # incomplete (no .metadata): ignored by auto
    (tmp_path / "step-9.tmp").mkdir()
    assert resolve_resume("auto", tmp_path) is None
    with pytest.raises(CheckpointError, match="checkpoint not found: .*nope"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(CheckpointError, match=r"not a checkpoint: .*step-3 \(no DCP .metadata"):
        resolve_resume(str(tmp_path / "step-3"), tmp_path)
    (tmp_path / "step-3" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt checkpoint: .*step-3/.metadata"):
        resolve_resume(str(tmp_path / "step-3"), tmp_path)
    # auto takes only checkpoints that verify against a manifest: step-3 has none
    notes = []
    assert resolve_resume("auto", tmp_path, run_id="r1", notes=notes) is None
    assert notes == [
        (
            "--resume auto: ignoring unfinished save(s) step-9.tmp (interrupted while being written; never "
            "resumed from, deleted by the next save of that step)"
        ),
        (
            f"--resume auto: skipping {tmp_path / 'step-3'}: manifest.json missing (an incomplete save, "
            "or not written by raggedfsdp train)"
        ),
    ]


def test_resume_with_another_batch_names_the_changed_fields(tmp_path):
    """A resume whose config differs from the checkpoint's (trial finding 4: a new global batch) gets
    one notice naming each changed field with its saved and new value; the same config gets none."""
    import json

    from raggedfsdp.app.train.run_checkpoints import config_change_notice

    saved = TrainConfig()
    saved.training.global_batch_size, saved.training.steps = 4, 6
    (tmp_path / "meta.json").write_text(
        json.dumps({"config": saved.to_dict(), "config_hash": config_hash(saved.to_dict())})
    )
    now = TrainConfig()
    now.training.global_batch_size, now.training.steps = 6, 9
    notice = config_change_notice(now, tmp_path, config_hash(now.to_dict()))
    assert "training.global_batch_size: 4 -> 6" in notice and "training.steps: 6 -> 9" in notice, notice
    assert len(notice.splitlines()) == 1
    assert config_change_notice(saved, tmp_path, config_hash(saved.to_dict())) is None
