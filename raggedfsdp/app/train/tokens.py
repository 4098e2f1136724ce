"""Pre-tokenized ``.bin`` token files: the format, its sidecar, the writer and the reader.

Format: the token ids of the whole corpus, concatenated, as little-endian ``uint16`` (vocabularies up
to 65,536) or ``uint32``, no header -- the file nanoGPT's ``prepare.py`` writes (Megatron's flat
``.bin`` too). A sidecar ``NAME.bin.json`` (written by :func:`write_token_bin`, i.e. ``raggedfsdp
tokenize``) records ``dtype``, ``vocab_size``, ``num_tokens``, the tokenizer and ``crc32`` (the CRC-32
of the file's bytes, 8 hex digits, zlib's polynomial); without it the dtype is ``uint16``.

Checked at load (:func:`verify_token_bin`, every process's pre-launch data check): one sequential pass
over the file computes its CRC-32 (compared with the sidecar's: an in-vocabulary corruption, e.g. a
flipped bit, is a one-line :class:`DataError` naming the file) and the largest id (a vectorized max
per 16 MiB chunk: an out-of-vocabulary id anywhere is found before step 1, not only when a batch
samples it). CRC-32 rather than SHA-256: it detects accidental corruption (not tampering) at about
twice SHA-256's speed; measured on a 100 MB file in the page cache, 2-core shared machine: read 5 ms,
CRC-32 30 ms, SHA-256 63 ms, BLAKE2b 114 ms; ``verify_token_bin`` (CRC-32 + max) 45-48 ms
(benchmarks/README.md).
A sidecar written before the checksum existed loads with a one-time warning.

Reading (:class:`TokenArray`): nothing is read until a batch needs its windows (corpora larger than
memory work), and then with one positional read per window (``os.preadv``, straight into the batch's
buffer), not through a memory map. A memory map turns a file truncated while the job reads it (a
shared file system where the data is replaced or cut mid-run) into SIGBUS, which kills the rank with
no error recorded and no rank named; a checked read is a :class:`DataError` naming the file, the
token and byte offsets and the fix, which the job reports like any other failure (one
``[rank R/W] error: ...`` line). Cost, measured by ``benchmarks/token_read_cost.py``: lower than the
memory map's fancy indexing (see benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DTYPES", "TokenArray", "TokenBinInfo", "is_token_bin", "token_bin_info", "verify_token_bin",
    "write_token_bin",
]  # fmt: skip

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """A batch of the wrong shape, token ids outside the vocabulary (names rank/step/sample), or a
    token file that changed under a running job (names the file)."""


def is_token_bin(path: str) -> bool:
    return bool(path) and str(path).endswith(".bin")


@dataclass(frozen=True)
class TokenBinInfo:
    path: Path
    dtype: str
    num_tokens: int
    vocab_size: int | None
    tokenizer: str | None
    crc32: str | None = None  # the sidecar's checksum (8 hex digits), None for an old or absent sidecar
    has_sidecar: bool = False


def token_bin_info(path: str | os.PathLike) -> TokenBinInfo:
    """Size, dtype and vocabulary of a ``.bin`` (from its sidecar JSON if any); ``ValueError`` naming
    the path for a missing, empty or truncated file or a bad sidecar."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"token file {str(path)!r} not found")
    meta: dict = {}
    side = Path(f"{p}.json")
    if side.is_file():
        try:
            meta = json.loads(side.read_text())
        except ValueError as e:
            raise ValueError(f"token file sidecar {str(side)!r} is not valid JSON ({e})") from None
    dtype = meta.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise ValueError(f"{str(side)!r}: dtype {dtype!r} must be one of {sorted(DTYPES)}")
    size = p.stat().st_size
    item = np.dtype(DTYPES[dtype]).itemsize
    if size == 0 or size % item:
        raise ValueError(
            f"token file {str(path)!r} has {size} bytes: not a whole number of {dtype} tokens "
            f"({item} bytes each){' (empty)' if size == 0 else ''}"
        )
    n = size // item
    if "num_tokens" in meta and int(meta["num_tokens"]) != n:
        raise ValueError(
            f"token file {str(path)!r} holds {n} tokens but its sidecar says {meta['num_tokens']}"
        )
    vocab = meta.get("vocab_size")
    crc = meta.get("crc32")
    return TokenBinInfo(
        p, dtype, n, int(vocab) if vocab is not None else None, meta.get("tokenizer"),
        str(crc).lower() if crc is not None else None, side.is_file(),
    )  # fmt: skip


