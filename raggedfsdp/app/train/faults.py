"""Test-only fault injection for ``raggedfsdp train``: the ``RAGGEDFSDP_FAULT`` environment variable.

Fault-tolerance tests inject faults into real multi-rank runs without editing code. The variable
holds comma-separated items ``KIND@stepN[:rankR]`` (no ``:rankR``: every rank)::

    RAGGEDFSDP_FAULT=nan@step3:rank1          # rank 1's loss at step 3 is NaN
    RAGGEDFSDP_FAULT=inf@step3:rank0,hang@step5:rank1

Kinds (each fires once, at the start of step N unless noted):

- ``nan`` / ``inf``: this rank's loss of step N becomes NaN / +Inf (so do its gradients);
- ``raise``: a ``RuntimeError``; ``exit``: ``os._exit(3)``; ``hang``: sleep forever (outside any
  collective); ``sigint`` / ``sigterm``: the rank sends itself that signal;
- ``badtoken``: the batch of step N holds a token id past the vocabulary;
- ``shortbatch``: the batch of step N has one row too few;
- ``enospc`` / ``eacces``: the checkpoint save at step N raises ``OSError(ENOSPC)`` (a full disk) /
  ``PermissionError(EACCES)`` (a folder the job may not write) on this rank, inside DCP's write;
- ``slowsave``: the checkpoint save at step N sleeps ``RAGGEDFSDP_FAULT_SLEEP_S`` seconds (default
  5) on this rank after writing its shard files, before the ``.metadata``, the manifest and the
  rename: a slow disk, so that a signal can arrive while the checkpoint is half written;
- ``savehang``: the checkpoint save at step N sleeps forever on this rank after writing its shard files
  (a rank frozen inside a save: the watchdog names it, ``phase: save``);
- ``oom``: ``torch.OutOfMemoryError`` inside step N's forward on this rank, as an allocator raises it.
- ``nangrad``: this rank's gradients of step N become NaN (a hook on the logits' gradient; the loss
  stays finite), before the reduce-scatter spreads them to every rank;
- ``swapdata``: this rank trains on another corpus of the same size (its train tokens reversed):
  ``@step0`` after its load, before the start's corpus agreement (``train/data_identity.py``);
  ``@stepN``, N > 0, from step N on (the step's batch checksums find it);
- ``nanparam``: after step N's optimizer step, one element of this rank's first non-empty parameter
  shard becomes NaN (a poisoned shard: found by step N+1's guard, or after the last step).
- ``truncate``: at the start of step N this rank cuts the ``--data`` token file (a ``.bin``) to half
  of its size when the job opened it, in place (a file cut on a shared file system while the job
  reads it): the first read past the new end is a ``DataError`` naming the file and the offset.
- ``freeze``: from the start of step N on, this rank's process is stopped (``SIGSTOP``) ``F`` seconds
  of every ``P`` (``RAGGEDFSDP_FAULT_FREEZE=F/P``, default ``5/6``) by a helper process, then continued
  (``SIGCONT``): a rank frozen periodically (a paused VM, a swap storm), which the straggler report
  names. The helper continues the rank and exits at ``Trainer.close`` / the process's exit. POSIX only.

:func:`install` registers the faults as trainer hooks (``train/hooks.py``): the training step itself
has no fault code.

The older hidden flags ``--debug.fail_rank/fail_step/fail_mode`` map to
``raise``/``exit``/``hang``/``savehang``. ``raggedfsdp bench`` honours the step faults (``raise``,
``exit``, ``hang``, ``sigint``, ``sigterm``) at the start of its repetition N (warm-up ones included).
Nothing here runs unless the variable (or those flags) is set.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["ENV", "FREEZE_ENV", "Fault", "FaultPlan", "install", "parse_faults"]

ENV = "RAGGEDFSDP_FAULT"
KINDS = (
    "nan", "inf", "raise", "exit", "hang", "sigint", "sigterm", "badtoken", "shortbatch", "enospc", "eacces",
    "slowsave", "oom", "nangrad", "nanparam", "swapdata", "savehang", "truncate", "freeze",
)  # fmt: skip
SLEEP_ENV = "RAGGEDFSDP_FAULT_SLEEP_S"
FREEZE_ENV = "RAGGEDFSDP_FAULT_FREEZE"
_ITEM = re.compile(r"^(?P<kind>[a-z]+)@step(?P<step>\d+)(?::rank(?P<rank>\d+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None  # None: every rank


def parse_faults(spec: str) -> list[Fault]:
    """Parse a ``RAGGEDFSDP_FAULT`` value; ``ValueError`` naming the bad item and the grammar."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _ITEM.match(item)
        if m is None or m.group("kind") not in KINDS:
            raise ValueError(
                f"{ENV}: bad item {item!r}; expected KIND@stepN[:rankR] with KIND one of {KINDS}"
            )
        rank = m.group("rank")
        faults.append(Fault(m.group("kind"), int(m.group("step")), None if rank is None else int(rank)))
    return faults


