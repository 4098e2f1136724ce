"""Tokenized data carries a checksum (issue 41 item 8): ``write_token_bin`` (``raggedfsdp tokenize``)
records the file's CRC-32 in its sidecar, and every process's data check reads the file once before
the launch: an in-vocabulary corruption (one token changed to another valid id, undetectable before)
and an out-of-vocabulary id anywhere in the file (found before only if a batch sampled it) are each
one line naming the file, exit 2, no launch. The reference is an independent recomputation: the
corrupted token's position and value are chosen by the test, and ``zlib.crc32`` of the bytes is
compared with the sidecar. In-process ``raggedfsdp train``: it returns before starting torchrun."""

from __future__ import annotations

import json
import time
import zlib

import numpy as np
import pytest

from raggedfsdp.app.cli import main as cli_main
from raggedfsdp.app.train.tokens import write_token_bin

ARGS = ["--nproc", "2", "--model", "debug", "--steps", "2", "--batch-size", "4", "--seq-len", "32"]


def _bin(tmp_path, n=200_000):
    ids = np.random.default_rng(0).integers(0, 256, size=n)
    path = write_token_bin(tmp_path / "data.bin", [ids], vocab_size=256)
    meta = json.loads((tmp_path / "data.bin.json").read_text())
    assert meta["crc32"] == f"{zlib.crc32(path.read_bytes()):08x}"  # the independent reference
    return path, ids


def _set_token(path, index, value):
    arr = np.fromfile(path, dtype="<u2")
    arr[index] = value
    arr.tofile(path)


@pytest.mark.core
@pytest.mark.parametrize("case", ["in_vocab", "out_of_vocab"])
def test_a_corrupt_token_file_is_refused_before_the_launch(tmp_path, capsys, case):
    path, ids = _bin(tmp_path)
    index = 123_457  # near the end: a batch of a 2-step run would hardly sample it
    _set_token(path, index, (int(ids[index]) + 1) % 256 if case == "in_vocab" else 300)
    if case == "out_of_vocab":  # the sidecar's checksum matches the bad file: only the id check finds it
        meta = json.loads((tmp_path / "data.bin.json").read_text())
        meta["crc32"] = f"{zlib.crc32(path.read_bytes()):08x}"
        (tmp_path / "data.bin.json").write_text(json.dumps(meta))
    t0 = time.perf_counter()
    rc = cli_main(["train", *ARGS, "--data", str(path), "--out", str(tmp_path / "out")])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert not (tmp_path / "out").exists()
    last = err[-1]
    assert str(path) in last, last
    if case == "in_vocab":
        assert "fails its CRC-32 check" in last, last
    else:
        assert f"token {index:,}" in last and "id 300" in last and "[0, 256)" in last, last
    assert took < 30, took


@pytest.mark.core
def test_an_old_sidecar_without_checksum_warns_once_and_loads(tmp_path, capsys):
    from raggedfsdp.app.train.config import load_config

    path, _ = _bin(tmp_path)
    meta = json.loads((tmp_path / "data.bin.json").read_text())
    del meta["crc32"]
    (tmp_path / "data.bin.json").write_text(json.dumps(meta))
    cfg = load_config("debug", {"data.path": str(path)})
    cfg.check_data()
    cfg.check_data()
    err = capsys.readouterr().err
    assert err.count("has no crc32") == 1 and str(path) in err, err
    _set_token(path, 5, 7)  # an old sidecar cannot catch an in-vocabulary change ...
    cfg.check_data()
    _set_token(path, 5, 999)  # ... but still finds an id outside the vocabulary
    with pytest.raises(ValueError, match="id 999, outside the model's vocabulary"):
        cfg.check_data()
