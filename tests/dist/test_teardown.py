"""The test harness sees a rank that dies at teardown (issue 11 item 7).

A rank that finishes its work, reports success and then aborts at exit (SIGABRT, "terminate called
without an active exception": the gloo teardown bug) must fail the test, or the suite cannot show
that the abort is gone. ``benchmarks/teardown_soak.py`` counts such aborts over many launches.
"""

from __future__ import annotations

import pytest
from _dist import run_distributed


def _abort_at_exit(rank, world):
    import atexit
    import ctypes

    if rank == 1:  # after the harness's shutdown and report, at interpreter exit
        atexit.register(lambda: ctypes.CDLL("libstdc++.so.6")["_ZSt9terminatev"]())


def test_harness_fails_a_rank_that_aborts_after_reporting_success():
    with pytest.raises(AssertionError, match=r"rank 1 reported success, then exited with signal SIGABRT"):
        run_distributed(_abort_at_exit, 2)
