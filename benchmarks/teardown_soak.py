"""Teardown soak (issue 11 item 7): launch a short multi-rank job N times, count the runs that end
with a SIGABRT or a "terminate called" line after their work succeeded.

    python benchmarks/teardown_soak.py --case bare    --runs 30  --nproc 3   # control: must abort
    python benchmarks/teardown_soak.py --case harness --runs 200 --nproc 3
    python benchmarks/teardown_soak.py --case fsdp    --runs 200 --nproc 3
    python benchmarks/teardown_soak.py --case train   --runs 50  --nproc 3

Cases (each run is a separate launch of fresh processes):

- ``bare``: the issue's lead, torch only: ``init_device_mesh("cpu", (N,))``, one ``all_reduce``,
  plain ``destroy_process_group()``. The control: it must show aborts, or the soak cannot see the bug.
- ``harness``: the same script ending with ``raggedfsdp.teardown.shutdown_process_group()``.
- ``fsdp``: one raggedfsdp ``fully_shard`` training step (forward, backward, reduce-scatter, AdamW)
  on a small LM through the test harness (``tests/_dist.py: run_distributed``, FileStore, spawn),
  which tears down with ``shutdown_process_group`` and checks every rank's exit code.
- ``train``: ``raggedfsdp train`` of the debug model, 2 steps, batch 6 x 16 (torchrun inside).

- ``user`` / ``user41``: users' own scripts (ToyLM; issue 41 item 11's script, ``--backend torch``
  for torch's ``fully_shard``), ending with a plain ``dist.barrier(); dist.destroy_process_group()``.

Catching an abort: every rank enables ``faulthandler`` (Python stacks on SIGABRT); ``--cores``
(fresh / torchrun launches) lets ranks dump core in the run's own directory and, with
``SOAK_KEEP_DIR``, keeps ``gdb``'s ``thread apply all bt`` of each core beside the run's output;
``--train-before 2`` runs the report's 2-rank ``raggedfsdp train`` before every run.

``bare`` and ``harness`` start the N ranks directly (env:// rendezvous on a free port, rank 0 hosts
the TCPStore), so each rank's exit status is seen; ``--launcher torchrun`` runs them under torchrun
as the issue's lead did. A run counts as *aborted* if any rank (or the launcher) died of a signal
or printed ``terminate called``; as *failed* if it exited non-zero for another reason. Every run is
bounded by ``--timeout`` s. Prints one line per aborted/failed run and a summary row.
"""

from __future__ import annotations

import atexit
import ctypes

_EXIT_HOLD: dict = {}  # --leak-work, rank 1: the store and the object freed at teardown
_HOLD_US = ctypes.c_uint(0)  # --leak-work, rank 1: how long the last exit handler keeps the GIL (us)


def _tell_rank0_at_exit() -> None:
    """--leak-work, rank 1's second-to-last exit handler: rank 0 may now finish the leaked collective."""
    if _EXIT_HOLD:
        _EXIT_HOLD["store"].set("soak/rank1-exiting", "1")


class _SleepAtTeardown:
    """--leak-work: freed with the module globals, after the interpreter began finalizing; sleeping
    releases the GIL, so the waiting gloo worker surely runs then (at high load it may otherwise not
    get the CPU before the process has ended)."""

    def __del__(self, _sleep=__import__("time").sleep) -> None:  # bound now: module globals are gone then
        _sleep(0.5)


# --leak-work positive control, registered before torch is imported so that these run last at exit:
# rank 1 tells rank 0 to finish the leaked all-reduce, then sits in a C call that keeps the GIL
# (usleep through ctypes.PyDLL, called by atexit itself: no bytecode runs after it, so the GIL is
# not handed over before finalization begins). Its gloo worker, freeing the leaked work and the
# tensor only that work holds, asks for the GIL meanwhile, and the finalizing interpreter ends the
# thread inside the tensor's noexcept destructor -> std::terminate. At high load a descheduled
# main thread or worker does the same by chance.
atexit.register(ctypes.PyDLL(None).usleep, _HOLD_US)
atexit.register(_tell_rank0_at_exit)

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ("bare", "harness", "fsdp", "train", "user", "user41")


