"""The watchdog's hang timeout (issue 23 item 2): job.hang_timeout_s at most, adaptive to the step
time once steps were seen, always below the process-group timeout. Reference: the rule written out."""

from __future__ import annotations

import sys
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


def _in_fake_compiler(fn):
    """Call ``fn()`` from a frame whose code says it is torch's ``_dynamo/convert_frame.py``."""
    import os

    path = os.path.join("site-packages", "torch", "_dynamo", "convert_frame.py")
    scope = {"fn": fn}
    exec(compile("def _compile():\n    return fn()\n", path, "exec"), scope)
    return scope["_compile"]()


def test_a_compiling_main_thread_is_not_a_hang_until_the_compile_limit():
    """torch.compile's first step makes no progress marks for a minute on 2 CPU cores: the watchdog
    killed ``--compile true`` runs as hung (issue 41 item 12). While the compiler is on the main thread's
    stack the limit is ``compile_timeout`` (job.pg_timeout_s); outside it, the usual rule."""
    from raggedfsdp.app.train.watchdog import compile_timeout, compiling

    assert _in_fake_compiler(lambda: compiling(sys._getframe()))
    assert not compiling(sys._getframe())
    assert compile_timeout(60.0, 120.0) == 120.0 and compile_timeout(60.0, 0.0) == 60.0
    assert compile_timeout(0.0, 120.0) == 0.0

    wd = _wd(timeout_s=0.5, pg_timeout_s=4.0)
    failed = []
    wd._fail = lambda culprit, message, frame: failed.append(message)
    wd.arm()
    wd._last = time.monotonic() - 1.0  # 1 s without progress: past 0.5 s, within the compile limit
    _in_fake_compiler(wd._tick)
    assert failed == []
    wd._tick()  # just after the compile (e.g. the forward runs before the backward's compile): progress
    assert failed == []
    wd._compiled_at -= 1.0  # 1 s after the last compile seen, outside the compiler: a hang (the control)
    wd._tick()
    assert len(failed) == 1 and "hang timeout 0.5s" in failed[0], failed
    _in_fake_compiler(wd._tick)  # a compile going on for 5 s, past job.pg_timeout_s: named, saying so
    wd._compile_since -= 5.0
    wd._last -= 10.0  # (its last mark came before the compile began)
    _in_fake_compiler(wd._tick)
    assert len(failed) == 2 and "compiling (torch.compile): job.pg_timeout_s=4" in failed[1], failed


class _Store:  # the job's TCPStore, as the watchdog uses it
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, k):
        return self.d[k]


def test_a_paused_job_is_not_a_hang_but_a_peer_stopped_alone_is_named(monkeypatch):
    """The whole job stopped for 40 s (SIGSTOP of the process group, SIGCONT): on resume rank 1's
    watchdog declared rank 0 frozen and the job died (issue 41 item 3). A gap between the watchdog's own
    ticks is a stop of this process: not idle time, and the peers' heartbeats, as old as the stop, are
    not judged until they had time to beat again. A peer stopped alone is still named (no gap here)."""
    import json

    from raggedfsdp.app.train import watchdog

    monkeypatch.setattr(watchdog, "in_collective", lambda frame: True)  # rank 1 waits in a collective
    store = _Store()
    wd = Watchdog(rank=1, world_size=2, tag="[rank 1/2]", timeout_s=5.0, store=store)
    failed = []
    wd._fail = lambda culprit, message, frame: failed.append((culprit, message))
    wd.arm()
    t0, w0 = time.monotonic(), time.time()
    # both ranks stopped 40 s ago; rank 0's last heartbeat is from then
    wd._tick_at, wd._last = (t0 - 40.0, w0 - 40.0), t0 - 40.5
    store.set("hb0", json.dumps({"t": w0 - 40.0, "step": 3, "where": "step 3", "phase": "train"}))
    wd._tick()  # the first tick after SIGCONT: a stop, not a hang
    assert failed == [] and time.monotonic() - wd._last < 2.0
    wd._last -= 6.0  # still waiting 6 s later (> the 5 s timeout) and rank 0 has not beaten yet
    wd._tick()
    assert failed == []  # within the grace after the resume
    wd._resumed_at -= 10.0  # the grace is over and rank 0's heartbeat is still 40 s old: frozen
    wd._tick()
    assert [c for c, _ in failed] == [0] and "rank 0 stopped responding: no heartbeat for" in failed[0][1]

    # the control: rank 0 alone stopped (this rank ran all along): named at once
    wd2 = Watchdog(rank=1, world_size=2, tag="[rank 1/2]", timeout_s=5.0, store=store)
    wd2._fail = lambda culprit, message, frame: failed.append((culprit, message))
    wd2.arm()
    wd2._tick_at, wd2._last = (time.monotonic() - 0.5, time.time() - 0.5), time.monotonic() - 6.0
    wd2._tick()
    assert [c for c, _ in failed] == [0, 0]
