"""Byte corpus loading and the deterministic per-rank batch sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raggedfsdp.app.train.data import BatchSampler, eval_windows, load_corpus, stdlib_source_files, windows

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def _tokens(n: int = 10_000) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_stdlib_corpus_is_found_sorted_and_capped():
    files = stdlib_source_files()
    names = {f.name for f in files}
    assert {"os.py", "functools.py"} <= names
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert len(files) > 100
    corpus = load_corpus(max_bytes=300_000, val_fraction=0.1)
    assert len(corpus.train) + len(corpus.val) == 300_000
    assert len(corpus.val) == 30_000
    assert corpus.train.dtype == torch.uint8
    assert b"def " in bytes(corpus.train[:100_000].tolist())
    again = load_corpus(max_bytes=300_000, val_fraction=0.1)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)


def test_data_path_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# title\n" * 50)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    one = load_corpus(str(tmp_path / "a.txt"), max_bytes=0, val_fraction=0.1)
    assert len(one.train) + len(one.val) == 600 and one.num_files == 1
    folder = load_corpus(str(tmp_path), max_bytes=0, val_fraction=0.1)
    assert folder.num_files == 2 and len(folder.train) + len(folder.val) == 600 + 400
    assert 0 not in torch.cat([folder.train, folder.val]).tolist()
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        load_corpus(str(tmp_path / "missing"))


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="../shared/data/tinyshakespeare.txt not present")
def test_tinyshakespeare_file():
    corpus = load_corpus(str(SHAKESPEARE), max_bytes=0, val_fraction=0.1)
    assert len(corpus.train) + len(corpus.val) == SHAKESPEARE.stat().st_size
    assert bytes(corpus.train[:9].tolist()) == b"First Cit"


def test_sampler_is_deterministic_in_seed_and_step():
    toks = _tokens()
    s = BatchSampler(toks, seq_len=32, global_batch_size=8, seed=5)
    x1, y1 = s.get(step=3)
    x2, y2 = BatchSampler(toks, seq_len=32, global_batch_size=8, seed=5).get(step=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (8, 32) and x1.dtype == torch.int64
    assert not torch.equal(x1, s.get(step=4)[0])
    assert not torch.equal(x1, BatchSampler(toks, seq_len=32, global_batch_size=8, seed=6).get(step=3)[0])
    torch.testing.assert_close(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one


@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_rank_slices_are_disjoint_and_cover_the_global_batch(world_size, grad_accum):
    toks = _tokens()
    G = 16
    ref = BatchSampler(toks, seq_len=16, global_batch_size=G, seed=1)
    for step in (1, 7):
        full_x, _ = ref.get(step)  # (G, T) at world size 1: the global batch
        seen_rows: list[int] = []
        pieces = []
        for rank in range(world_size):
            s = BatchSampler(
                toks,
                seq_len=16,
                global_batch_size=G,
                world_size=world_size,
                rank=rank,
                grad_accum=grad_accum,
                seed=1,
            )
            assert s.micro_batch_size == G // (world_size * grad_accum)
            for micro in range(grad_accum):
                seen_rows += list(s.rows(micro))
                pieces.append(s.get(step, micro)[0])
        assert sorted(seen_rows) == list(range(G))  # disjoint and covering
        assert torch.equal(torch.cat(pieces), full_x)  # same global batch at any world size


def test_sampler_rejects_bad_splits():
    with pytest.raises(ValueError, match="not divisible"):
        BatchSampler(_tokens(), seq_len=8, global_batch_size=6, world_size=4)
    with pytest.raises(ValueError, match="out of range"):
        BatchSampler(_tokens(), seq_len=8, global_batch_size=8, world_size=2, rank=2)
    with pytest.raises(ValueError, match="at least"):
        BatchSampler(_tokens(10), seq_len=16, global_batch_size=2)


def test_windows_stay_in_range():
    toks = _tokens(100)
    s = BatchSampler(toks, seq_len=98, global_batch_size=64, seed=0)  # offsets in {0, 1}
    offs = np.concatenate([s.global_offsets(step) for step in range(20)])
    assert set(offs.tolist()) == {0, 1}
    ev = eval_windows(100, seq_len=10, count=7)
    assert ev[0] == 0 and ev[-1] == 89 and len(ev) == 7
    x, y = windows(toks, ev, 10)
    assert x.shape == y.shape == (7, 10)
    with pytest.raises(ValueError, match="shorter than"):
        eval_windows(5, seq_len=10, count=1)


# -- pre-launch checks of the data source (check_data) -----------------------------------------


def _check(path, seq_len=16, max_bytes=0, val_fraction=0.1):
    from raggedfsdp.app.train.data import check_data

    return check_data(str(path), max_bytes=max_bytes, val_fraction=val_fraction, seq_len=seq_len)


def test_check_data_names_missing_and_empty_sources(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bin_dir").mkdir()
    (tmp_path / "bin_dir" / "x.bin").write_bytes(b"\0\1\2" * 10)
    (tmp_path / "blank_dir").mkdir()
    (tmp_path / "blank_dir" / "a.txt").write_bytes(b"")
    cases = {
        "missing": "not found (neither a file nor a folder)",
        "empty.txt": "is empty (0 bytes)",
        "empty_dir": "is empty: it has no files",
        "bin_dir": "has no readable text files (1 file(s) skipped as binary or unreadable)",
        "blank_dir": "is empty: its 1 text file(s) have 0 bytes",
    }
    for name, cause in cases.items():
        path = str(tmp_path / name)
        with pytest.raises(ValueError) as exc:
            _check(path)
        assert repr(path) in str(exc.value) and cause in str(exc.value), str(exc.value)


@pytest.mark.parametrize("name", ["empty.txt", "empty_dir", "bin_dir"])
def test_load_corpus_reports_empty_sources_clearly(tmp_path, name):
    """Not numpy's 'both buffer length (0) and count (-1) must not be 0'."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bin_dir").mkdir()
    (tmp_path / "bin_dir" / "x.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="empty|no readable text files") as exc:
        load_corpus(str(tmp_path / name))
    assert str(tmp_path / name) in str(exc.value)


def test_check_data_size_matches_load_corpus(tmp_path):
    """The pre-launch size is exactly what load_corpus reads (newlines appended, cap applied)."""
    (tmp_path / "a.txt").write_bytes(b"no trailing newline")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("line\n" * 300)
    (tmp_path / "blob.bin").write_bytes(b"\0\1" * 100)
    (tmp_path / "e.txt").write_bytes(b"")
    for path, max_bytes in [
        (tmp_path, 0),
        (tmp_path, 1000),
        (tmp_path / "a.txt", 0),
        (tmp_path / "a.txt", 7),
        ("", 50_000),
    ]:
        corpus = load_corpus(str(path), max_bytes=max_bytes, val_fraction=0.5)
        size = _check(path, seq_len=2, max_bytes=max_bytes, val_fraction=0.5)
        assert size == len(corpus.train) + len(corpus.val), (path, max_bytes)


def test_check_data_too_small_suggests_a_seq_len_that_fits(tmp_path):
    import re

    from raggedfsdp.app.train.data import check_split

    path = tmp_path / "small.txt"
    path.write_text("x" * 999 + "\n")  # 1000 bytes: 900 train / 100 held out at val_fraction 0.1
    with pytest.raises(ValueError) as exc:
        _check(path, seq_len=128)
    msg = str(exc.value)
    assert repr(str(path)) in msg and "too small (1000 bytes) for training.seq_len=128" in msg
    assert "900 train / 100 held-out bytes" in msg and "data.val_fraction=0.1" in msg
    fit = int(re.search(r"a smaller --seq-len \(at most (\d+) fits\)", msg).group(1))
    need = int(re.search(r"at least (\d+) bytes of data for seq_len=128", msg).group(1))
    assert fit == 99
    # the suggestions are tight: seq_len=fit works end to end, fit + 1 does not
    assert _check(path, seq_len=fit) == 1000
    corpus = load_corpus(str(path), max_bytes=0, val_fraction=0.1)
    BatchSampler(corpus.train, seq_len=fit, global_batch_size=2)
    eval_windows(len(corpus.val), seq_len=fit, count=4)
    with pytest.raises(ValueError, match="too small"):
        _check(path, seq_len=fit + 1)
    with pytest.raises(ValueError, match="too small"):
        check_split(need - 1 - int((need - 1) * 0.1), int((need - 1) * 0.1), seq_len=128)
    check_split(need - int(need * 0.1), int(need * 0.1), seq_len=128)
    # capped stdlib corpus: the hint names data.max_bytes
    with pytest.raises(
        ValueError, match=r"corpus python stdlib is too small \(200 bytes\).*raise data.max_bytes"
    ):
        _check("", seq_len=128, max_bytes=200, val_fraction=0.05)


def test_check_data_stdlib_is_cheap(monkeypatch):
    """The pre-launch check of the default corpus reads file sizes only, never a file's bytes."""
    import builtins
    import pathlib

    def no_read(*a, **k):
        raise AssertionError("check_data read a corpus file; it must use sizes only")

    real_open = builtins.open
    monkeypatch.setattr(pathlib.Path, "read_bytes", no_read)
    monkeypatch.setattr(
        builtins,
        "open",
        lambda f, mode="r", *a, **k: (
            no_read() if "b" in mode and str(f).endswith(".py") else real_open(f, mode, *a, **k)
        ),
    )
    assert _check("", seq_len=128, max_bytes=0, val_fraction=0.05) > 1_000_000