# -- what the ranks run ----------------------------------------------------------------------------


def _maybe_inject_abort() -> None:
    """``--inject-abort``: rank 1 calls ``std::terminate()`` at interpreter exit, the exact signature
    of the teardown bug (SIGABRT, "terminate called without an active exception"). A positive
    control for the detector, in whichever launch path the case uses."""
    if os.environ.get("SOAK_ABORT") == "1" and os.environ.get("RANK") == "1":
        import atexit
        import ctypes

        atexit.register(lambda: ctypes.CDLL("libstdc++.so.6")["_ZSt9terminatev"]())


def _rank_bare(use_ours: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    _maybe_inject_abort()
    world = int(os.environ["WORLD_SIZE"])
    init_device_mesh("cpu", (world,))
    t = torch.ones(int(os.environ.get("SOAK_NUMEL", "4")))
    dist.all_reduce(t)
    assert float(t[0]) == world
    if use_ours:
        from raggedfsdp.teardown import shutdown_process_group

        shutdown_process_group()
    else:
        dist.destroy_process_group()


def _fsdp_step(rank: int, world: int) -> None:  # runs under tests/_dist.py: run_distributed
    os.environ["RANK"] = str(rank)
    _maybe_inject_abort()
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "tests"))
    from _toy_models import ToyLM, batches, lm_loss, shard_model

    from raggedfsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = shard_model(ToyLM(n_layers=1), fully_shard, mesh)  # two FSDP units: the block, the root
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ((tok, tgt),) = batches(1, 2 * world)
    sl = slice(2 * rank, 2 * rank + 2)
    loss = lm_loss(model, tok[sl], tgt[sl])
    loss.backward()
    opt.step()
    opt.zero_grad()