class FaultPlan:
    """The faults that apply to one rank; ``take(kind, step)`` is True once per matching fault."""

    def __init__(self, faults: list[Fault], rank: int) -> None:
        self._pending = [f for f in faults if f.rank is None or f.rank == rank]

    @classmethod
    def from_env(cls, rank: int, debug=None) -> FaultPlan:
        faults = parse_faults(os.environ.get(ENV, ""))
        if debug is not None and debug.fail_step >= 0 and debug.fail_rank >= 0:
            faults.append(Fault(debug.fail_mode, debug.fail_step, debug.fail_rank))
        return cls(faults, rank)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def take(self, kind: str, step: int) -> bool:
        for f in self._pending:
            if f.kind == kind and f.step == step:
                self._pending.remove(f)
                import logging
                import time

                logging.getLogger(__name__).warning(
                    "debug: injecting fault %s@step%d (t=%.3f)", kind, step, time.time()
                )
                return True
        return False

    def save_fault(self, step: int) -> str:
        """The fault, if any, of the checkpoint save of ``step``: ``enospc``, ``eacces``, ``slowsave``,
        ``savehang``, ``""``."""
        return next((k for k in ("enospc", "eacces", "slowsave", "savehang") if self.take(k, step)), "")

    def save_writer_factory(self, step: int):
        """``folder -> StorageWriter`` for ``checkpoint.dcp.save_checkpoint(writer_factory=...)``
        when the save of ``step`` has a fault, else None (DCP's own ``FileSystemWriter``)."""
        inject = self.save_fault(step)
        return (lambda path: fault_writer(path, inject)) if inject else None

    def inject_forward(self, step: int) -> None:
        """Inside step N's forward: ``oom``."""
        if self.take("oom", step):
            import torch

            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected by RAGGEDFSDP_FAULT=oom)"
            )

    def inject_step(self, step: int, rank: int) -> None:
        """The faults that act at the start of a step: raise, exit, hang, sigint, sigterm."""
        import signal
        import time

        for mode in ("raise", "exit", "hang", "sigint", "sigterm"):
            if not self.take(mode, step):
                continue
            if mode == "exit":
                os._exit(3)
            if mode == "hang":
                while True:
                    time.sleep(3600)
            if mode in ("sigint", "sigterm"):
                os.kill(os.getpid(), signal.SIGINT if mode == "sigint" else signal.SIGTERM)
                continue
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (debug.fail_rank/fail_step)")


