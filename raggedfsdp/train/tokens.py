"""Pre-tokenized data: a flat ``.bin`` of token ids (nanoGPT / Megatron style), memory-mapped.

Format: the token ids of the whole corpus, concatenated, as little-endian ``uint16`` (vocabularies
up to 65,536) or ``uint32``, no header -- the file nanoGPT's ``prepare.py`` writes. A sidecar
``NAME.bin.json`` (written by ``raggedfsdp tokenize``) records ``dtype``, ``vocab_size``,
``num_tokens`` and the tokenizer; without it the dtype is ``uint16``. The file is opened with
``numpy.memmap``: nothing is read until a batch needs its windows, so corpora larger than memory work.

Sampling is the byte corpus's (``data.BatchSampler``): random windows whose offsets are a pure
function of ``(seed, step)``, disjoint per rank, resumable at any step; the tail ``val_fraction``
of the token stream is held out.

``raggedfsdp tokenize TEXT... --tokenizer tokenizer.json --out data.bin`` writes one from text files
with a local Hugging Face ``tokenizers`` file (no download), appending the tokenizer's EOS id
(``--eos-token``) after each document.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["TokenArray", "is_token_bin", "load_token_corpus", "token_bin_info", "write_token_bin"]

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def is_token_bin(path: str) -> bool:
    return bool(path) and str(path).endswith(".bin")


@dataclass(frozen=True)
class TokenBinInfo:
    path: Path
    dtype: str
    num_tokens: int
    vocab_size: int | None
    tokenizer: str | None


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
    return TokenBinInfo(p, dtype, n, int(vocab) if vocab is not None else None, meta.get("tokenizer"))


class TokenArray:
    """A read-only 1-D view of memory-mapped token ids; ``tokens[idx]`` gives an int64 tensor."""

    def __init__(self, mm: np.ndarray) -> None:
        self._mm = mm

    def __len__(self) -> int:
        return len(self._mm)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return TokenArray(self._mm[idx])
        if isinstance(idx, torch.Tensor):
            idx = idx.numpy()
        return torch.from_numpy(np.asarray(self._mm[idx], dtype=np.int64))

    def tolist(self) -> list[int]:
        return np.asarray(self._mm, dtype=np.int64).tolist()

    def max(self) -> int:
        return int(self._mm.max()) if len(self._mm) else -1


def load_token_corpus(path: str, *, max_tokens: int = 0, val_fraction: float = 0.05):
    """A :class:`raggedfsdp.train.data.Corpus` over a ``.bin`` (memory-mapped; ``max_tokens`` caps it)."""
    from raggedfsdp.train.data import Corpus

    info = token_bin_info(path)
    mm = np.memmap(info.path, dtype=np.dtype(DTYPES[info.dtype]).newbyteorder("<"), mode="r")
    if max_tokens:
        mm = mm[:max_tokens]
    n_val = int(len(mm) * val_fraction)
    if len(mm) - n_val < 2 or n_val < 2:
        raise ValueError(f"token file {path!r} is too small ({len(mm)} tokens) to split into train/val")
    arr = TokenArray(mm)
    return Corpus(
        train=arr[: len(mm) - n_val], val=arr[len(mm) - n_val :], source=str(info.path), num_files=1
    )


def write_token_bin(out: str | os.PathLike, ids, *, vocab_size: int, tokenizer: str | None = None) -> Path:
    """Write token ids (an iterable of int sequences) to ``out`` and its sidecar; returns the path."""
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out, "wb") as fh:
        for seq in ids:
            arr = np.asarray(seq, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                raise ValueError(f"token id {int(arr.max())} outside the vocabulary of {vocab_size}")
            fh.write(arr.astype(np.dtype(DTYPES[dtype]).newbyteorder("<")).tobytes())
            n += arr.size
    meta = {"dtype": dtype, "vocab_size": vocab_size, "num_tokens": n, "tokenizer": tokenizer}
    Path(f"{out}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


# -- raggedfsdp tokenize -----------------------------------------------------------------------


def add_parser(subparsers):
    p = subparsers.add_parser(
        "tokenize",
        help="write a pre-tokenized .bin (uint16/uint32 token ids) from text with a local HF tokenizer",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("inputs", nargs="+", help="text files or folders of text files (each file is a document)")
    p.add_argument(
        "--tokenizer", required=True, help="a local Hugging Face tokenizer.json (or a folder with one)"
    )
    p.add_argument(
        "--out", required=True, help="output .bin path (a NAME.bin.json sidecar is written next to it)"
    )
    p.add_argument("--eos-token", default=None, help="token appended after each document (default: none)")
    p.set_defaults(func=run)
    return p


def _progress(items, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="file", file=sys.stderr, disable=len(items) < 2)


def run(args) -> int:
    def error(msg: str) -> int:
        print(f"raggedfsdp tokenize: error: {msg}", file=sys.stderr)
        return 2

    if not str(args.out).endswith(".bin"):
        return error(f"--out {args.out!r}: the output must end in .bin")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return error("needs the tokenizers package: pip install tokenizers (or 'raggedfsdp[hf]')")
    tok_path = Path(args.tokenizer)
    if tok_path.is_dir():
        tok_path = tok_path / "tokenizer.json"
    if not tok_path.is_file():
        return error(f"--tokenizer {args.tokenizer!r}: no tokenizer.json there (a local file is needed)")
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # noqa: BLE001 (the library raises a bare Exception for bad files)
        return error(f"--tokenizer {str(tok_path)!r}: cannot load ({e})")
    eos = None
    if args.eos_token is not None:
        eos = tok.token_to_id(args.eos_token)
        if eos is None:
            return error(f"--eos-token {args.eos_token!r} is not in the tokenizer's vocabulary")
    from raggedfsdp.train.data import _is_text, _walk

    files: list[Path] = []
    for inp in args.inputs:
        p = Path(inp)
        if p.is_dir():
            files += [f for f in _walk(p) if _is_text(f)]
        elif p.is_file():
            files.append(p)
        else:
            return error(f"input {inp!r} not found")
    if not files:
        return error("no readable text files in the inputs")

    def ids():
        for f in _progress(files, "tokenize"):
            seq = tok.encode(f.read_text(errors="replace"), add_special_tokens=False).ids
            yield seq + ([eos] if eos is not None else [])

    out = write_token_bin(args.out, ids(), vocab_size=tok.get_vocab_size(), tokenizer=str(tok_path))
    info = token_bin_info(out)
    print(
        f"wrote {info.num_tokens:,} {info.dtype} tokens (vocab {info.vocab_size:,}) from {len(files)} file(s) to {out}"
    )
    return 0
