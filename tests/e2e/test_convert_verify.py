"""``raggedfsdp convert`` checks a checkpoint as ``train`` does (issue 41 item 1): a flipped byte, a
truncated shard and an unfinished ``step-N.tmp`` are each one line naming the file or folder (exit 2,
nothing written), where convert used to write weights off by up to 2.3e24 with exit 0, convert the
unfinished save silently, and end a truncated shard in a 40-line traceback. The checkpoint is a real
``save_checkpoint`` of one gloo rank (its manifest.json holds every file's SHA-256)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

from raggedfsdp.app.cli import main


def _save(rank, ws, folder):
    from raggedfsdp.app.checkpoint.dcp import save_checkpoint
    from raggedfsdp.app.models import build_model

    model = build_model("llama", "debug")
    model.init_weights(3)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(
        folder, 5, model=model, optimizer=opt, lr=0.1, seed=3, keep_latest=0, meta={}, run_id="r1"
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("convert") / "checkpoints"
    run_distributed(_save, 1, str(folder))
    return folder


def _convert(path: Path, out: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    rc = main(["convert", str(path), "--to", "torch", str(out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def _shard(step: Path) -> Path:
    return sorted(step.glob("*.distcp"))[0]


@pytest.mark.core
def test_convert_verifies_the_checkpoint_like_train(ckpt, tmp_path, capsys):
    # intact: converts, both from the step folder and from the folder of steps
    rc, err = _convert(ckpt, tmp_path / "ok.pt", capsys)
    assert rc == 0 and (tmp_path / "ok.pt").is_file(), err
    good = torch.load(tmp_path / "ok.pt")

    # one flipped byte: refused, naming the file and its SHA-256 check
    flip = tmp_path / "flip" / "step-5"
    shutil.copytree(ckpt / "step-5", flip)
    f = _shard(flip)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    rc, err = _convert(flip, tmp_path / "flip.pt", capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (
        f"raggedfsdp convert: error: corrupt checkpoint: {flip}: {f.name} fails its SHA-256 check (corrupted "
        "on disk) (use an older step-N, or --no-verify to load it unchecked)"
    ), err
    assert not (tmp_path / "flip.pt").exists()

    # a truncated shard: one line naming the file, with or without the check
    trunc = tmp_path / "trunc" / "step-5"
    shutil.copytree(ckpt / "step-5", trunc)
    f = _shard(trunc)
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:100])
    rc, err = _convert(trunc.parent, tmp_path / "trunc.pt", capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"{trunc}: {f.name} has 100 bytes, the manifest says {size} (truncated?)" in err[0], err
    rc, err = _convert(trunc, tmp_path / "trunc.pt", capsys, "--no-verify")
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"raggedfsdp convert: error: cannot read checkpoint {trunc}: "), err
    assert not (tmp_path / "trunc.pt").exists()

    # an unfinished save (step-N.tmp, even one whose files are all there): refused, naming the one to use
    unfinished = ckpt / "step-6.tmp"
    shutil.copytree(ckpt / "step-5", unfinished)
    try:
        rc, err = _convert(unfinished, tmp_path / "tmp.pt", capsys)
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"raggedfsdp convert: error: unfinished save: {unfinished} "), err
        assert err[0].endswith(f"use {ckpt / 'step-5'}"), err
        rc, err = _convert(ckpt, tmp_path / "again.pt", capsys)  # the folder of steps skips it
        assert rc == 0, err
    finally:
        shutil.rmtree(unfinished)
    again = torch.load(tmp_path / "again.pt")
    assert good.keys() == again.keys() and all(torch.equal(good[k], again[k]) for k in good)


@pytest.mark.core
def test_convert_to_a_path_it_cannot_write_is_one_line(ckpt, tmp_path, capsys):
    """An output under a regular file (no folder can be made there): one line naming the path, exit 2
    (found by a fresh-user trial: it was torch.save's 18-line traceback)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, err = _convert(ckpt, blocker / "sub" / "out.pt", capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"raggedfsdp convert: error: cannot write {blocker / 'sub' / 'out.pt'}"), err