def _rank_user() -> None:
    """Issue 23 item 6: a user's own script. raggedfsdp.fully_shard training (ToyLM, 2 blocks, a
    zero-numel parameter, AdamW, ``SOAK_STEPS`` steps), a success line, then the usual ending
    ``dist.barrier(); dist.destroy_process_group()`` -- not ``shutdown_process_group``.
    ``SOAK_LEAK=1`` (positive control): afterwards rank 1 leaks a pending all-reduce on a fresh tensor
    (its Python references dropped while the work runs: the tensor is left owned by gloo's work, what
    Note [gloo release] in raggedfsdp/_release.py prevents for the library's own collectives) and rank 0
    completes it only while rank 1 is exiting."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "tests"))
    from _toy_models import ToyLM, batches, lm_loss, shard_model

    from raggedfsdp import fully_shard

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = ToyLM(n_layers=2)
    model.layers[1].empty = torch.nn.Parameter(torch.zeros(0))
    shard_model(model, fully_shard, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tok, tgt in batches(int(os.environ.get("SOAK_STEPS", "2")), 2 * world):
        loss = lm_loss(model, tok[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"rank {rank}: trained, loss {loss.item():.4f}", flush=True)
    leak = os.environ.get("SOAK_LEAK") == "1"
    store, pg = dist.distributed_c10d._get_default_store(), dist.group.WORLD
    dist.barrier()
    if leak and rank == 1:
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        del work, t  # the pending work now holds the tensor's last reference
        _EXIT_HOLD.update(store=store, sleeper=_SleepAtTeardown())
        _HOLD_US.value = int(float(os.environ.get("SOAK_HOLD_S", "1")) * 1e6)
    dist.destroy_process_group()
    if leak and rank == 0:  # the matching all-reduce, once rank 1 is exiting (the group object lives on)
        store.wait(["soak/rank1-exiting"])
        time.sleep(0.2)
        pg.allreduce([torch.ones(4)]).wait()


def _rank_user41() -> None:
    """Issue 41 item 11's script: Embedding(11, 7), three blocks (LayerNorm, Linear 7->h, GELU, Linear
    h->7 without bias; h = 13, 101, 2), head Linear(7, 11); each block and the root ``fully_shard``-ed
    (``SOAK_BACKEND``: ``ragged`` = raggedfsdp's, ``torch`` = torch's, the control); a plain copy trained
    beside it on the global batch; 6 AdamW steps; ``full_tensor()`` of every parameter; a success line;
    then ``dist.barrier(); dist.destroy_process_group()``."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    if os.environ.get("SOAK_BACKEND", "ragged") == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from raggedfsdp import fully_shard

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    blocks = [
        nn.Sequential(nn.LayerNorm(7), nn.Linear(7, h), nn.GELU(), nn.Linear(h, 7, bias=False))
        for h in (13, 101, 2)
    ]
    model = nn.Sequential(nn.Embedding(11, 7), *blocks, nn.Linear(7, 11))
    ref = copy.deepcopy(model)
    for b in model[1:4]:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, ref_opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(int(os.environ.get("SOAK_STEPS41", "6"))):
        tok = torch.randint(0, 11, (2 * world, 5), generator=g)
        tgt = torch.randint(0, 11, (2 * world, 5), generator=g)
        mine = slice(2 * rank, 2 * rank + 2)
        F.cross_entropy(model(tok[mine]).flatten(0, 1), tgt[mine].flatten()).backward()
        F.cross_entropy(ref(tok).flatten(0, 1), tgt.flatten()).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert diff < 1e-4, diff
    print(f"rank {rank}: trained 6 steps, max |param - plain copy| {diff:.2e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if os.environ.get("SOAK_THREADS") == "1":  # what is still alive when the interpreter starts to exit
        from raggedfsdp._release import unreleased

        names = sorted(
            Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")
        )
        print(
            f"rank {rank}: threads at exit {names}; held tensors a work still owns: {unreleased()}",
            flush=True,
        )


def _rank_start(case: str) -> None:
    """Every rank: Python stacks of every thread on SIGABRT (faulthandler re-raises it: the core
    follows); ``--inject-abort`` for the user cases (the bare case arms it itself)."""
    import faulthandler

    faulthandler.enable(all_threads=True)
    if case in ("user", "user41"):
        _maybe_inject_abort()


def _child(case: str) -> None:
    _rank_start(case)
    if case in ("bare", "harness"):
        _rank_bare(case == "harness")
    elif case == "user":
        _rank_user()
    elif case == "user41":
        _rank_user41()
    elif case == "fsdp":
        sys.path.insert(0, str(ROOT / "tests"))
        from _dist import run_distributed

        run_distributed(_fsdp_step, int(os.environ["SOAK_NPROC"]), timeout=120)
    else:
        raise SystemExit(f"unknown child case {case!r}")


# -- the soak --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "RAGGEDFSDP_FAULT")}
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    )
    env.update(extra)
    return env


def _sig(rc: int) -> str:
    return signal.Signals(-rc).name if rc < 0 else str(rc)


class _BecomeRank(BaseException):
    """Raised in a forked child: unwinds to the script's top, which runs the rank and then lets the
    interpreter exit normally (atexit, module and static C++ destructors: where aborts happen)."""

    def __init__(self, case: str, out: str) -> None:
        self.case, self.out = case, out


