"""Launcher-side errors of the console script: a mistyped flag names the closest real flags, a CUDA
job without a usable GPU fails before any rank starts, and the public error type is exported."""

import pytest
import torch

from raggedfsdp.app.cli import main


def test_unknown_flag_names_the_closest_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--trainig.steps", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --trainig.steps 3" in err
    assert "did you mean --training.steps" in err


def test_unknown_flag_without_a_close_match_still_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama3-8b", "-m", "8", "--zzzzzzzz"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzzzz" in err and "did you mean" not in err


@pytest.mark.parametrize("visible", [0, 1])
def test_cuda_job_fails_before_launch_without_enough_gpus(monkeypatch, capsys, tmp_path, visible):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    rc = main(["train", "--nproc", "2", "--job.device", "cuda", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "job.device='cuda'" in err
    assert (
        ("sees no CUDA device" in err)
        if visible == 0
        else ("only 1 CUDA device(s)" in err and "--nproc 1" in err)
    )
    assert "launching" not in err  # no rank was started


def test_ragged_shard_op_error_is_public():
    import raggedfsdp
    from raggedfsdp.placement import RaggedShardOpError
    from raggedfsdp.placement._ops import RaggedShardOpError as inner

    assert raggedfsdp.RaggedShardOpError is RaggedShardOpError is inner
    assert issubclass(RaggedShardOpError, RuntimeError)


@pytest.mark.parametrize(
    "argv",
    [["train", "--bogus-flag", "1"], ["train", "--training.steps", "abc"], ["plan", "--model"], ["nosuch"]],
    ids=["unknown", "bad-value", "missing-value", "bad-command"],
)
def test_argument_error_is_one_line_without_the_usage(capsys, argv):
    """A bad flag prints one error line ending in "see ... --help", not argparse's usage block first
    (~100 lines for train; trial finding 6)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("raggedfsdp") and "error: " in err, err
    if argv[1:2] != ["--training.steps"]:  # argparse's errors end so; train's value check names the field
        cmd = "raggedfsdp" if argv[0] == "nosuch" else f"raggedfsdp {argv[0]}"
        assert err.rstrip().endswith(f"see {cmd} --help"), err


def test_plot_of_a_missing_file_exits_2_with_a_clean_message(capsys, tmp_path):
    """Like every command's missing path (trial finding 7): exit 2, the path named, no errno text."""
    rc = main(["plot", str(tmp_path / "nosuch.jsonl"), "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "nosuch.jsonl' does not exist" in err and "Errno" not in err
    assert not (tmp_path / "x.png").exists()
