"""Owner assignment and exchange plan for distributed Muon over the whole world (pure functions, no comms).

Every rank computes the same plan from global metadata only (shapes, the ``RaggedShard`` flat
ranges and which world ranks hold each piece), so ranks agree on owners and on every split
without talking. The world is every rank of the parameters' mesh: under HSDP ``(R, S)`` (replicate
x shard) a piece is held by ``R`` ranks, and each matrix still gets exactly **one** owner among all
``R * S`` ranks, so Newton-Schulz runs once per matrix in the world.

* Owners are assigned by LPT (longest processing time first) on the Newton-Schulz FLOPs
  (:func:`~raggedfsdp.optim._newton_schulz.ns_flops`).
* A matrix whose elements all lie in one piece is owned by one of that piece's holders (no gather),
  as long as that keeps the rank within ``(1 + balance_slack)`` of the mean load (default 1.1);
  ``balance_slack=None`` makes locality absolute.
* Split matrices go to the least-loaded rank; ties go to the rank holding the largest part of the
  matrix (fewest bytes moved), then the lowest rank.
* Gather sources: a part is read from the holder in the owner's replica (so under HSDP the gather
  stays inside the owner's shard group); the result goes to **every** holder of every part.
* Chunks (:func:`plan_exchange`): each owner's matrices are cut into ``chunks`` groups of about
  equal cost, and chunk ``c`` of every owner travels together, so chunk ``c + 1`` is gathered while
  chunk ``c`` is orthogonalised (Canzona's micro-groups, arXiv 2602.06079).
Source: Megatron's LayerWise Muon (LPT over whole-matrix owners), Canzona (decoupling the logical
owner from the physical shard); peers-2026-12.md section 5.
"""

from __future__ import annotations

from dataclasses import dataclass

from raggedfsdp.optim._newton_schulz import ns_flops


@dataclass(frozen=True)
class Matrix:
    """One Newton-Schulz problem: elements ``[start, start + numel)`` of a parameter's flat tensor.

    ``parts``: ``(holders, lo, hi)`` for every non-empty piece of the matrix, in flat order (so the
    parts concatenate to the matrix); ``holders`` are the world indices holding a copy of the piece.
    """

    item: int
    start: int
    numel: int
    rows: int
    cols: int
    parts: tuple[tuple[tuple[int, ...], int, int], ...]

    @property
    def cost(self) -> int:
        return ns_flops(self.rows, self.cols)

    @property
    def whole_on(self) -> tuple[int, ...] | None:
        """The world indices holding the whole matrix, or ``None`` when it is split over pieces."""
        return self.parts[0][0] if len(self.parts) == 1 else None


def split_matrices(item: int, mats: list[tuple[int, int, int, int]], ranges, holders=None) -> list[Matrix]:
    """:class:`Matrix` records of one parameter's matrices ``(start, numel, rows, cols)`` over ``ranges``.

    ``ranges[s]``: flat range of piece ``s``; ``holders[s]``: world indices holding it (default
    ``(s,)``: one rank per piece, FSDP).
    """
    holders = holders if holders is not None else tuple((s,) for s in range(len(ranges)))
    out = []
    for s, n, r, c in mats:
        if n == 0:
            continue
        parts = tuple(
            (holders[q], max(s, a), min(s + n, b))
            for q, (a, b) in enumerate(ranges)
            if max(s, a) < min(s + n, b)
        )
        out.append(Matrix(item, s, n, r, c, parts))
    return out


def assign_owners(
    matrices: list[Matrix], world_size: int, balance_slack: float | None = 0.1
) -> tuple[list[int], list[int]]:
    """Owner (world index) of every matrix and the resulting per-rank Newton-Schulz load (FLOPs).

    First every matrix whole in one piece stays on the least-loaded of that piece's holders (no
    gather) and the split ones are placed by LPT, largest cost first, on the least-loaded rank
    (ties: the rank holding most of it, then the lowest rank). If that leaves
    ``max / mean > 1 + balance_slack``, a second LPT pass lets a whole matrix stay local only while
    its rank stays under ``(1 + balance_slack) * mean``, and the better-balanced of the two is used.
    ``balance_slack=None``: locality is absolute. Deterministic: depends only on the matrices'
    shapes and parts. O(M log M + M * W).
    """
    owners, loads = _lpt(matrices, world_size, None)
    if balance_slack is None or balance(loads) <= 1 + balance_slack:
        return owners, loads
    owners2, loads2 = _lpt(matrices, world_size, (1 + balance_slack) * sum(loads) / world_size)
    return (owners2, loads2) if balance(loads2) < balance(loads) else (owners, loads)


