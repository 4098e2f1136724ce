"""Byte-level text data and the per-rank batch sampler.

Tokens are bytes (vocab 256): no tokenizer to download or train, any file works.

Corpus: by default the Python standard library's own ``.py`` sources (found via
``sysconfig.get_paths()["stdlib"]``; ``site-packages`` and caches are skipped). It is present on every
machine that runs Python, and it is deterministic for a given Python version. ``path`` may instead
name a text file or a folder of text files (binary files, detected by a NUL byte in the first 8 KiB,
are skipped, as are unreadable files).

``check_data`` validates a data source before any process is launched: it names a missing path, an
empty file or folder, a folder without readable text files, and a corpus too small for the held-out
split at the configured ``seq_len`` (with the largest ``seq_len`` that would fit). It reads only file
sizes (plus, for a user folder, the first 8 KiB and the last byte of each file, as loading does).

The file list is sorted by path, then permuted with a fixed seed (``FILE_ORDER_SEED``, independent
of the run's seed) so that a capped corpus samples the whole tree instead of the alphabetically
first packages. Files are concatenated in that order (each ending in a newline) and the stream is
cut at ``max_bytes``. The tail ``val_fraction`` of the stream, which is a few whole files that the
model never trains on, is held out for evaluation.

Sampling (see ``BatchSampler``): a batch is a set of random windows of ``seq_len + 1`` bytes. The
window offsets of optimizer step ``s`` are a pure function of ``(seed, s)``, so a run can resume at
any step, and runs at different world sizes see exactly the same global batch.

Pre-tokenized data: a flat ``.bin`` of token ids (nanoGPT / Megatron style, uint16 or uint32, a
``NAME.bin.json`` sidecar from ``raggedfsdp tokenize``), read on demand with checked positional reads
(:mod:`raggedfsdp.app.train.tokens`: a file truncated mid-run is a ``DataError`` naming it, not SIGBUS).
Sampling is the byte corpus's (``BatchSampler``); the tail ``val_fraction`` of the token stream is
held out.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raggedfsdp.app.train.tokens import (  # re-exported: the .bin format and reader live in train/tokens.py
    DataError,
    TokenArray,
    _TokenFile,
    is_token_bin,
    token_bin_info,
    verify_token_bin,
    write_token_bin,
)

__all__ = [
    "BatchSampler",
    "Corpus",
    "DataError",
    "TokenArray",
    "batch_id",
    "check_batch",
    "check_data",
    "check_split",
    "eval_windows",
    "load_corpus",
    "parse_batch_id",
    "reproduce_batch",
    "stdlib_source_files",
    "is_token_bin",
    "load_token_corpus",
    "token_bin_info",
    "verify_token_bin",
    "write_token_bin",
]

FILE_ORDER_SEED = 1234
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_files() -> list[Path]:
    """The stdlib's ``.py`` files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library not found at {root}")
    return _walk(root, suffix=".py")


def _walk(root: Path, suffix: str | None = None) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_text(path: Path) -> bool:
    """A readable file without a NUL byte in its first 8 KiB (binary or unreadable files: False)."""
    try:
        with open(path, "rb") as fh:
            return b"\0" not in fh.read(8192)
    except OSError:
        return False


def _missing(path: str) -> str:
    return f"data path {path!r} not found (neither a file nor a folder)"


