"""Pre-tokenized .bin data: write/read round trip (uint16 and uint32), windows equal the ids,
per-rank sampling stays deterministic and disjoint, bad files and vocabularies get clear errors,
and `raggedfsdp tokenize` with a local HF tokenizer writes a file `raggedfsdp train` trains on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raggedfsdp.app.train.data import BatchSampler, check_data, load_corpus
from raggedfsdp.app.train.data import token_bin_info, write_token_bin


def _text_corpus(tmp_path: Path, min_bytes: int = 400_000) -> Path:
    """One text file of Python standard-library sources (present wherever Python is). The test used a
    file under /work/shared, which exists only on the project's own machine: a clean checkout elsewhere
    failed with FileNotFoundError."""
    from raggedfsdp.app.train.data import stdlib_source_files

    parts, size = [], 0
    for f in stdlib_source_files():
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        size += len(text.encode())
        if size >= min_bytes:
            break
    assert size >= min_bytes, f"only {size} bytes of stdlib sources found"
    path = tmp_path / "corpus.txt"
    path.write_text("".join(parts), encoding="utf-8")
    return path


@pytest.mark.parametrize("vocab", [1000, 100_000])
def test_roundtrip_and_windows(tmp_path, vocab):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=n) for n in (500, 700, 300)]
    path = write_token_bin(tmp_path / "d.bin", docs, vocab_size=vocab)
    info = token_bin_info(path)
    assert (info.dtype, info.num_tokens, info.vocab_size) == (
        "uint16" if vocab <= 65536 else "uint32",
        1500,
        vocab,
    )
    ids = np.concatenate(docs)
    corpus = load_corpus(str(path), max_bytes=0, val_fraction=0.1)
    assert len(corpus.train) + len(corpus.val) == 1500 and len(corpus.val) == 150
    s = BatchSampler(corpus.train, seq_len=16, global_batch_size=6, world_size=3, rank=1, seed=5)
    x, y = s.get(step=3)
    offs = s.global_offsets(3)[s.rows().start : s.rows().stop]
    for row, o in enumerate(offs):
        assert x[row].tolist() == ids[o : o + 16].tolist() and y[row].tolist() == ids[o + 1 : o + 17].tolist()
    assert x.dtype == torch.int64
    # ranks' rows are disjoint and cover the global batch
    rows = [
        set(BatchSampler(corpus.train, seq_len=16, global_batch_size=6, world_size=3, rank=r).rows())
        for r in range(3)
    ]
    assert set().union(*rows) == set(range(6)) and sum(map(len, rows)) == 6
    assert check_data(str(path), max_bytes=0, val_fraction=0.1, seq_len=16) == 1500 * (
        2 if vocab <= 65536 else 4
    )


def test_bad_files(tmp_path):
    p = tmp_path / "odd.bin"
    p.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        token_bin_info(p)
    write_token_bin(tmp_path / "ok.bin", [[1, 2, 3]], vocab_size=10)
    (tmp_path / "ok.bin").write_bytes(b"\x01\x00" * 5)
    with pytest.raises(ValueError, match="holds 5 tokens but its sidecar says 3"):
        token_bin_info(tmp_path / "ok.bin")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_token_bin(tmp_path / "v.bin", [[3, 12]], vocab_size=10)
    write_token_bin(tmp_path / "small.bin", [range(50)], vocab_size=64)
    with pytest.raises(ValueError, match="too small"):
        check_data(str(tmp_path / "small.bin"), max_bytes=0, val_fraction=0.1, seq_len=64)


@pytest.mark.slow
def test_tokenize_and_train(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from raggedfsdp.app.cli import main
    from raggedfsdp.app.train.config import load_config

    corpus = _text_corpus(tmp_path)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    del tokenizers
    out = tmp_path / "corpus.bin"
    assert (
        main(
            [
                "tokenize",
                str(corpus),
                "--tokenizer",
                str(tmp_path),
                "--out",
                str(out),
                "--eos-token",
                "<eos>",
            ]
        )
        == 0
    )
    info = token_bin_info(out)
    assert info.vocab_size == 300 and info.num_tokens > 100_000
    ids = np.fromfile(out, dtype="<u2")
    text = corpus.read_text(encoding="utf-8")
    assert ids[-1] == tok.token_to_id("<eos>")
    assert tok.decode(ids[:-1].tolist()) == text  # byte-level BPE is lossless: the file is the one document
    # the vocabulary check names the fix, then a short run trains on the .bin
    # the vocabulary comes from the sidecar (no --model.vocab_size needed); a smaller explicit one is refused
    cfg = load_config("debug", {"data.path": str(out)})
    cfg.check_data()
    assert cfg.model_overrides()["vocab_size"] == 300
    with pytest.raises(ValueError, match="--model.vocab_size 300"):
        load_config("debug", {"data.path": str(out), "model.vocab_size": 256}).check_data()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "raggedfsdp.app.launch.worker",
            "--config",
            "debug",
            "--data",
            str(out),
            "--steps",
            "3",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 3/3" in run.stdout
