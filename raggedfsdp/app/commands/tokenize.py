"""``raggedfsdp tokenize TEXT... --tokenizer tokenizer.json --out data.bin``: write a pre-tokenized
``.bin`` (see :mod:`raggedfsdp.app.train.data`) from text files with a local Hugging Face ``tokenizers``
file (no download), appending the tokenizer's EOS id (``--eos-token``) after each document. The
``NAME.bin.json`` sidecar records the file's CRC-32, which ``raggedfsdp train`` checks before the
launch (:func:`raggedfsdp.app.train.tokens.verify_token_bin`)."""

from __future__ import annotations

import sys
from pathlib import Path


def add_parser(subparsers):
    p = subparsers.add_parser(
        "tokenize",
        help="write a pre-tokenized .bin (uint16/uint32 token ids) from text with a local HF tokenizer",
        description=(
            "Pre-tokenized data: a flat .bin of token ids (nanoGPT / Megatron style) and a JSON "
            "sidecar with its dtype, vocabulary and CRC-32 (checked by raggedfsdp train)."
        ),
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
    from raggedfsdp.app.train.data import _is_text, _walk, token_bin_info, write_token_bin

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
        f"wrote {info.num_tokens:,} {info.dtype} tokens (vocab {info.vocab_size:,}) from {len(files)} "
        f"file(s) to {out}"
    )
    return 0
