"""The process environment of a launch: cores per rank, and where a node sits in a multi-node job."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "NodeOptions",
    "RDZV_TIMEOUT_ENV",
    "available_cpus",
    "first_slurm_host",
    "port_in_use",
    "rdzv_timeout_s",
    "node_options",
    "quiet_profiler_logs",
    "set_threads",
    "threads_per_rank",
]


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: Environment for processes that run ``torch.profiler`` for measurement only (``bench`` / ``wrap-bench``
#: CPU peak memory): kineto logs nothing (its ``USDT ... profiler_start/stop`` lines and, with a CUDA
#: build on a machine without a GPU, ``ERROR ... gpuGetDeviceCount failed``; levels 0-5 print, 6 none),
#: and c10's C++ log prints errors only (``CPUAllocator ... unknown size`` is a warning of the profiled
#: CPU allocator about blocks allocated before the session). Set as defaults: a value the user exported
#: wins. kineto reads its level when the first profiler session starts, c10 when torch is imported.
QUIET_PROFILER_ENV = {"KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def quiet_profiler_logs(environ: dict | None = None) -> None:
    """Apply :data:`QUIET_PROFILER_ENV` as defaults to ``environ`` (default ``os.environ``): call it in a
    launcher before its ranks start, or in a process before its first ``torch.profiler`` session."""
    env = os.environ if environ is None else environ
    for key, value in QUIET_PROFILER_ENV.items():
        env.setdefault(key, value)


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads for each of ``local_world_size`` ranks on this machine: one share of the cores
    (``available_cpus() // local_world_size``), fewer when the machine is busy: at most one share of
    the cores the 1-minute load average leaves idle, and at least 1.

    Why the load: OpenMP threads that outnumber the free cores spin-wait on each other; a one-process
    run with 2 threads on a busy 2-core machine ran 10-20x slower per step than with 1 (12.5-27 s vs
    1.0-1.4 s). torchrun sets ``OMP_NUM_THREADS=1`` for several ranks per node."""
    cpus = available_cpus()
    share = max(1, cpus // max(1, local_world_size))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system: the plain share
        return share
    idle = max(0, cpus - round(load))
    return max(1, min(share, idle // max(1, local_world_size)))


def set_threads(local_world_size: int) -> int:
    """``torch.set_num_threads``: ``OMP_NUM_THREADS`` when set, else :func:`threads_per_rank` (also
    exported as ``OMP_NUM_THREADS`` for the process's children). Returns the number."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS") or 0) or threads_per_rank(local_world_size)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(n)
    return n


@dataclass(frozen=True)
class NodeOptions:
    """Where this launcher sits in a multi-node job (torchrun's static rendezvous).

    ``nnodes`` launchers (one per node) each start ``nproc`` ranks; global rank = ``node_rank x
    nproc + local rank``, so rank 0 is on node 0. ``endpoint`` (``HOST:PORT``) is node 0's address,
    where torchrun's store listens.
    """

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    rdzv_id: str = "raggedfsdp"

    def torchrun_argv(self, nproc: int) -> list[str]:
        """The torchrun flags placing this node (``--standalone`` for one node)."""
        if self.nnodes == 1:
            return ["--standalone", f"--nproc-per-node={nproc}"]
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--nproc-per-node={nproc}",
                "--rdzv-backend=static", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.rdzv_id}",
                f"--rdzv-conf=timeout={rdzv_timeout_s()}", "--max-restarts=0"]  # fmt: skip

    def check_endpoint(self) -> None:
        """Pre-launch check of ``endpoint`` (several nodes), ``ValueError`` in one line:
        a host that does not resolve (torchrun retried DNS for 15 minutes, deaf to Ctrl-C), and on
        node 0 a port already in use (torchrun's store could not listen: a 44-line traceback). Cost:
        one DNS lookup (the resolver's own timeout) and, on node 0, one ``bind``."""
        if self.nnodes == 1 or self.endpoint is None:
            return
        import socket

        host, _, port = self.endpoint.rpartition(":")
        host = host.strip("[]")
        try:
            socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(
                f"--rdzv-endpoint {self.endpoint}: cannot resolve host {host!r} ({why}): check the "
                "spelling; it must be node 0's address, the same on every node"
            ) from None
        if self.node_rank != 0:
            return
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore server
            try:
                sock.bind(("", int(port)))
            except OSError as e:
                raise ValueError(port_in_use(self.endpoint, e)) from None


def port_in_use(endpoint: str, err) -> str:
    """The one line for node 0's rendezvous port that cannot be listened on (``err``: the cause)."""
    port = endpoint.rpartition(":")[2]
    why = getattr(err, "strerror", None) or str(err).splitlines()[-1]
    return (
        f"--rdzv-endpoint {endpoint}: node 0 cannot listen on port {port} ({why}; another job or a "
        f"previous run still holds it?): pick a free port, the same on every node, e.g. "
        f"--rdzv-endpoint {endpoint.rpartition(':')[0]}:{int(port) + 1}"
    )


RDZV_TIMEOUT_ENV = "RAGGEDFSDP_RDZV_TIMEOUT_S"


def rdzv_timeout_s() -> int:
    """Seconds a node waits for the others at the rendezvous (torchrun's default: 900): 300, or
    ``RAGGEDFSDP_RDZV_TIMEOUT_S``."""
    try:
        return max(1, int(os.environ.get(RDZV_TIMEOUT_ENV) or 300))
    except ValueError:
        return 300


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,09],cpu1`` -> ``gpu03``; ``a,b`` -> ``a``."""
    head = nodelist.strip()
    depth = 0
    for i, ch in enumerate(head):  # cut at the first comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, rng = head.split("[", 1)
    first = rng.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first


def node_options(nnodes: int | None, node_rank: int | None, endpoint: str | None, rdzv_id: str | None,
                 environ: dict | None = None) -> NodeOptions:  # fmt: skip
    """Resolve the node flags of ``raggedfsdp train``, filling what is not given from SLURM
    (``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``) or
    ``MASTER_ADDR``/``MASTER_PORT``; pure (reads ``environ``, default ``os.environ``).

    Raises:
        ValueError: naming the flag, the value and the fix: ``--nnodes < 1``, ``--node-rank`` outside
            ``[0, nnodes)``, or several nodes without an endpoint (or a malformed ``HOST:PORT``).
    """
    env = os.environ if environ is None else environ
    slurm = "SLURM_JOB_ID" in env and int(env.get("SLURM_NNODES", "1") or 1) > 1
    if nnodes is None:
        nnodes = int(env["SLURM_NNODES"]) if slurm else 1
    if node_rank is None:
        node_rank = int(env.get("SLURM_NODEID", 0)) if slurm else 0
    if rdzv_id is None:
        rdzv_id = env.get("SLURM_JOB_ID", "raggedfsdp")
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, {nnodes}) for --nnodes {nnodes}")
    if nnodes == 1:
        return NodeOptions(1, 0, None, rdzv_id)
    if endpoint is None:
        port = env.get("MASTER_PORT", "29500")
        if env.get("MASTER_ADDR"):
            endpoint = f"{env['MASTER_ADDR']}:{port}"
        elif slurm and env.get("SLURM_JOB_NODELIST"):
            endpoint = f"{first_slurm_host(env['SLURM_JOB_NODELIST'])}:{port}"
        else:
            raise ValueError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, the same on every "
                "node), e.g. --rdzv-endpoint 10.0.0.1:29500"
            )
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--rdzv-endpoint {endpoint!r} must be HOST:PORT with a port in 1-65535, e.g. node0:29500"
        )
    return NodeOptions(nnodes, node_rank, endpoint, rdzv_id)
