"""A step folder holding another step's checkpoint (issue 41 item 10): ``step-6`` copied from
``step-2`` (its manifest and DCP state say step 2) was resumed without a word, the run then
continuing from step 2 under a folder named 6. Now an explicit ``--resume .../step-6`` is refused
before the launch with one line naming the folder and both steps, and ``--resume auto`` skips it with
a one-line note and takes the newest folder that is what it says. The reference is the test's own
copy (the step it came from). The checkpoint is a real ``save_checkpoint`` of the debug LLaMA at one
gloo rank; the CLI runs in-process and returns before starting torchrun."""

from __future__ import annotations

import shutil

import pytest
from _dist import run_distributed

from raggedfsdp.app.cli import main as cli_main


def _save(rank, ws, folder):
    from raggedfsdp.app.checkpoint.dcp import save_checkpoint
    from raggedfsdp.app.models import build_model

    import torch

    model = build_model("llama", "debug")
    model.init_weights(3)
    opt = torch.optim.AdamW(model.parameters())
    for step in (2, 4):
        save_checkpoint(folder, step, model=model, optimizer=opt, lr=0.1, seed=0, keep_latest=0,
                        meta={}, run_id="r1")  # fmt: skip


@pytest.mark.core
def test_a_step_folder_holding_another_step_is_refused_or_skipped(tmp_path, capsys):
    from raggedfsdp.app.checkpoint.dcp import resolve_resume

    folder = tmp_path / "checkpoints"
    run_distributed(_save, 1, str(folder))
    shutil.copytree(folder / "step-2", folder / "step-6")  # a copy by hand: its manifest says step 2
    out = tmp_path / "out"
    rc = cli_main(["train", "--nproc", "2", "--model", "debug", "--steps", "8", "--out", str(out),
                   "--resume", str(folder / "step-6")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (
        f"raggedfsdp train: error: wrong step folder: {folder / 'step-6'}: step-6 holds the checkpoint of "
        "step 2 (its manifest.json says step 2: copied or renamed by hand?); rename it to step-2 or "
        "resume another step-N"
    ), err
    assert not out.exists()
    notes: list[str] = []
    assert resolve_resume("auto", folder, run_id="r1", notes=notes) == folder / "step-4"
    assert notes == [
        f"--resume auto: skipping {folder / 'step-6'}: step-6 holds the checkpoint of step 2 (its "
        "manifest.json says step 2: copied or renamed by hand?)"
    ], notes