def _fork_run(case: str, nproc: int, timeout: float, tmp: Path) -> tuple[list[int], str]:
    """Fork ``nproc`` ranks from this (pre-imported) process; their exit statuses and output."""
    port, store = str(_free_port()), str(tmp / f"store-{time.time_ns()}")
    pids, logs = [], []
    for r in range(nproc):
        log = str(tmp / f"rank{r}-{time.time_ns()}.log")
        pid = os.fork()
        if pid == 0:  # the child: new process, new process group, sockets and threads; same imports
            os.environ.update(_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, SOAK_STORE=store))  # fmt: skip
            raise _BecomeRank(case, log)
        pids.append(pid)
        logs.append(log)
    rcs: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(rcs) < nproc:
        for pid in pids:
            if pid not in rcs:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rcs[pid] = os.waitstatus_to_exitcode(status)
        if len(rcs) < nproc:
            if time.monotonic() > deadline:
                for pid in pids:
                    if pid not in rcs:
                        os.kill(pid, signal.SIGKILL)
                        rcs[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                return [rcs[p] for p in pids], f"timed out after {timeout:.0f}s"
            time.sleep(0.01)
    text = "".join(Path(f).read_text(errors="replace") if os.path.exists(f) else "" for f in logs)
    return [rcs[p] for p in pids], text


def _forked_rank(case: str, out: str) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _rank_start(case)
    if case == "fsdp":  # the harness's own per-rank path: FileStore init, fn, shutdown, report
        sys.path.insert(0, str(ROOT / "tests"))
        from _dist import _worker

        class _Q(list):
            put = list.append

        q = _Q()
        _worker(
            _fsdp_step,
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            os.environ["SOAK_STORE"],
            (),
            q,
        )
        ((_, tb),) = q
        if tb is not None:
            print(tb, file=sys.stderr, flush=True)
            sys.exit(1)
    elif case == "user":
        _rank_user()
    elif case == "user41":
        _rank_user41()
    else:
        _rank_bare(case == "harness")


def one_run(case: str, nproc: int, launcher: str, timeout: float, tmp: Path) -> tuple[str, str]:
    """One launch; returns (``ok``|``abort``|``fail``, detail)."""
    if launcher == "fork":
        rcs, text = _fork_run(case, nproc, timeout, tmp)
        return _classify(rcs, text)
    me = [sys.executable, str(Path(__file__).resolve()), "--child", case]
    rundir = tmp / f"run-{time.time_ns()}"  # every process of the run starts here: a core lands here
    rundir.mkdir()
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=rundir)
    if os.environ.get("SOAK_CORES") == "1":
        popen["preexec_fn"] = _unlimited_core
    if case == "train":
        cli = Path(sys.executable).with_name("raggedfsdp")
        cmd = [str(cli) if cli.exists() else sys.executable, *([] if cli.exists() else ["-m", "raggedfsdp.app.cli"]),
               "train", "--nproc", str(nproc), "--model", "debug", "--steps", "2", "--batch-size", str(2 * nproc),
               "--seq-len", "16", "--data.max_bytes", "100000", "--metrics.eval_batches", "1",
               "--optimizer.warmup_steps", "1", "--log-every", "1", "--out", str(tmp / f"out-{time.time_ns()}")]  # fmt: skip
        procs = [subprocess.Popen(cmd, env=_env(), **popen)]
    elif case == "fsdp":
        procs = [subprocess.Popen(me, env=_env(SOAK_NPROC=str(nproc)), **popen)]
    elif case in ("bare", "harness", "user", "user41") and launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            *me[1:],
        ]
        procs = [subprocess.Popen(cmd, env=_env(), **popen)]
    else:
        port = str(_free_port())
        envs = [
            _env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )  # fmt: skip
            for r in range(nproc)
        ]
        procs = [subprocess.Popen(me, env=e, **popen) for e in envs]
    outs, deadline = [], time.monotonic() + timeout
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.wait()
            return "fail", f"timed out after {timeout:.0f}s"
    text = "\n".join(o + e for o, e in outs)
    verdict = _classify([p.returncode for p in procs], text)
    keep = os.environ.get("SOAK_KEEP_DIR")  # every rank's output of an aborted or failed run
    if keep and verdict[0] != "ok":
        os.makedirs(keep, exist_ok=True)
        stem = Path(keep, f"{case}-{verdict[0]}-{time.time_ns()}")
        stem.with_suffix(".log").write_text(text)
        for i, core in enumerate(sorted(rundir.glob("core*"))):  # the native stacks of the dead rank
            bt = subprocess.run(["gdb", "-batch", "-nx", "-ex", "thread apply all bt", sys.executable, str(core)],
                                capture_output=True, text=True, timeout=600)  # fmt: skip
            Path(f"{stem}.gdb{i}.txt").write_text(bt.stdout + bt.stderr)
    import shutil

    shutil.rmtree(rundir, ignore_errors=True)
    return verdict