def _lpt(matrices: list[Matrix], world_size: int, cap: float | None) -> tuple[list[int], list[int]]:
    owners = [-1] * len(matrices)
    loads = [0] * world_size
    order = sorted(range(len(matrices)), key=lambda i: (-matrices[i].cost, i))
    if cap is None:
        for i in order:
            hs = matrices[i].whole_on
            if hs is not None:
                q = min(hs, key=lambda q: (loads[q], q))
                owners[i] = q
                loads[q] += matrices[i].cost
    for i in order:
        m = matrices[i]
        if owners[i] >= 0:
            continue
        hs = m.whole_on
        q = min(hs, key=lambda q: (loads[q], q)) if hs is not None else None
        if q is None or loads[q] + m.cost > cap:
            held = [0] * world_size
            for holders, lo, hi in m.parts:
                for h in holders:
                    held[h] += hi - lo
            q = min(range(world_size), key=lambda q: (loads[q], -held[q], q))
        owners[i] = q
        loads[q] += m.cost
    return owners, loads


def balance(loads: list[int]) -> float:
    """``max / mean`` of per-rank loads (1.0 is perfect; 1.0 for an all-zero load)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def chunk_of(matrices: list[Matrix], owners: list[int], chunks: int) -> tuple[list[int], int]:
    """Chunk index of every matrix and the number of chunks actually used (``<= chunks``).

    Each owner's matrices, largest first, are cut into ``chunks`` consecutive groups of about equal
    cost (chunk ``c`` holds the matrices whose cost midpoint falls in the ``c``-th ``1/chunks`` of
    the owner's load), so every chunk keeps all owners busy.
    """
    if chunks < 1:
        raise ValueError(f"pipeline_chunks={chunks} must be >= 1")
    by_owner: dict[int, list[int]] = {}
    for j in sorted(range(len(matrices)), key=lambda j: (-matrices[j].cost, j)):
        by_owner.setdefault(owners[j], []).append(j)
    out = [0] * len(matrices)
    for js in by_owner.values():
        total = sum(matrices[j].cost for j in js) or 1
        acc = 0
        for j in js:
            mid = acc + matrices[j].cost / 2
            out[j] = min(chunks - 1, int(mid * chunks / total))
            acc += matrices[j].cost
    used = sorted(set(out))
    remap = {c: k for k, c in enumerate(used)}
    return [remap[c] for c in out], len(used)


@dataclass
class Exchange:
    """This rank's part of one chunk's exchange (lists of ``(j, lo, hi)`` in a fixed global order).

    ``gather_send[q]`` / ``gather_recv[q]``: parts this rank sends to / receives from world index
    ``q`` before Newton-Schulz; ``scatter_send[q]`` / ``scatter_recv[q]``: result rows after it.
    ``gather`` / ``scatter``: whether *any* rank exchanges anything in this chunk (global, so every
    rank joins the same collectives). ``mine``: matrices this rank orthogonalises in this chunk.
    """

    mine: list[int]
    gather_send: list[list[tuple[int, int, int]]]
    gather_recv: list[list[tuple[int, int, int]]]
    scatter_send: list[list[tuple[int, int, int]]]
    scatter_recv: list[list[tuple[int, int, int]]]
    gather: bool = False
    scatter: bool = False


def plan_exchange(
    matrices: list[Matrix],
    owners: list[int],
    chunk: list[int],
    n_chunks: int,
    replica: tuple[int, ...],
    me: int,
) -> list[Exchange]:
    """Per-chunk :class:`Exchange` of world index ``me`` (pure; every rank builds the same lists).

    Gather: the owner takes each part it does not hold from that part's holder in the owner's
    replica (``holders[replica[owner]]``, else the first holder). Scatter: the owner sends each
    part's orthogonalised rows to every holder of the part except itself.
    """
    ws = len(replica)
    ex = [
        Exchange(
            [],
            [[] for _ in range(ws)],
            [[] for _ in range(ws)],
            [[] for _ in range(ws)],
            [[] for _ in range(ws)],
        )
        for _ in range(n_chunks)
    ]
    for j, m in enumerate(matrices):
        o, e = owners[j], ex[chunk[j]]
        if o == me:
            e.mine.append(j)
        for holders, lo, hi in m.parts:
            if o not in holders:
                r = replica[o]
                src = holders[r] if r < len(holders) else holders[0]
                e.gather = True
                if src == me:
                    e.gather_send[o].append((j, lo, hi))
                if o == me:
                    e.gather_recv[src].append((j, lo, hi))
            for h in holders:
                if h == o:
                    continue
                e.scatter = True
                if o == me:
                    e.scatter_send[h].append((j, lo, hi))
                if h == me:
                    e.scatter_recv[o].append((j, lo, hi))
    return ex
