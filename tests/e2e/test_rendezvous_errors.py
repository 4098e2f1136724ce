"""Multi-node start-up errors (issue 41 item 4), as a user meets them, two launchers on 127.0.0.1:

- node 0's rendezvous port is in use: torch's 44-line traceback ending in EADDRINUSE -> one line,
  exit 2, before the launch;
- node 1 against that port (held by another program, which accepts and never answers): no message,
  killed at 200 s -> a bounded wait announced at the launch and one line at its end, exit 1;
- a mistyped ``--rdzv-endpoint`` host: DNS retries for 15 minutes, deaf to Ctrl-C -> one line within
  seconds, exit 2;
- Ctrl-C while node 1 waits for a node 0 that never comes: ignored (C++ wait) -> exit 130 at once.

The references are the test's own socket (the port it holds) and its own host name."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raggedfsdp.app.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "debug", "--steps", "2", "--nproc", "1", "--nnodes", "2"]


def _held_port():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def _node(rank: int, endpoint: str, out, **env):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        env.pop(k, None)
    return subprocess.Popen(
        [sys.executable, "-m", "raggedfsdp.app.cli", "train", *ARGS, "--node-rank", str(rank),
         "--rdzv-endpoint", endpoint, "--out", str(out)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip


@pytest.mark.core
def test_node0_port_in_use_is_one_line_before_the_launch(tmp_path, capsys):
    sock, port = _held_port()
    with sock:
        t0 = time.monotonic()
        rc = cli_main(["train", *ARGS, "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}",
                       "--out", str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"raggedfsdp train: error: --rdzv-endpoint 127.0.0.1:{port}: node 0 cannot listen on port {port} "
        "(Address already in use"
    ), err
    assert f"--rdzv-endpoint 127.0.0.1:{port + 1}" in err[0], err
    assert time.monotonic() - t0 < 30


@pytest.mark.core
@pytest.mark.parametrize("rank", [0, 1])
def test_a_mistyped_host_is_one_line_within_seconds(tmp_path, capsys, rank):
    t0 = time.monotonic()
    rc = cli_main(["train", *ARGS, "--node-rank", str(rank), "--rdzv-endpoint", "nosuchnode0.invalid:29500",
                   "--out", str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(
        "raggedfsdp train: error: --rdzv-endpoint nosuchnode0.invalid:29500: cannot resolve host "
        "'nosuchnode0.invalid' ("
    ), err
    assert time.monotonic() - t0 < 30


def test_node1_against_a_port_that_never_answers_ends_with_one_line(tmp_path):
    sock, port = _held_port()
    with sock:
        t0 = time.monotonic()
        p = _node(1, f"127.0.0.1:{port}", tmp_path / "o", RAGGEDFSDP_RDZV_TIMEOUT_S="5")
        try:
            _, err = p.communicate(timeout=150)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    took = time.monotonic() - t0
    lines = err.strip().splitlines()
    assert "waiting up to 5 s for the other nodes" in lines[0], lines
    assert p.returncode == 1, lines
    assert lines[-1].startswith(f"raggedfsdp train: error: no rendezvous at 127.0.0.1:{port} within 35 s"), (
        lines
    )
    assert took < 120, took


def test_ctrl_c_while_node1_waits_for_the_rendezvous(tmp_path):
    with socket.socket() as s:  # a free port nobody listens on: node 0 never comes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _node(1, f"127.0.0.1:{port}", tmp_path / "o")
    try:
        first = p.stderr.readline()
        assert "waiting up to 300 s" in first, first
        time.sleep(5)  # inside torchrun's rendezvous wait
        assert p.poll() is None
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = err.strip().splitlines()
    assert p.returncode == 130, lines
    assert lines[-1] == (
        f"raggedfsdp train: interrupted by SIGINT while waiting for the rendezvous at 127.0.0.1:{port}"
    ), lines
    assert took < 10, took