def truncate_token_file(tokens) -> None:
    """``truncate``: cut the token file behind ``tokens`` (a ``data.TokenArray``) to half of its size
    when it was opened, in whole tokens (idempotent: every rank may do it). ``ValueError`` for a text
    corpus, which is read into memory at the start (nothing to cut)."""
    from raggedfsdp.app.train.data import TokenArray

    if not isinstance(tokens, TokenArray):
        raise ValueError(f"{ENV}=truncate@stepN needs a .bin --data (a text corpus is read into memory)")
    os.truncate(tokens.path, tokens.file_bytes // 2 // 4 * 4)


def fault_writer(path, inject: str):
    """A DCP ``FileSystemWriter`` for ``path`` that fails like a full disk (``enospc``), a denied
    write (``eacces``) or stalls like a slow disk mid-save (``slowsave``: sleeps ``SLEEP_ENV``
    seconds, default 5, after this rank's shard files are written). Test-only."""
    import errno
    import logging
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    class _FaultWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            if inject in ("slowsave", "savehang"):
                fut = super().write_data(plan, planner)  # this rank's shard files are on disk
                fut.wait()
                sleep = float(os.environ.get(SLEEP_ENV) or 5.0) if inject == "slowsave" else float("inf")
                deadline = time.monotonic() + sleep
                logging.getLogger(__name__).warning("debug: slow save: sleeping in the middle of %s", path)
                while time.monotonic() < deadline:  # short sleeps: a signal handler runs at once
                    time.sleep(0.05)
                return fut
            code = errno.ENOSPC if inject == "enospc" else errno.EACCES
            target = str(path / "__fault.distcp")
            raise (OSError if inject == "enospc" else PermissionError)(code, os.strerror(code), target)

    return _FaultWriter(str(path))


def install(trainer) -> None:
    """Register ``trainer.faults`` (a :class:`FaultPlan`) and the ``--debug.slow_*`` straggler into
    ``trainer.hooks`` (``train/hooks.py``). Registers nothing when there is no fault (the step then
    makes no hook call). The hooks read the trainer's attributes when they fire (``sampler``,
    ``corpus``, ``model``, ``model_cfg``, ``straggler``)."""
    import dataclasses
    import time

    plan, hooks, rank, debug = trainer.faults, trainer.hooks, trainer.rank, trainer.cfg.debug
    if debug.slow_rank >= 0:

        def built():
            from raggedfsdp.app.train.straggler import inject_slow_rank

            slow_s = inject_slow_rank(trainer.model, debug, rank, trainer.straggler)
            if slow_s:  # without --debug.slow_unit: late from the step's start
                hooks.register("step_begin", lambda _step: time.sleep(slow_s))

        hooks.register("built", built)
    if not plan:
        return

    def corpus(c):  # swapdata@step0: another corpus of the same size, before the start's agreement
        return dataclasses.replace(c, train=c.train.flip(0).contiguous()) if plan.take("swapdata", 0) else c

    freezer: list = []

    def step_begin(step):
        plan.inject_step(step, rank)
        if plan.take("swapdata", step):  # other data from this step on (found by the step's check)
            trainer.sampler.tokens = trainer.sampler.tokens.flip(0).contiguous()
        if plan.take("truncate", step):  # the .bin cut in place: its next read past the end fails
            truncate_token_file(trainer.corpus.train)
        if plan.take("freeze", step):
            freezer.append(start_freezer(os.getpid(), os.environ.get(FREEZE_ENV, "5/6")))

    def batch(b, step, micro):
        inputs, targets = b
        if micro == 0 and plan.take("badtoken", step):
            inputs = inputs.clone()
            inputs[-1, 3] = trainer.model_cfg.vocab_size
        if micro == 0 and plan.take("shortbatch", step):
            inputs, targets = inputs[:-1], targets[:-1]
        return inputs, targets

    def logits(out, step, micro):
        if micro == 0 and plan.take("nangrad", step):
            out.register_hook(lambda g: g * float("nan"))  # this rank's gradients only, loss finite

    def loss(value, step, micro):
        if micro != 0:
            return value
        plan.inject_forward(step)  # oom
        if plan.take("nan", step):
            return value * float("nan")
        return value * float("inf") if plan.take("inf", step) else value

    def after_optimizer(step):
        if plan.take("nanparam", step):  # one element of this rank's first non-empty shard
            from torch.distributed.tensor import DTensor

            local = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
            next(t for t in local if t.numel()).detach().view(-1)[0] = float("nan")

    def close():
        while freezer:
            freezer.pop().stop()

    for event, fn in (("corpus", corpus), ("step_begin", step_begin), ("batch", batch), ("logits", logits),
                      ("loss", loss), ("after_optimizer", after_optimizer), ("close", close),
                      ("save_writer", plan.save_writer_factory)):  # fmt: skip
        hooks.register(event, fn)


_FREEZER = """
import os, signal, sys, time
pid, frozen, period = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
try:
    while True:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(frozen)
        os.kill(pid, signal.SIGCONT)
        time.sleep(period - frozen)
except ProcessLookupError:
    pass
finally:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


class _Freezer:
    def __init__(self, proc) -> None:
        self.proc = proc

    def stop(self) -> None:
        """Continue the rank and end the helper (idempotent)."""
        if self.proc.poll() is None:
            self.proc.terminate()  # its handler exits through the finally: SIGCONT
            self.proc.wait()


def start_freezer(pid: int, spec: str) -> _Freezer:
    """``freeze``: a helper process that stops ``pid`` (``SIGSTOP``) ``F`` s of every ``P`` s
    (``spec = "F/P"``, ``0 < F < P``) and continues it when it is told to stop or ``pid`` ends.
    ValueError for a bad ``spec`` or a platform without ``SIGSTOP``."""
    import atexit
    import signal
    import subprocess
    import sys

    try:
        frozen, period = (float(x) for x in spec.split("/"))
    except ValueError:
        frozen = period = -1.0
    if not 0 < frozen < period:
        raise ValueError(f"{FREEZE_ENV}={spec!r}: expected F/P seconds with 0 < F < P, e.g. 5/6")
    if not hasattr(signal, "SIGSTOP"):
        raise ValueError(f"{ENV}=freeze@stepN needs SIGSTOP (POSIX); this platform has none")
    cmd = [sys.executable, "-c", _FREEZER, str(pid), str(frozen), str(period)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # started: the first stop comes now, at the start of step N
    freezer = _Freezer(proc)
    atexit.register(freezer.stop)
    return freezer