def _no_text_files(path: str, skipped: int) -> str:
    if skipped == 0:
        return f"data folder {path!r} is empty: it has no files"
    return (
        f"data folder {path!r} has no readable text files ({skipped} file(s) skipped as binary or unreadable)"
    )


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into train and validation token streams."""

    train: torch.Tensor  # (N_train,) uint8
    val: torch.Tensor  # (N_val,) uint8
    source: str  # description: where the bytes came from
    num_files: int
    files: tuple[tuple[str, int], ...] = ()  # (path, tokens it contributes), in stream order (train + val)


def load_corpus(path: str = "", *, max_bytes: int = 4_000_000, val_fraction: float = 0.05) -> Corpus:
    """Read the corpus (see the module docstring) and split off the tail as validation data.

    A ``.bin`` path is pre-tokenized data (see the module docstring), memory-mapped;
    ``max_bytes`` then caps the bytes of the token file used."""
    if is_token_bin(path):
        cap = max_bytes // (2 if token_bin_info(path).dtype == "uint16" else 4) if max_bytes else 0
        return load_token_corpus(path, max_tokens=cap, val_fraction=val_fraction)
    if path:
        p = Path(path).expanduser()
        if p.is_file():
            files = [p]
        elif p.is_dir():
            walked = _walk(p)
            files = [f for f in walked if _is_text(f)]
            if not files:
                raise ValueError(_no_text_files(path, len(walked)))
        else:
            raise FileNotFoundError(_missing(path))
        source = str(p)
    else:
        files = stdlib_source_files()
        source = f"python stdlib ({sysconfig.get_paths()['stdlib']})"
    order = np.random.default_rng(FILE_ORDER_SEED).permutation(len(files))
    chunks, total, used, spans = [], 0, 0, []
    for f in (files[i] for i in order):
        try:
            data = f.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read data file {str(f)!r}: {e.strerror or e}") from None
        if max_bytes and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        if data:
            chunks.append(data if data.endswith(b"\n") else data + b"\n")
            total += len(chunks[-1])
            used += 1
            spans.append((str(f), len(chunks[-1])))
        if max_bytes and total >= max_bytes:
            break
    blob = b"".join(chunks)[: max_bytes or None]
    if not blob:
        raise ValueError(f"data {source!r} is empty (0 bytes)")
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # (N,)
    n_val = int(len(tokens) * val_fraction)
    if len(tokens) - n_val < 2 or n_val < 2:
        raise ValueError(f"corpus {source} is too small ({len(tokens)} bytes) to split into train/val")
    if spans and total > len(blob):  # the cap cut the last file's appended newline
        spans[-1] = (spans[-1][0], spans[-1][1] - (total - len(blob)))
    return Corpus(
        train=tokens[: len(tokens) - n_val], val=tokens[len(tokens) - n_val :], source=source, num_files=used,
        files=tuple(spans),
    )  # fmt: skip


def _padded_size(path: Path) -> int:
    """Bytes ``path`` contributes to the corpus: its size, plus the newline appended when it lacks one."""
    size = path.stat().st_size
    if size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            size += fh.read(1) != b"\n"
    return size


def check_data(path: str = "", *, max_bytes: int, val_fraction: float, seq_len: int) -> int:
    """Check a data source before launching, without loading it; returns the corpus size in bytes.

    Raises ``ValueError`` naming the path for a missing path, an empty file or folder, a folder with no
    readable text files, an unreadable file, or a corpus that is too small for the held-out split at
    ``seq_len`` (see :func:`check_split`). The size is exact for a user path (what :func:`load_corpus`
    reads) and the sum of the file sizes for the stdlib corpus. Cost: one ``stat`` per file; for a
    user folder also the first 8 KiB and last byte of each file, stopping at ``max_bytes``.
    """
    total, cap = 0, max_bytes or None
    if is_token_bin(path):  # pre-tokenized: sizes in tokens
        info = token_bin_info(path)
        item = 2 if info.dtype == "uint16" else 4
        n = min(info.num_tokens, cap // item) if cap else info.num_tokens
        n_val = int(n * val_fraction)
        check_split(n - n_val, n_val, seq_len=seq_len, source=repr(path), val_fraction=val_fraction)
        return n * item
    if path:
        p = Path(path).expanduser()
        source = repr(path)
        try:
            if p.is_file():
                total = _padded_size(p)
                if total == 0:
                    raise ValueError(f"data file {path!r} is empty (0 bytes)")
            elif p.is_dir():
                walked, used = _walk(p), 0
                for f in walked:
                    if not _is_text(f):
                        continue
                    used += 1
                    total += _padded_size(f)
                    if cap and total >= cap:
                        break
                if used == 0:
                    raise ValueError(_no_text_files(path, len(walked)))
                if total == 0:
                    raise ValueError(f"data folder {path!r} is empty: its {used} text file(s) have 0 bytes")
            else:
                raise ValueError(_missing(path))
        except OSError as e:
            raise ValueError(f"cannot read data path {path!r}: {e}") from None
    else:
        try:
            files = stdlib_source_files()
        except FileNotFoundError as e:
            raise ValueError(f"{e}; pass a text file or folder with --data") from None
        source = "python stdlib"
        for f in files:
            total += f.stat().st_size
            if cap and total >= cap:
                break
    if cap:
        total = min(total, cap)
    n_val = int(total * val_fraction)
    check_split(
        total - n_val,
        n_val,
        seq_len=seq_len,
        source=source,
        val_fraction=val_fraction,
        capped=bool(cap) and total == cap,
    )
    return total


def min_corpus_bytes(seq_len: int, val_fraction: float) -> int:
    """The smallest corpus that leaves ``seq_len + 2`` train and ``seq_len + 1`` held-out bytes."""
    # int(n * f) >= T + 1 needs n >= (T + 1) / f; n - int(n * f) >= T + 2 needs n * (1 - f) > T + 1.
    lower = max(math.ceil((seq_len + 1) / val_fraction), math.floor((seq_len + 1) / (1 - val_fraction)))
    n = max(1, lower - 2)
    while int(n * val_fraction) < seq_len + 1 or n - int(n * val_fraction) < seq_len + 2:
        n += 1
    return n


def check_split(
    n_train: int,
    n_val: int,
    *,
    seq_len: int,
    source: str = "corpus",
    val_fraction: float | None = None,
    capped: bool = False,
) -> None:
    """``ValueError`` with a fix unless ``n_train >= seq_len + 2`` and ``n_val >= seq_len + 1``
    (what :class:`BatchSampler` and :func:`eval_windows` need)."""
    if n_train >= seq_len + 2 and n_val >= seq_len + 1:
        return
    total = n_train + n_val
    split = f"{n_train} train / {n_val} held-out bytes"
    if val_fraction is not None:
        split += f" with data.val_fraction={val_fraction}"
    fit = min(n_val - 1, n_train - 2)
    hints = []
    if fit >= 1:
        hints.append(f"a smaller --seq-len (at most {fit} fits)")
    if val_fraction is not None:
        more = f"at least {min_corpus_bytes(seq_len, val_fraction)} bytes of data for seq_len={seq_len}"
        hints.append(f"{more} (raise data.max_bytes)" if capped else more)
    else:
        hints.append("more data")
    raise ValueError(
        f"corpus {source} is too small ({total} bytes) for training.seq_len={seq_len}: it splits into "
        f"{split}, but training needs at least seq_len + 2 = {seq_len + 2} train and seq_len + 1 = "
        f"{seq_len + 1} held-out bytes; use {' or '.join(hints)}"
    )


class BatchSampler:
    """Deterministic per-rank slices of a global batch of random windows.

    Global batch of step ``s``: ``G = global_batch_size`` window offsets drawn uniformly from
    ``[0, N - seq_len - 1]`` by a NumPy generator seeded with ``(seed, s)``. Row ``i`` is the window
    at offset ``offsets[i]``: inputs ``tokens[o : o + T]``, targets ``tokens[o + 1 : o + T + 1]``.

    Split: with ``W`` ranks and ``A`` accumulation micro-steps, each micro-batch has
    ``b = G / (W * A)`` rows. Rank ``r`` owns the contiguous rows ``[r * G/W, (r + 1) * G/W)`` and its
    micro-step ``m`` takes rows ``r * G/W + m * b`` onward. The slices of all ranks are disjoint and
    together cover the global batch.
    """

    def __init__(
        self,
        tokens: torch.Tensor,  # (N,) uint8
        *,
        seq_len: int,
        global_batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        grad_accum: int = 1,
        seed: int = 0,
    ) -> None:
        if global_batch_size % (world_size * grad_accum) != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"world_size * grad_accum = {world_size} * {grad_accum}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if len(tokens) < seq_len + 2:
            raise ValueError(f"need at least seq_len + 2 = {seq_len + 2} tokens, got {len(tokens)}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.seed = seed
        self.micro_batch_size = global_batch_size // (world_size * grad_accum)

    def global_offsets(self, step: int) -> np.ndarray:  # (G,) int64
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(
            0, len(self.tokens) - self.seq_len - 1, size=self.global_batch_size, endpoint=True
        )

    def rows(self, micro_step: int = 0, rank: int | None = None) -> range:
        """Indices into the global batch of ``rank``'s micro-batch ``micro_step``."""
        rank = self.rank if rank is None else rank
        start = rank * (self.global_batch_size // self.world_size) + micro_step * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def get(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` for ``step``/``micro_step``, both (b, T) int64."""
        offsets = self.global_offsets(step)[self.rows(micro_step).start : self.rows(micro_step).stop]
        try:
            return windows(self.tokens, offsets, self.seq_len)
        except DataError as e:  # a token file truncated since it was opened
            bid = batch_id(self, step, micro_step, self.rank)
            raise DataError(f"rank {self.rank}, step {step}: batch {bid}: {e}") from None


def windows(tokens: torch.Tensor, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (both (len(offsets), seq_len) int64) for windows starting at ``offsets``."""
    if isinstance(tokens, TokenArray):  # a token file: one checked read per window
        chunk = tokens.windows(offsets, seq_len + 1)  # (b, T+1) int64
    else:
        idx = torch.as_tensor(offsets, dtype=torch.int64)[:, None] + torch.arange(seq_len + 1)  # (b, T+1)
        chunk = tokens[idx].long()  # (b, T+1)
    return chunk[:, :-1], chunk[:, 1:]


def eval_windows(num_tokens: int, *, seq_len: int, count: int) -> np.ndarray:
    """``count`` evenly spaced window offsets over a stream of ``num_tokens`` tokens (a fixed eval set)."""
    last = num_tokens - seq_len - 1
    if last < 0:
        raise ValueError(
            f"validation split ({num_tokens} tokens) is shorter than seq_len + 1 = {seq_len + 1}"
        )
    return np.linspace(0, last, num=count).round().astype(np.int64)


def batch_id(sampler: BatchSampler, step: int, micro: int, rank: int) -> str:
    """A micro-batch's id, ``step<S>:rows<A>-<B>`` (rows of the global batch of step S, so the id
    names the same samples at any world size), with the rank and micro-step for humans."""
    rows = sampler.rows(micro, rank)
    return f"step{step}:rows{rows.start}-{rows.stop - 1} (rank {rank}, micro-step {micro})"


def parse_batch_id(text: str) -> tuple[int, range]:
    """``"step3:rows4-7"`` -> ``(3, range(4, 8))``; ``ValueError`` naming the expected form."""
    import re

    m = re.match(r"^\s*step(\d+):rows(\d+)-(\d+)", text)
    if m is None or int(m.group(3)) < int(m.group(2)):
        raise ValueError(f"--reproduce-batch: bad batch id {text!r}; expected step<S>:rows<A>-<B>")
    return int(m.group(1)), range(int(m.group(2)), int(m.group(3)) + 1)


def check_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    sampler: BatchSampler,
    step: int,
    micro: int,
    vocab_size: int,
) -> None:
    """Raise ``DataError`` unless inputs/targets are ``(micro_batch_size, seq_len)`` int64 with ids in
    ``[0, vocab_size)``. CPU tensors (before the copy to the device): no device sync."""
    bid = batch_id(sampler, step, micro, sampler.rank)
    want = (sampler.micro_batch_size, sampler.seq_len)
    for name, t in (("inputs", inputs), ("targets", targets)):
        if tuple(t.shape) != want:
            raise DataError(
                f"rank {sampler.rank}, step {step}: batch {bid}: {name} have shape {tuple(t.shape)}, "
                f"expected {want} (micro_batch_size, seq_len); every rank must get equal batches"
            )
        bad = (t < 0) | (t >= vocab_size)
        if bool(bad.any()):
            row, pos = (int(i) for i in bad.nonzero()[0])
            offset = int(sampler.global_offsets(step)[sampler.rows(micro).start + row])
            raise DataError(
                f"rank {sampler.rank}, step {step}: batch {bid}: {name} hold token id "
                f"{int(t[row, pos])} outside [0, {vocab_size}) at sample {row} (global row "
                f"{sampler.rows(micro).start + row}, corpus offset {offset}), position {pos}"
            )


def reproduce_batch(sampler: BatchSampler, text: str, *, limit: int = 400) -> str:
    """The samples named by a batch id (``parse_batch_id``), one block per row, for humans: the text of a
    byte-level corpus (ids < 256, the default), else the token ids (a tokenized ``.bin``: decode them with
    the tokenizer it was made with). At most ``limit`` tokens per row."""
    step, rows = parse_batch_id(text)
    if rows.stop > sampler.global_batch_size:
        raise ValueError(
            f"--reproduce-batch: rows {rows.start}-{rows.stop - 1} past the global batch "
            f"({sampler.global_batch_size} rows)"
        )
    offsets = sampler.global_offsets(step)
    out = []
    for r in rows:
        o = int(offsets[r])
        ids = [int(i) for i in sampler.tokens[o : o + min(sampler.seq_len + 1, limit)].tolist()]
        if max(ids, default=0) < 256:
            body = bytes(ids).decode("utf-8", "replace")
        else:
            body = f"token ids ({len(ids)}): {ids}"
        out.append(f"--- step {step}, global row {r}, corpus offset {o}:\n{body}")
    return "\n".join(out)


# -- pre-tokenized .bin corpora (the file format and reader: train/tokens.py) ---------------


def load_token_corpus(path: str, *, max_tokens: int = 0, val_fraction: float = 0.05):
    """A :class:`Corpus` over a ``.bin`` (read on demand; ``max_tokens`` caps it)."""
    info = token_bin_info(path)
    arr = TokenArray(_TokenFile(info.path, info.dtype))
    if max_tokens:
        arr = arr[:max_tokens]
    n = len(arr)
    n_val = int(n * val_fraction)
    if n - n_val < 2 or n_val < 2:
        raise ValueError(f"token file {path!r} is too small ({n} tokens) to split into train/val")
    return Corpus(
        train=arr[: n - n_val], val=arr[n - n_val :], source=str(info.path), num_files=1,
        files=((str(info.path), n),),
    )  # fmt: skip


# -- raggedfsdp tokenize -----------------------------------------------------------------------


def batch_checksums(sampler: BatchSampler, step: int, dp_rank: int) -> tuple[int, int]:
    """``(checksum of dp rank ``dp_rank``'s batch of ``step``, checksum of the next dp rank's batch as
    this rank reads it)``: exact integers below 2**40 (a position-weighted token sum), which the
    trainer folds into its per-step all-reduce (``guard.StepGuard.reduce(data=)``). Local."""
    offsets = sampler.global_offsets(step)
    sums = []
    for dp in (dp_rank, (dp_rank + 1) % sampler.world_size):
        rows = [r for m in range(sampler.grad_accum) for r in sampler.rows(m, dp)]
        try:
            toks = windows(sampler.tokens, offsets[rows], sampler.seq_len)[0].reshape(-1)  # (rows x T,)
        except DataError as e:  # a token file truncated since it was opened
            what = f"rank {dp_rank}, step {step}: the data check of rank {dp}'s batch"
            raise DataError(f"{what}: {e}") from None
        weights = torch.arange(toks.numel(), dtype=torch.int64) % 1021 + 1
        sums.append(int((toks * weights).sum()) % (1 << 40))
    return sums[0], sums[1]


def check_same_data(
    step: int, data: list[tuple[float, float]], tp: int, ids: dict[int, str], source: str
) -> None:
    """``DataError`` (``culprits``: the ranks of the disagreeing pairs) when a rank's batch checksum
    differs from that batch as its previous dp rank reads it: the ranks read different data (a file
    swapped or changed after the start). ``data``: every rank's :func:`batch_checksums` pair. Local;
    every rank decides alike (the same all-reduced ``data``)."""
    w = len(data)
    if w // tp < 2:
        return
    bad = [(r, (r - tp) % w) for r in range(w) if data[r][0] != data[(r - tp) % w][1]]
    if not bad:
        return
    r, q = bad[0]
    err = DataError(
        f"ranks read different data at step {step}: rank {r}'s batch {ids[r]} has checksum {data[r][0]:.0f} "
        f"on rank {r} but {data[q][1]:.0f} as rank {q} reads it from {source} (disagreeing pairs: "
        f"{', '.join(f'{a}/{b}' for a, b in bad)}); every rank must read the same files (a file replaced or "
        "changed after the start?); stopped before the optimizer step"
    )
    err.culprits = tuple(sorted({x for p in bad for x in p}))
    raise err
