"""The watchdog's hang timeout (issue 23 item 2): job.hang_timeout_s at most, adaptive to the step
time once steps were seen, always below the process-group timeout. Reference: the rule written out."""

from __future__ import annotations

import time

from raggedfsdp.app.train.watchdog import MIN_HANG_S, PG_FRACTION, STEP_FACTOR, Watchdog


def _wd(**kw):
    return Watchdog(rank=0, world_size=2, tag="[rank 0/2]", **kw)  # never started: no thread


def test_effective_timeout_rule():
    wd = _wd(timeout_s=60.0)
    assert wd.effective_timeout() == (60.0, "job.hang_timeout_s=60")  # no step seen yet
    for step in (1, 2, 3):  # fast steps (a few ms): the floor, 30 s
        wd.progress(f"step {step} start", step)
        time.sleep(0.01)
    t, why = wd.effective_timeout()
    assert t == MIN_HANG_S and "slowest recent step" in why, (t, why)
    wd._steps = [0.1, 2.5, 0.2]  # one slow step of 2.5 s: 20 x 2.5 = 50 s
    assert wd.effective_timeout()[0] == STEP_FACTOR * 2.5
    wd._steps = [10.0]  # 200 s > job.hang_timeout_s: the configured value is the most
    assert wd.effective_timeout()[0] == 60.0
    capped = _wd(timeout_s=60.0, pg_timeout_s=20.0)
    assert capped.effective_timeout() == (PG_FRACTION * 20.0, "0.6 x job.pg_timeout_s=20")
    assert _wd(timeout_s=0.0, pg_timeout_s=20.0).effective_timeout() == (0.0, "off")
    # a save makes no marks while DCP writes: watched with the longest limit below the pg timeout
    # (issue 23 item 2), whatever the step times; back to the step rule after it
    wd = _wd(timeout_s=10.0, pg_timeout_s=200.0)
    wd.arm()
    with wd.watching("save", "saving step 3"):
        assert (wd.phase, wd.where) == ("save", "saving step 3") and not wd._paused
        assert wd.effective_timeout() == (PG_FRACTION * 200.0, "in a save: 0.6 x job.pg_timeout_s=200")
    assert wd.phase == "start-up" and wd.effective_timeout() == (10.0, "job.hang_timeout_s=10")


def test_dcp_file_writes_are_not_a_collective():
    from torch.distributed.checkpoint import filesystem

    from raggedfsdp.app.train.watchdog import in_collective

    class F:  # a stand-in for a frame inside DCP's FileSystemWriter (this rank's own I/O)
        f_code = type("C", (), {"co_filename": filesystem.__file__})()

    assert not in_collective(F())
