"""benchmarks/gpu (issue 21 item 7) without a GPU: the trace parsers against brute force, the stage plan
against the 460 s deadline, and the driver's kill of a stage's whole process group at its limit.

The full CPU dry run of ``bash benchmarks/gpu/run.sh --dry-run`` in a venv holding only torch is a
step of ``.ci/run`` (it takes minutes, so it is not a unit test).
"""

from __future__ import annotations

import os
import random
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))

import _common  # noqa: E402 (from benchmarks/gpu, put on sys.path above)
import run as driver  # noqa: E402


def _kernel(stream, ts, dur, cat="kernel", name="k"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_stream_overlap_matches_brute_force():
    rng = random.Random(0)
    ev = [
        _kernel(7, rng.randrange(0, 1000), rng.randrange(1, 60)) for _ in range(40)
    ]  # compute: most kernel time
    side = [
        _kernel(s, rng.randrange(0, 1000), rng.randrange(1, 30), cat=rng.choice(["kernel", "gpu_memcpy"]))
        for s in (20, 24)
        for _ in range(8)
    ]
    got = _common.stream_overlap(ev + side + [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 5}])
    busy = set()
    for e in ev:
        busy.update(range(e["ts"], e["ts"] + e["dur"]))  # 1-us cells
    total = sum(e["dur"] for e in side)
    over = sum(len(busy & set(range(e["ts"], e["ts"] + e["dur"]))) for e in side)
    assert got["compute_stream"] == 7 and got["streams"] == 3
    assert got["side_us"] == pytest.approx(total)
    assert got["overlap_fraction"] == pytest.approx(over / total, abs=1e-4)
    assert _common.stream_overlap([])["overlap_fraction"] is None


def test_sync_calls_are_counted_inside_their_annotation_only():
    ann = {"ph": "X", "cat": "user_annotation", "name": "step::backward", "ts": 100, "dur": 50}
    calls = [
        {"ph": "X", "cat": "cuda_runtime", "name": n, "ts": t, "dur": 1}
        for n, t in (
            ("cudaStreamSynchronize", 120),
            ("cudaEventSynchronize", 149),
            ("cudaLaunchKernel", 130),
            ("cudaStreamSynchronize", 99),
            ("cudaDeviceSynchronize", 151),
            ("cudaMemcpyAsync", 110),
        )
    ]
    got = _common.sync_calls_in([ann, *calls], "step::backward")
    assert got == {
        "calls": 2,
        "by_name": {"cudaStreamSynchronize": 1, "cudaEventSynchronize": 1},
        "ranges": 1,
    }
    assert _common.sync_calls_in(calls, "step::backward")["calls"] == 0  # no annotation: nothing counted


def test_sync_calls_are_named_by_their_innermost_cpu_op_and_thread():
    def x(name, ts, dur, tid, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        x("step::fwd_bwd", 100, 100, 1, "user_annotation"),
        x("aten::_to_copy", 110, 20, 1),
        x("aten::copy_", 112, 10, 1),  # innermost: the sync's op, aten::_to_copy its parent
        x("cudaStreamSynchronize", 115, 1, 1, "cuda_runtime"),
        x("autograd::engine::evaluate_function", 140, 40, 2),  # another thread (autograd's device thread)
        x("cudaMemcpy", 150, 1, 2, "cuda_runtime"),
        x("aten::item", 300, 5, 1),  # outside the annotation: not counted
        x("cudaStreamSynchronize", 301, 1, 1, "cuda_runtime"),
    ]
    got = _common.sync_calls_in(events, "step::fwd_bwd", ops=True)
    assert got["calls"] == 2
    assert got["by_op"] == {
        "cudaStreamSynchronize in aten::copy_ < aten::_to_copy [main thread]": 1,
        "cudaMemcpy in autograd::engine::evaluate_function [other thread]": 1,
    }


def test_stage_plan_fits_the_deadline():
    total = driver.ENV_BUDGET + sum(b for _, _, b in driver.STAGES)
    assert total <= driver.DEADLINE <= 460, total
    names = [s for s, _, _ in driver.STAGES]
    assert names == ["smoke", "dense", "moe", "sim8", "moe128", "quant"]
    # every later stage keeps half its budget even when an earlier one could take all that is left
    t0 = time.monotonic() - 100  # 100 s already used
    for i in range(len(driver.STAGES)):
        later = sum(b for _, _, b in driver.STAGES[i + 1 :]) / 2
        assert driver.stage_timeout(i, t0, 460, 1000, False) <= 460 - 100 - later + 1


def test_stage_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(60)']);open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    t0 = time.monotonic()
    rc, _, _ = driver.run_stage([sys.executable, "-c", code], 3.0, str(tmp_path / "log"))
    assert rc == "timeout" and time.monotonic() - t0 < 30
    child = int(pidfile.read_text())
    for _ in range(50):  # the grandchild got the group kill (allow the reaper a moment)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail("the stage's child process survived the timeout")
