"""``launch.env.quiet_profiler_logs``: a process that measures with ``torch.profiler`` (bench /
wrap-bench CPU peak memory) prints no kineto log lines (``USDT ... profiler_start/stop``); a value the
user exported wins; both bench launchers apply it before their ranks start (issue 24, rough edge 3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROFILE = (
    "import torch\n{pre}from torch.profiler import ProfilerActivity, profile\nwith "
    "profile(activities=[ProfilerActivity.CPU], profile_memory=True):\n    torch.ones(3) + 1\n"
)


def test_profiler_session_prints_nothing_after_quiet_profiler_logs():
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    pre = "from raggedfsdp.app.launch.env import quiet_profiler_logs; quiet_profiler_logs()\n"
    quiet = subprocess.run([sys.executable, "-c", _PROFILE.format(pre=pre)], capture_output=True, text=True, check=False,
                           env=env, timeout=240)  # fmt: skip
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "profiler_start" not in quiet.stderr and "USDT" not in quiet.stderr, quiet.stderr
    # the reference: the same session without it prints kineto's lines (else this test checks nothing)
    loud = subprocess.run([sys.executable, "-c", _PROFILE.format(pre="")], capture_output=True, text=True, check=False,
                          env=env, timeout=240)  # fmt: skip
    if "profiler_start" not in loud.stderr:
        pytest.skip("this torch build's kineto prints no USDT lines; nothing to silence")


def test_user_value_wins_and_launchers_apply_it(monkeypatch):
    from raggedfsdp.app.launch.env import QUIET_PROFILER_ENV, quiet_profiler_logs

    env = {"KINETO_LOG_LEVEL": "0"}
    quiet_profiler_logs(env)
    assert env == {**QUIET_PROFILER_ENV, "KINETO_LOG_LEVEL": "0"}
    import torch.distributed.run as tdr

    from raggedfsdp.app.cli import main

    for argv in (["wrap-bench", "--nproc", "1", "--steps", "1"], ["bench", "--nproc", "1", "--steps", "1"]):
        for key in QUIET_PROFILER_ENV:
            monkeypatch.delenv(key, raising=False)
        seen = []
        monkeypatch.setattr(
            tdr, "run", lambda ns, seen=seen: seen.append({k: os.environ.get(k) for k in QUIET_PROFILER_ENV})
        )
        assert main(argv) == 0
        assert seen == [QUIET_PROFILER_ENV], argv  # set before torchrun starts the ranks
