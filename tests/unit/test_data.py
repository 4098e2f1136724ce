"""Byte corpus loading and the deterministic per-rank batch sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raggedfsdp.train.data import BatchSampler, eval_windows, load_corpus, stdlib_source_files, windows

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
