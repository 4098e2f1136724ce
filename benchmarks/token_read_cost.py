"""Cost of reading a step's batches from a ``.bin`` token file: checked positional reads (the reader
since issue 23's SIGBUS fix, ``train/data.py``'s ``TokenArray``) vs the memory map it replaced.

    python benchmarks/token_read_cost.py [--seq-len 128] [--batch-size 16] [--nproc 2] [--steps 200]

The corpus is the default one (the stdlib's sources, 4 MB), written as a uint16 ``.bin``. Per optimizer
step a rank reads its micro-batches (``BatchSampler.get``) and the batches of the per-step check
(``batch_checksums``: its own and the next rank's); both readers run that same code, the memory-mapped
one through ``numpy.memmap`` fancy indexing as before. Prints microseconds per step (median of
``--repeats`` passes over ``--steps`` steps), cold page cache excluded (one warm pass first), and checks
that both readers give the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from raggedfsdp.app.train.data import BatchSampler, batch_checksums, load_corpus, write_token_bin


class MemmapTokens:
    """The previous reader: ``numpy.memmap`` indexed with the windows' index array."""

    def __init__(self, mm: np.ndarray) -> None:
        self._mm = mm

    def __len__(self) -> int:
        return len(self._mm)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return MemmapTokens(self._mm[idx])
        return torch.from_numpy(np.asarray(self._mm[idx.numpy()], dtype=np.int64))


def per_step_us(tokens, args, rank: int) -> tuple[float, bytes]:
    s = BatchSampler(tokens, seq_len=args.seq_len, global_batch_size=args.batch_size, world_size=args.nproc,
                     rank=rank, seed=0)  # fmt: skip
    digest = []
    times = []
    for rep in range(args.repeats + 1):
        t0 = time.perf_counter()
        for step in range(args.steps):
            x, _ = s.get(step)
            c = batch_checksums(s, step, rank)
            if rep == 0:
                digest.append(x.numpy().tobytes() + repr(c).encode())
        if rep:  # the first pass warms the page cache
            times.append((time.perf_counter() - t0) / args.steps * 1e6)
    return statistics.median(times), b"".join(digest)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    stream = load_corpus("").train  # (N,) uint8, the default corpus (train split)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_token_bin(Path(tmp) / "stdlib.bin", [stream.numpy()], vocab_size=256)
        pread = load_corpus(str(path), max_bytes=0, val_fraction=0.0001).train
        mm = MemmapTokens(np.memmap(path, dtype="<u2", mode="r")[: len(pread)])
        t_new, d_new = per_step_us(pread, args, rank=0)
        t_old, d_old = per_step_us(mm, args, rank=0)
    assert d_new == d_old, "the readers disagree"
    print(f"{len(stream):,} tokens, seq_len {args.seq_len}, global batch {args.batch_size}, {args.nproc} "
          f"ranks: per step and rank: pread {t_new:.0f} us, memmap {t_old:.0f} us "
          f"(difference {t_new - t_old:+.0f} us); same tokens: yes")  # fmt: skip


if __name__ == "__main__":
    main()
