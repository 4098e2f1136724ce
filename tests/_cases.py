"""One spawn, many test cases: ``run_cases`` runs named sub-cases in ONE process group and records
which ones passed, so several tests (each asserting on its own case) share one ~3-6 s/rank launch.

``SharedSpawns(fn_by_name, plan)`` (``fn_by_name``: case name -> ``"module.function"``, resolved in
the ranks, so several test modules can share one registry without import circles) is a memo:
``spawns.check(ws, name)`` spawns world size
``ws`` once with every case registered for it (``spawns.plan``), then fails the calling test unless
``name`` passed; a case that did not run because an earlier one failed names the one that failed.
A case that needs a folder on disk takes ``case_tmpdir()`` (or ``case_tmpdir(key)``, a folder shared
across world sizes).
Cases run in registration order on every rank; a failure stops the group (a half-run collective
would otherwise desynchronise the next case), so every case after it is reported as not run.
A test's duration is its whole spawn's (the first test to ask for a world size pays for all of its
cases); ``RAGGEDFSDP_CASE_TIMES=FILE`` makes rank 0 append each case's wall seconds to FILE.

``core`` (world size -> case names) are the cases of the default test tier (tests/conftest.py): when
no selected test is in the full tier, conftest sets ``CORE_ONLY`` and a spawn runs only its core cases
(in plan order); a case outside them that a test still asks for gets a spawn of its own.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
import weakref

import torch.distributed as dist

from _dist import run_distributed


CASE_TIMES_ENV = "RAGGEDFSDP_CASE_TIMES"  # a file: rank 0 appends each case's seconds (slowest-case hunts)
CORE_ONLY = False  # set by tests/conftest.py: the default tier runs only the spawns' core cases
_CASE_DIR: str | None = None
_ROOT: str | None = None


def case_tmpdir(key: str | None = None) -> str:
    """A folder on disk for the running case, the same path on every rank; only for cases run by
    ``SharedSpawns``. Without ``key``: a fresh folder of this case, removed after the spawn. With
    ``key``: ``spawns.scratch(key)``, shared by every spawn of that ``SharedSpawns`` and the parent test
    (a checkpoint saved at one world size, loaded at another); removed when the test process exits."""
    assert _CASE_DIR is not None and _ROOT is not None, "case_tmpdir() is for cases run by SharedSpawns"
    if key is None:
        return _CASE_DIR
    path = os.path.join(_ROOT, key)
    os.makedirs(path, exist_ok=True)
    return path


def _run_cases(rank, ws, fns, cases, done_path, root):
    global _CASE_DIR, _ROOT
    _ROOT = root
    times = os.environ.get(CASE_TIMES_ENV) if rank == 0 else None
    for i, (name, args) in enumerate(cases):
        t0 = time.perf_counter()
        _CASE_DIR = os.path.join(os.path.dirname(done_path), f"case-{i}")
        os.makedirs(_CASE_DIR, exist_ok=True)
        mod, _, attr = fns[name].rpartition(".")
        getattr(importlib.import_module(mod), attr)(rank, ws, *args)
        dist.barrier()
        if rank == 0:
            with open(done_path, "a") as f:
                f.write(repr((name, args)) + "\n")
        if times:
            with open(times, "a") as f:
                f.write(f"{time.perf_counter() - t0:7.1f} s  ws={ws} {name}{tuple(args)}\n")


class SharedSpawns:
    def __init__(
        self,
        fns: dict,
        plan: dict[int, list[tuple[str, tuple]]],
        timeout: float = 300.0,
        core: dict[int, set[str]] | None = None,
    ):
        self.fns, self.plan, self.timeout = fns, plan, timeout
        self.core = core or {}
        for ws, names in self.core.items():
            missing = set(names) - {n for n, _ in plan[ws]}
            assert not missing, f"core cases {missing} are not in the world-size-{ws} plan"
        self._results: dict[object, tuple[set, str | None]] = {}
        self._root: str | None = None

    def scratch(self, key: str = "") -> str:
        """The folder ``case_tmpdir(key)`` names in the ranks (created on first use, removed at exit)."""
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="shared-spawns-")
            weakref.finalize(self, shutil.rmtree, self._root, True)
        path = os.path.join(self._root, key)
        os.makedirs(path, exist_ok=True)
        return path

    def cases(self, ws: int) -> list[tuple[str, tuple]]:
        """The cases the world-size-``ws`` spawn runs: all of them, or the core ones (``CORE_ONLY``)."""
        if not CORE_ONLY:
            return self.plan[ws]
        return [(n, a) for n, a in self.plan[ws] if n in self.core.get(ws, ())]

    def _spawn(self, ws: int, cases: list | None = None) -> tuple[set, str | None]:
        key = ws if cases is None else (ws, repr(cases))
        cases = self.cases(ws) if cases is None else cases
        if key not in self._results:
            with tempfile.TemporaryDirectory() as tmp:
                done_path = os.path.join(tmp, "done")
                err = None
                try:
                    run_distributed(
                        _run_cases,
                        ws,
                        self.fns,
                        cases,
                        done_path,
                        self.scratch(),
                        timeout=self.timeout,
                    )
                except BaseException as e:  # noqa: BLE001 - reported by every test of this spawn
                    err = f"{type(e).__name__}: {e}"
                done = set(open(done_path).read().splitlines()) if os.path.exists(done_path) else set()
            self._results[key] = (done, err)
        return self._results[key]

    def check(self, ws: int, name: str, *args) -> None:
        """Fail unless case ``(name, args)`` passed in the shared world-size-``ws`` spawn."""
        assert (name, tuple(args)) in [(n, tuple(a)) for n, a in self.plan[ws]], (ws, name, args)
        own = (name, tuple(args)) not in [(n, tuple(a)) for n, a in self.cases(ws)]
        cases = [(name, tuple(args))] if own else self.cases(ws)  # own: CORE_ONLY, not a core case
        done, err = self._spawn(ws, cases if own else None)
        if repr((name, tuple(args))) not in done:
            # cases run in plan order and the first failure stops the group: it is the first one not done
            first = next(f"{n}{tuple(a)}" for n, a in cases if repr((n, tuple(a))) not in done)
            this = f"{name}{tuple(args)}"
            why = "failed" if first == this else f"did not run: case {first} failed before it"
            raise AssertionError(f"case {this} at world size {ws} {why}:\n{err}")