_CHUNK = 16 << 20  # bytes per read of verify_token_bin
_WARNED: set[str] = set()  # files whose missing checksum was reported (once per process)


def verify_token_bin(
    path: str | os.PathLike, vocab_size: int | None = None, *, warn: bool = True
) -> TokenBinInfo:
    """Check a ``.bin`` against its sidecar's CRC-32 and its ids against ``vocab_size``; returns its info.

    One sequential pass in 16 MiB chunks (``zlib.crc32`` and ``numpy`` ``max`` per chunk; 45-48 ms per
    100 MB in the page cache). Raises :class:`DataError` (one line naming the file and the fix) when
    the file's CRC-32 differs from the sidecar's ``crc32`` (corrupted on disk or changed after
    ``raggedfsdp tokenize``), or when an id is ``>= vocab_size`` (the first such token's index and
    value); ``ValueError`` from :func:`token_bin_info`. A sidecar without ``crc32`` (written before
    the checksum) prints a one-line warning to stderr once per file and process (``warn=False``: none).
    A file without a sidecar (e.g. nanoGPT's) is checked for its ids only. Local; no collectives."""
    info = token_bin_info(path)
    dt = np.dtype(DTYPES[info.dtype]).newbyteorder("<")
    crc, pos, bad = 0, 0, None
    with open(info.path, "rb", buffering=0) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            chunk = view[:n]
            crc = zlib.crc32(chunk, crc)
            if vocab_size is not None and bad is None:
                ids = np.frombuffer(chunk, dtype=dt)
                if ids.size and int(ids.max()) >= vocab_size:
                    i = int(np.flatnonzero(ids >= vocab_size)[0])
                    bad = (pos + i, int(ids[i]))
            pos += n // dt.itemsize
    got = f"{crc:08x}"
    if info.crc32 is not None and got != info.crc32:
        raise DataError(
            f"token file {str(info.path)!r} fails its CRC-32 check (its sidecar {info.path.name}.json "
            f"records {info.crc32}, its {info.num_tokens:,} tokens give {got}): corrupted on disk or "
            "changed after raggedfsdp tokenize; restore it or write it again with raggedfsdp tokenize"
        )
    if bad is not None:
        raise DataError(
            f"token file {str(info.path)!r}: token {bad[0]:,} (byte {bad[0] * dt.itemsize:,}) is id "
            f"{bad[1]:,}, outside the model's vocabulary [0, {vocab_size:,}): a corrupt file or another "
            "tokenizer's; write it again with raggedfsdp tokenize (or pass --model.vocab_size with the "
            "tokenizer's vocabulary)"
        )
    if info.crc32 is None and info.has_sidecar and warn and str(info.path) not in _WARNED:
        _WARNED.add(str(info.path))
        print(
            f"warning: token file {str(info.path)!r}: its sidecar has no crc32 (written before the "
            "checksum): a corruption within the vocabulary cannot be detected; write it again with "
            "raggedfsdp tokenize to add one",
            file=sys.stderr,
            flush=True,
        )
    return info


class _TokenFile:
    """An open token file, read with checked positional reads (``os.pread``/``os.preadv``), never
    memory-mapped: a file truncated while a job reads it is a :class:`DataError` naming the file and
    the offset, where touching a memory-mapped page past the new end kills the process with SIGBUS
    (no error recorded, no rank named). The file descriptor is opened once: a file *replaced* (renamed
    over) keeps being read as it was opened, one rewritten in place is read as it now is."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path = str(path)
        self.dtype = np.dtype(DTYPES[dtype]).newbyteorder("<")
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self.fd).st_size  # bytes when opened

    def __del__(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Fill the C-contiguous 1-D ``out`` (this file's dtype) with the tokens from ``start`` on."""
        view, pos = memoryview(out).cast("B"), start * self.dtype.itemsize
        while view.nbytes:
            got = os.preadv(self.fd, [view], pos) if _PREADV else _pread_into(self.fd, view, pos)
            if got == 0:  # end of file: it is shorter than when it was opened
                raise self._truncated(start, len(out))
            view, pos = view[got:], pos + got

    def _truncated(self, start: int, count: int):
        item = self.dtype.itemsize
        try:
            now = f"{os.fstat(self.fd).st_size} bytes now"
        except OSError as e:
            now = f"its size now unknown: {e.strerror or e}"
        return DataError(
            f"token file {self.path!r} was truncated while the job read it: tokens {start}-"
            f"{start + count - 1} (bytes {start * item}-{(start + count) * item - 1}) are past its end "
            f"({now}, {self.size} when the job opened it); a file must not change while a job reads it: "
            "restore it (or write a new one under another name) and resume with --resume auto"
        )


