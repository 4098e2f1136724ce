"""Straggler attribution (``train/straggler.py``): ``attribute`` against a brute-force numpy reference,
the naming rule, and the stall clock against a process really stopped (SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from raggedfsdp.app.train.straggler import StallClock, attribute, describe, named


@pytest.mark.parametrize("world", [2, 3, 5])
def test_attribute_matches_a_brute_force_reference(world):
    rng = np.random.default_rng(world)
    segs = [("forward", f"layers.{i}") for i in range(3)] + [("backward", "layers.0"), ("optimizer", "")]
    for _ in range(20):
        a = rng.uniform(0.01, 0.1, size=(world, len(segs)))
        a[rng.integers(world), rng.integers(len(segs))] += rng.uniform(0.05, 0.5)
        steps = int(rng.integers(1, 5))
        rep = attribute((a * steps).tolist(), segs, steps)
        # reference: the rank whose summed own time most exceeds the median of the others' sums, and
        # the segment where that rank's excess over the median of the others is largest
        tot = a.sum(axis=1)
        r = int(tot.argmax())
        own_med = float(np.median(np.delete(tot, r)))
        excess = [a[r, s] - np.median(np.delete(a[:, s], r)) for s in range(len(segs))]
        s = int(np.argmax(excess))
        med = float(np.median(np.delete(a[:, s], r)))
        assert (rep["rank"], (rep["phase"], rep["unit"])) == (r, segs[s])
        assert rep["own_excess_s"] == pytest.approx(tot[r] - own_med) and rep[
            "own_median_s"
        ] == pytest.approx(own_med)
        assert rep["own_excess_pct"] == pytest.approx(100 * (tot[r] - own_med) / own_med)
        assert rep["excess_s"] == pytest.approx(excess[s]) and rep["median_s"] == pytest.approx(med)
        assert describe(rep).startswith(
            f"slowest rank {r}: +{100 * (tot[r] - own_med) / own_med:.0f} % own time"
        )


def test_attribute_needs_two_ranks_segments_and_steps():
    assert attribute([[1.0]], [("forward", "root")], 1) is None
    assert attribute([[], []], [], 1) is None
    assert attribute([[1.0], [2.0]], [("forward", "root")], 0) is None


def test_named_only_above_both_thresholds_and_never_the_first_step():
    base = {"rank": 1, "phase": "stalled", "unit": "", "excess_pct": 900.0, "excess_s": 0.3, "median_s": 0.0}
    rep = {**base, "own_excess_pct": 400.0, "own_excess_s": 0.4, "own_median_s": 0.1}
    assert named(rep) and "stopped inside collectives" in describe(rep)
    assert not named({**rep, "warmup": True})
    assert not named({**rep, "own_excess_pct": 40.0})  # 40 % of 1 s: below REPORT_PCT
    assert not named(
        {**rep, "own_excess_s": 0.01, "own_excess_pct": 1000.0}
    )  # 10 ms/step: below REPORT_MIN_S
    assert not named(None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP")
def test_stall_clock_counts_the_time_a_process_was_stopped():
    """A child runs a StallClock; the parent stops it 0.6 s (SIGSTOP/SIGCONT): the child's clock says
    about 0.6 s. The reference without a stop: a clock in this process for 0.5 s says about 0."""
    code = (
        "import time\n"
        "from raggedfsdp.app.train.straggler import StallClock\n"
        "c = StallClock(); c.start(); print('go', flush=True); time.sleep(1.2)\n"
        "print(c.stalled(), flush=True); c.stop()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert p.stdout.readline().strip() == "go"
    time.sleep(0.1)
    os.kill(p.pid, signal.SIGSTOP)
    time.sleep(0.6)
    os.kill(p.pid, signal.SIGCONT)
    stalled = float(p.stdout.readline())
    p.wait(timeout=30)
    assert 0.5 < stalled < 0.9, stalled
    c = StallClock()
    c.start()
    time.sleep(0.5)
    assert c.stalled() < 0.3
    c.stop()
    c.stop()  # idempotent, joined
    assert c._thread is None
