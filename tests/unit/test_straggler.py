"""Straggler attribution (issue 23 item 7): ``attribute`` against a brute-force numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from raggedfsdp.app.train.straggler import attribute, describe


@pytest.mark.parametrize("world", [2, 3, 5])
def test_attribute_matches_a_brute_force_reference(world):
    rng = np.random.default_rng(world)
    units = [f"layers.{i}" for i in range(4)]
    for _ in range(20):
        a = rng.uniform(0.01, 0.1, size=(world, len(units)))
        slow_r, slow_u = rng.integers(world), rng.integers(len(units))
        a[slow_r, slow_u] += rng.uniform(0.05, 0.5)
        steps = int(rng.integers(1, 5))
        rep = attribute((a * steps).tolist(), units, steps)
        # reference: per unit, the slowest rank's excess over the median of the other ranks
        excess = [a[:, u].max() - np.median(np.delete(a[:, u], a[:, u].argmax())) for u in range(len(units))]
        u = int(np.argmax(excess))
        r = int(a[:, u].argmax())
        med = float(np.median(np.delete(a[:, u], r)))
        assert (rep["rank"], rep["unit"]) == (r, units[u])
        assert rep["excess_s"] == pytest.approx(excess[u]) and rep["median_s"] == pytest.approx(med)
        assert rep["excess_pct"] == pytest.approx(100 * excess[u] / med)
        assert describe(rep).startswith(
            f"slowest rank {r}: +{100 * excess[u] / med:.0f} % before all-gather of {units[u]}"
        )


def test_attribute_needs_two_ranks_units_and_steps():
    assert attribute([[1.0]], ["root"], 1) is None
    assert attribute([[], []], [], 1) is None
    assert attribute([[1.0], [2.0]], ["root"], 0) is None