_PREADV = hasattr(os, "preadv")


def _pread_into(fd: int, view: memoryview, pos: int) -> int:
    data = os.pread(fd, view.nbytes, pos)
    view[: len(data)] = data
    return len(data)


class TokenArray:
    """A read-only 1-D view ``[start, start + length)`` of a token file's ids, read on demand with
    checked positional reads (:class:`_TokenFile`); ``tokens[idx]`` gives an int64 tensor,
    ``np.asarray(tokens)`` the ids in the file's dtype. A read past the end of a file truncated
    since it was opened raises :class:`DataError` naming the file, the offset and the fix."""

    def __init__(self, file: _TokenFile, start: int = 0, length: int | None = None) -> None:
        self._file = file
        self._start = start
        self._len = file.size // file.dtype.itemsize - start if length is None else length

    def __len__(self) -> int:
        return self._len

    @property
    def path(self) -> str:
        return self._file.path

    @property
    def file_bytes(self) -> int:
        """The token file's size in bytes when it was opened (the whole file, not this view)."""
        return self._file.size

    def _read(self, start: int, count: int) -> np.ndarray:  # (count,) file dtype
        out = np.empty(count, dtype=self._file.dtype)
        if count:
            self._file.read_into(out, self._start + start)
        return out

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self._len)
            if step != 1:
                raise ValueError(f"TokenArray slices take step 1, got {step}")
            return TokenArray(self._file, self._start + start, max(0, stop - start))
        idx = np.asarray(idx.numpy() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64)
        if idx.size == 0:
            return torch.zeros(idx.shape, dtype=torch.int64)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self._len:
            raise IndexError(f"token index {lo if lo < 0 else hi} out of range for {self._len} tokens")
        return torch.from_numpy(self._read(lo, hi - lo + 1)[idx - lo].astype(np.int64))

    def windows(self, offsets: np.ndarray, length: int) -> torch.Tensor:
        """``(len(offsets), length)`` int64: the ids ``[o, o + length)`` for each offset ``o`` (one
        positional read per window, straight into the batch's buffer)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if len(offsets) and (int(offsets.min()) < 0 or int(offsets.max()) + length > self._len):
            raise IndexError(f"a window of {length} tokens at {offsets.tolist()} is past {self._len} tokens")
        out = np.empty((len(offsets), length), dtype=self._file.dtype)
        for row, o in zip(out, offsets.tolist()):
            self._file.read_into(row, self._start + o)
        return torch.from_numpy(out.astype(np.int64))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self._read(0, self._len)
        return arr if dtype is None else arr.astype(dtype)

    def tolist(self) -> list[int]:
        return self._read(0, self._len).astype(np.int64).tolist()

    def max(self) -> int:
        return int(self._read(0, self._len).max()) if self._len else -1


def write_token_bin(out: str | os.PathLike, ids, *, vocab_size: int, tokenizer: str | None = None) -> Path:
    """Write token ids (an iterable of int sequences) to ``out`` and its sidecar (with the file's
    CRC-32, see :func:`verify_token_bin`); returns the path. ``ValueError`` for an id outside
    ``[0, vocab_size)``."""
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n, crc = 0, 0
    with open(out, "wb") as fh:
        for seq in ids:
            arr = np.asarray(seq, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                raise ValueError(f"token id {int(arr.max())} outside the vocabulary of {vocab_size}")
            data = arr.astype(np.dtype(DTYPES[dtype]).newbyteorder("<")).tobytes()
            fh.write(data)
            crc = zlib.crc32(data, crc)
            n += arr.size
    meta = {
        "dtype": dtype, "vocab_size": vocab_size, "num_tokens": n, "tokenizer": tokenizer,
        "crc32": f"{crc:08x}",
    }  # fmt: skip
    Path(f"{out}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
