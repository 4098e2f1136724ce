"""Owner assignment and exchange plan for distributed Muon (pure functions, no communication).

Every rank of a process group computes the same plan from global metadata only (shapes and the
``RaggedShard`` flat ranges), so ranks agree on owners and on every split without talking.

* Owners are assigned by LPT (longest processing time first) on the Newton-Schulz cost
  ``rows * cols * min(rows, cols)``.
* A matrix whose elements all lie on one rank is owned by that rank, with no communication at all,
  as long as that keeps the rank within ``(1 + balance_slack)`` of the mean load (default 1.1);
  ``balance_slack=None`` makes locality absolute.
* Split matrices go to the least-loaded rank; ties go to the rank holding the largest part of the
  matrix (fewest bytes moved), then the lowest rank.
Source: Megatron's LayerWise Muon (LPT over whole-matrix owners), Canzona (arXiv 2602.06079,
decoupling the logical owner from the physical shard); peers-2026-12.md section 5.
"""

from __future__ import annotations

from dataclasses import dataclass

from raggedfsdp.optim._newton_schulz import ns_cost


@dataclass(frozen=True)
class Matrix:
    """One Newton-Schulz problem: rows ``[start, start + numel)`` of a parameter's flat tensor.

    ``parts``: ``(rank, lo, hi)`` for every rank holding a non-empty part, flat element range in
    the parameter (rank order, so the parts concatenate to the matrix).
    """

    item: int
    start: int
    numel: int
    rows: int
    cols: int
    parts: tuple[tuple[int, int, int], ...]

    @property
    def cost(self) -> int:
        return ns_cost(self.rows, self.cols)

    @property
    def whole_on(self) -> int | None:
        """The rank holding the whole matrix, or ``None`` when it is split over ranks."""
        return self.parts[0][0] if len(self.parts) == 1 else None


def split_matrices(item: int, mats: list[tuple[int, int, int, int]], ranges) -> list[Matrix]:
    """:class:`Matrix` records of one parameter's matrices ``(start, numel, rows, cols)`` over ``ranges``."""
    out = []
    for s, n, r, c in mats:
        if n == 0:
            continue
        parts = tuple(
            (q, max(s, a), min(s + n, b)) for q, (a, b) in enumerate(ranges) if max(s, a) < min(s + n, b)
        )
        out.append(Matrix(item, s, n, r, c, parts))
    return out


def assign_owners(
    matrices: list[Matrix], world_size: int, balance_slack: float | None = 0.1
) -> tuple[list[int], list[int]]:
    """Owner rank of every matrix and the resulting per-rank Newton-Schulz load (``ns_cost`` units).

    First every matrix whole on one rank stays there (no communication) and the split ones are
    placed by LPT, largest cost first, on the least-loaded rank (ties: the rank holding most of it,
    then the lowest rank). If that leaves ``max / mean > 1 + balance_slack``, a second LPT pass
    lets a whole matrix stay local only while its rank stays under ``(1 + balance_slack) * mean``,
    and the better-balanced of the two is used. ``balance_slack=None``: locality is absolute.
    Deterministic: depends only on the matrices' shapes and parts. O(M log M + M * W).
    """
    owners, loads = _lpt(matrices, world_size, None)
    if balance_slack is None or balance(loads) <= 1 + balance_slack:
        return owners, loads
    owners2, loads2 = _lpt(matrices, world_size, (1 + balance_slack) * sum(loads) / world_size)
    return (owners2, loads2) if balance(loads2) < balance(loads) else (owners, loads)


def _lpt(matrices: list[Matrix], world_size: int, cap: float | None) -> tuple[list[int], list[int]]:
    owners = [-1] * len(matrices)
    loads = [0] * world_size
    if cap is None:
        for i, m in enumerate(matrices):
            if m.whole_on is not None:
                owners[i] = m.whole_on
                loads[m.whole_on] += m.cost
    for i in sorted(range(len(matrices)), key=lambda i: (-matrices[i].cost, i)):
        m = matrices[i]
        if owners[i] >= 0:
            continue
        if m.whole_on is not None and loads[m.whole_on] + m.cost <= cap:
            q = m.whole_on
        else:
            held = [0] * world_size
            for r, lo, hi in m.parts:
                held[r] = hi - lo
            q = min(range(world_size), key=lambda q: (loads[q], -held[q], q))
        owners[i] = q
        loads[q] += m.cost
    return owners, loads


def balance(loads: list[int]) -> float:
    """``max / mean`` of per-rank loads (1.0 is perfect; 1.0 for an all-zero load)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