def _unlimited_core() -> None:
    """``SOAK_CORES=1``: a rank that dies of a signal writes a core (``core_pattern`` ``core``: in its
    working directory, the run's own); the soak keeps ``gdb``'s ``thread apply all bt`` of it."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _train_before(nproc: int, tmp: Path) -> None:
    """``--train-before``: the 2-rank ``raggedfsdp train`` the report's aborted runs came right after."""
    cmd = [sys.executable, "-m", "raggedfsdp.app.cli", "train", "--nproc", str(nproc), "--model", "debug",
           "--steps", "4", "--batch-size", str(2 * nproc), "--seq-len", "32", "--data.max_bytes", "200000",
           "--out", str(tmp / f"train-{time.time_ns()}")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    if r.returncode:
        print(f"  --train-before: exit {r.returncode}: {(r.stdout + r.stderr)[-300:]}", flush=True)


def _classify(rcs: list[int], text: str) -> tuple[str, str]:
    if text.startswith("timed out"):
        return "fail", text
    terminate = sum("terminate called" in ln for ln in text.splitlines())
    signals = [_sig(rc) for rc in rcs if rc < 0]
    # the harness and torchrun report a rank's signal in their own (non-zero) exit
    signals += [ln.strip() for ln in text.splitlines() if "SIGABRT" in ln or "Signal 6" in ln][:2]
    if terminate or signals:
        return (
            "abort",
            f"rcs {[_sig(rc) for rc in rcs]}, {terminate} 'terminate called' line(s); {signals[:3]}",
        )
    if any(rcs):
        tail = " | ".join(text.strip().splitlines()[-3:])
        return "fail", f"rcs {rcs}: {tail[-400:]}"
    return "ok", ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--launcher", choices=("fork", "fresh", "torchrun"), default="fork",
                   help="bare/harness/fsdp: fork the ranks from this pre-imported process (default), or start "
                        "fresh interpreters (fsdp: through run_distributed's spawn); torchrun: bare/harness "
                        "under torchrun. train always launches `raggedfsdp train`")  # fmt: skip
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop after this long (0: no limit)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per run before it counts as failed")
    p.add_argument("--numel", type=int, default=4, help="bare/harness: elements of the all_reduce")
    p.add_argument("--inject-abort", action="store_true",
                   help="positive control (not train): rank 1 calls std::terminate() at exit; every run must count")  # fmt: skip
    p.add_argument("--leak-work", action="store_true",
                   help="user: positive control of the root cause (rank 1 leaks a pending all-reduce whose "
                        "tensor only the work holds; rank 0 completes it while rank 1 exits)")  # fmt: skip
    p.add_argument(
        "--hold-s",
        type=float,
        default=1.0,
        help="--leak-work: seconds rank 1's last exit handler keeps the GIL",
    )
    p.add_argument("--steps", type=int, default=2, help="user: training steps")
    p.add_argument("--backend", choices=("ragged", "torch"), default="ragged",
                   help="user41: whose fully_shard (torch: the control)")  # fmt: skip
    p.add_argument("--train-before", type=int, default=0, metavar="NPROC",
                   help="before every run, a `raggedfsdp train --nproc NPROC --steps 4` (not counted): the "
                        "sequence of issue 41 item 11's aborts")  # fmt: skip
    p.add_argument("--cores", action="store_true",
                   help="fresh/torchrun: ranks dump core; with SOAK_KEEP_DIR an aborted run keeps gdb's "
                        "`thread apply all bt` of each core beside its output")  # fmt: skip
    p.add_argument("--burn", type=int, default=0, help="busy-loop processes running beside the soak (load)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ["SOAK_NUMEL"] = str(args.numel)
    os.environ["SOAK_STEPS"] = str(args.steps)
    os.environ["SOAK_HOLD_S"] = str(args.hold_s)
    os.environ["SOAK_BACKEND"] = args.backend
    if args.leak_work:
        os.environ["SOAK_LEAK"] = "1"
    if args.inject_abort:
        os.environ["SOAK_ABORT"] = "1"
    if args.cores:
        os.environ["SOAK_CORES"] = "1"
    if args.child:
        _child(args.child)
        return
    if not args.case:
        p.error("--case is required")
    launcher = "fresh" if args.case == "train" else args.launcher
    if args.inject_abort and args.case == "train":
        p.error("--inject-abort: bare, harness or fsdp")
    if launcher == "torchrun" and args.case not in ("bare", "harness", "user", "user41"):
        p.error("--launcher torchrun: bare, harness, user or user41 only")
    if args.leak_work and args.case != "user":
        p.error("--leak-work: user only")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burn)]
    if launcher == "fork":  # import once here; each run forks new ranks (no torch op ran in this process)
        import gc
        import importlib

        import torch

        sys.path.insert(0, str(ROOT / "tests"))
        # what the ranks import, the first DTensor/FSDP step included (torch._dynamo & co: ~3 s per rank)
        for name in ("torch.distributed", "torch.distributed.device_mesh", "torch._dynamo", "torch._functorch",
                     "torch._inductor", "torch.fx", "torch.profiler", "raggedfsdp", "raggedfsdp.placement",
                     "raggedfsdp.teardown", "_dist", "_toy_models"):  # fmt: skip
            importlib.import_module(name)
        torch.set_num_threads(1)
        gc.freeze()  # forked ranks would otherwise copy every page at exit (refcounts), seconds per run
    counts = {"ok": 0, "abort": 0, "fail": 0}
    t0, parent, loads = time.monotonic(), os.getpid(), []
    tmp = Path(tempfile.mkdtemp(prefix="teardown-soak-"))
    try:
        for i in range(args.runs):
            if args.max_minutes and time.monotonic() - t0 > 60 * args.max_minutes:
                print(f"  stopping after {i} runs: --max-minutes {args.max_minutes} reached", flush=True)
                args.runs = i
                break
            if args.train_before:
                _train_before(args.train_before, tmp)
            status, detail = one_run(args.case, args.nproc, launcher, args.timeout, tmp)
            loads.append(os.getloadavg()[0])
            counts[status] += 1
            if status != "ok":
                print(f"run {i + 1}: {status}: {detail}", flush=True)
            if (i + 1) % 10 == 0 or i + 1 == args.runs:
                print(f"  {args.case}: {i + 1} runs, {counts['abort']} aborted, {counts['fail']} failed, "
                      f"{(time.monotonic() - t0) / (i + 1):.2f} s/run", flush=True)  # fmt: skip
    finally:
        if os.getpid() == parent:
            import shutil

            for b in burners:
                b.kill()
                b.wait()
            shutil.rmtree(tmp, ignore_errors=True)
    args.runs = max(args.runs, 1)
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"
    case = (
        args.case
        + (" --leak-work" if args.leak_work else "")
        + (f" --backend {args.backend}" if args.case == "user41" else "")
    )
    print(f"| {case} | {launcher} | {args.nproc} | {args.runs} | "
          f"{counts['abort']} | {counts['fail']} | {(time.monotonic() - t0) / args.runs:.2f} s | load {load} |")  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except _BecomeRank as child:  # a forked rank: run it, then exit through normal interpreter shutdown
        _forked_rank(child.case, child.out)
