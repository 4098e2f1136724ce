"""`raggedfsdp train`'s node flags: explicit, from SLURM, from MASTER_ADDR, and the refusals."""

from __future__ import annotations

import pytest

from raggedfsdp.app.launch.env import NodeOptions, first_slurm_host, node_options


def test_single_node_is_standalone():
    n = node_options(None, None, None, None, environ={})
    assert n == NodeOptions(1, 0, None, "raggedfsdp")
    assert n.torchrun_argv(4) == ["--standalone", "--nproc-per-node=4"]


def test_explicit_flags():
    n = node_options(2, 1, "127.0.0.1:29511", "job7", environ={})
    assert n.torchrun_argv(2) == [
        "--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--rdzv-backend=static",
        "--rdzv-endpoint=127.0.0.1:29511", "--rdzv-id=job7", "--rdzv-conf=timeout=300", "--max-restarts=0",
    ]  # fmt: skip


def test_from_slurm():
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "3",
           "SLURM_JOB_NODELIST": "gpu[07-10],cpu1", "MASTER_PORT": "29600"}  # fmt: skip
    assert node_options(None, None, None, None, environ=env) == NodeOptions(4, 3, "gpu07:29600", "4242")
    env["MASTER_ADDR"] = "10.1.2.3"
    assert node_options(None, None, None, None, environ=env).endpoint == "10.1.2.3:29600"
    # explicit flags win over SLURM's
    assert node_options(2, 0, "h:1", "x", environ=env) == NodeOptions(2, 0, "h:1", "x")


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("a", "a"), ("a,b", "a"), ("gpu[03-05,09]", "gpu03"), ("n[1,4],m[2-3]", "n1"), ("x[08]", "x08")],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_refusals_name_the_flag_and_fix():
    with pytest.raises(ValueError, match="--nnodes must be >= 1, got 0"):
        node_options(0, None, None, None, environ={})
    with pytest.raises(ValueError, match=r"--node-rank 2 must be in \[0, 2\)"):
        node_options(2, 2, "h:1", None, environ={})
    with pytest.raises(ValueError, match="--nnodes 2 needs --rdzv-endpoint HOST:PORT"):
        node_options(2, 0, None, None, environ={})
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        node_options(2, 0, "node0", None, environ={})


def test_threads_per_rank_leaves_busy_cores_alone(monkeypatch):
    """A one-process run took 2 OpenMP threads on a busy 2-core machine and ran 10-20x slower per step
    than with 1 (issue 41 item 13): the threads per rank are one share of the idle cores, at least 1."""
    import os

    import torch

    from raggedfsdp.app.launch import env

    monkeypatch.setattr(env, "available_cpus", lambda: 8)
    for load, nproc, want in [(0.1, 1, 8), (0.1, 2, 4), (0.1, 3, 2), (3.6, 1, 4), (7.9, 1, 1), (20.0, 1, 1),
                              (20.0, 4, 1), (2.0, 2, 3)]:  # fmt: skip
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert env.threads_per_rank(nproc) == want, (load, nproc)
    monkeypatch.setattr(os, "getloadavg", lambda: (16.0, 16.0, 16.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert env.set_threads(1) == 1 and torch.get_num_threads() == 1  # the one-process worker's call
        assert os.environ["OMP_NUM_THREADS"] == "1"
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an explicit value wins
        assert env.set_threads(1) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
