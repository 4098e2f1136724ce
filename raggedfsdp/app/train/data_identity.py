"""Corpus identity: every rank trains on the data the pre-launch check saw.

A rank that reads other data (a file replaced, truncated or rewritten between the launcher's check
and the rank's load, a node with another copy) trains silently otherwise: its losses differ, nothing
fails. So the corpus gets a fingerprint (:func:`fingerprint`: its token count and a 64-bit BLAKE2b
digest of the token stream, plus one per file), the launcher (``raggedfsdp train``) writes its own to
``OUT/data_fingerprint.json`` before the launch (:func:`write_reference`, named to the ranks by
:data:`REFERENCE_ENV`), and at the start every rank compares its fingerprint with the others' and
the launcher's in one ``all_gather`` of two int64 per rank (:func:`check_same_corpus`). A mismatch
stops the job at step 0 with a ``DataError`` naming the ranks, the files and how they differ; its
``culprits`` are the ranks that differ from the launcher's corpus (without a launcher: from the
majority; with two ranks and no launcher, both). What the ranks read at each step is checked too,
in the per-step all-reduce (``data.batch_checksums``, ``guard.StepGuard.reduce(data=)``).

Cost: one pass of BLAKE2b over the corpus in memory (about 5 ms for the 4 MB default); a ``.bin``
token file (possibly larger than memory, read on demand) is fingerprinted by its length and 64 evenly
spaced blocks of 4096 tokens, not read whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raggedfsdp.app.train.data import Corpus, DataError, TokenArray

__all__ = [
    "REFERENCE_ENV", "CorpusFingerprint", "check_same_corpus", "fingerprint", "reference_fingerprint",
    "write_reference",
]  # fmt: skip

REFERENCE_ENV = "RAGGEDFSDP_DATA_FINGERPRINT"  # the launcher's fingerprint file, for its ranks
SAMPLE_BLOCKS, BLOCK = 64, 4096  # a token file (.bin): its length and these evenly spaced blocks


@dataclass(frozen=True)
class CorpusFingerprint:
    """A corpus's identity: ``tokens`` (train + held-out), a 16-hex-digit ``digest`` of the token
    stream, and per file ``(path, tokens, digest)`` in stream order."""

    source: str
    tokens: int
    digest: str
    files: tuple[tuple[str, int, str], ...]

    def key(self) -> int:
        """The digest as a non-negative int64 (what the ranks all-gather)."""
        return int(self.digest, 16) & (2**63 - 1)

    def describe(self) -> str:
        return f"{self.source}: {len(self.files)} file(s), {self.tokens} tokens, digest {self.digest}"

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "tokens": self.tokens, "digest": self.digest,
                           "files": [list(f) for f in self.files]}, indent=1)  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> CorpusFingerprint:
        d = json.loads(text)
        return cls(
            d["source"], int(d["tokens"]), d["digest"], tuple((p, int(n), h) for p, n, h in d["files"])
        )


def _digest(pieces) -> str:
    h = hashlib.blake2b(digest_size=8)
    for piece in pieces:
        h.update(np.ascontiguousarray(piece).view(np.uint8).data)
    return h.hexdigest()


def _sampled(arr: np.ndarray) -> list[np.ndarray]:
    if len(arr) <= SAMPLE_BLOCKS * BLOCK:
        return [arr]
    starts = np.linspace(0, len(arr) - BLOCK, SAMPLE_BLOCKS).astype(np.int64)
    return [np.asarray(len(arr), dtype=np.int64)] + [arr[s : s + BLOCK] for s in starts]


def fingerprint(corpus: Corpus) -> CorpusFingerprint:
    """The fingerprint of the token stream this rank trains and evaluates on (local, no collective)."""
    parts = [p if isinstance(p, TokenArray) else p.numpy() for p in (corpus.train, corpus.val)]
    tokens = sum(len(p) for p in parts)
    if isinstance(corpus.train, TokenArray):  # a token file (read on demand): sampled, per part
        digest = _digest([b for p in parts for b in _sampled(p)])
        path = corpus.files[0][0] if corpus.files else corpus.source
        return CorpusFingerprint(corpus.source, tokens, digest, ((path, tokens, digest),))
    stream = np.concatenate(parts)
    digest = _digest([stream])
    files, start = [], 0
    for path, n in corpus.files or ((corpus.source, tokens),):
        files.append((path, n, _digest([stream[start : start + n]])))
        start += n
    return CorpusFingerprint(corpus.source, tokens, digest, tuple(files))


def write_reference(cfg, path: Path) -> CorpusFingerprint:
    """Launcher, after the pre-launch check: load the corpus as the ranks will, write its fingerprint
    to ``path`` and name the file to the ranks (:data:`REFERENCE_ENV`). ``ValueError`` as
    ``data.load_corpus`` raises it."""
    from raggedfsdp.app.train.data import load_corpus

    d = cfg.data
    fp = fingerprint(load_corpus(d.path, max_bytes=d.max_bytes, val_fraction=d.val_fraction))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(fp.to_json())
    os.environ[REFERENCE_ENV] = str(path)
    return fp


def reference_fingerprint() -> CorpusFingerprint | None:
    """The launcher's fingerprint (:func:`write_reference`), or None (no launcher, or unreadable)."""
    path = os.environ.get(REFERENCE_ENV)
    if not path:
        return None
    try:
        return CorpusFingerprint.from_json(Path(path).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _file_diff(mine, base, base_name: str, limit: int = 3) -> str:
    """Which files of ``mine`` differ from ``base`` (both ``CorpusFingerprint.files``), for humans
    (paths relative to the folder that holds them all, when there are several)."""
    ref = {p: (n, h) for p, n, h in base}
    paths = [p for p, _, _ in (*mine, *base)]
    root = os.path.commonpath(paths) if len(set(paths)) > 1 and all(os.path.isabs(p) for p in paths) else ""

    def name(p: str) -> str:
        return os.path.relpath(p, root) if root else p

    out = []
    for p, n, h in mine:
        if p not in ref:
            out.append(f"{name(p)} (not in {base_name})")
        elif ref[p][0] != n:
            out.append(f"{name(p)} ({n} tokens, {ref[p][0]} in {base_name})")
        elif ref[p][1] != h:
            out.append(f"{name(p)} (same size, other content)")
    have = {p for p, _, _ in mine}
    out += [f"{name(p)} (missing)" for p, _, _ in base if p not in have]
    if not out:
        return "same files"
    more = f" (+{len(out) - limit} more)" if len(out) > limit else ""
    under = f" under {root}" if root else ""
    return f"{len(out)} of {len(base)} file(s){under} differ: {', '.join(out[:limit])}{more}"


def check_same_corpus(fp: CorpusFingerprint, device, reference: CorpusFingerprint | None = None) -> None:
    """Collective (every rank, once, at the start): ``DataError`` (``culprits``: the ranks at fault)
    unless every rank's ``fp`` equals the others' and ``reference`` (the launcher's; None: the
    majority's). One ``all_gather`` of ``(digest, tokens)``; on a mismatch only, one
    ``all_gather_object`` of the per-file lists, to name the files."""
    import torch
    import torch.distributed as dist

    w = dist.get_world_size()
    mine = torch.tensor([fp.key(), fp.tokens], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(w)]
    if w > 1:
        dist.all_gather(every, mine)
    else:
        every = [mine]
    keys = [tuple(int(x) for x in t.tolist()) for t in every]
    if reference is not None:
        bad = [r for r, k in enumerate(keys) if k != (reference.key(), reference.tokens)]
    else:
        counts = Counter(keys).most_common()
        if len(counts) == 1:
            return
        majority = counts[0][1] > counts[1][1]  # else (e.g. 2 ranks) no rank can be trusted more
        bad = [r for r, k in enumerate(keys) if k != counts[0][0]] if majority else list(range(w))
    if not bad:
        return
    files: list = [None] * w
    if w > 1:
        dist.all_gather_object(files, fp.files)
    else:
        files = [fp.files]
    good = [r for r in range(w) if r not in bad]
    r = bad[0]
    ranks = f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
    if reference is not None:
        base, base_name = reference.files, "the pre-launch check"
        what = f"the corpus the pre-launch check saw ({reference.describe()})"
    else:
        q = good[0] if good else (1 if r == 0 else 0)
        base, base_name = files[q], f"rank {q}'s"
        what = f"rank {q}'s corpus"
    agree = f"; rank(s) {', '.join(map(str, good))} read it" if good else ""
    if reference is not None and not good and len(set(keys)) == 1:
        agree = "; every rank read the same changed data"
    err = DataError(
        f"ranks read different data at step 0 (the start): {ranks} read a corpus that differs from {what}: "
        f"rank {r}'s {_file_diff(files[r], base, base_name)}{agree}; every rank must read the same files (a "
        "file replaced, truncated or changed after the pre-launch check?); stopped before step 1"
    )
    err.culprits = tuple(bad)
    raise err
