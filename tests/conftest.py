"""Test tiers: a plain ``pytest`` runs the default tier, ``pytest --full`` everything.

The default tier is every test under tests/unit plus the tests under tests/dist, tests/e2e and
tests/frameworks marked ``core``: one multi-rank parity test per core feature (fsdp at world sizes
3 and 5, the optimizers, checkpoints, RaggedShard redistribution and torch's DTensor API, one
launched ``raggedfsdp train``) and the checks that run in-process before a launch. Every other test
under those three folders, and every test marked ``slow`` anywhere, is the full tier: it gets the
``slow`` marker and a default run deselects it, saying how many and how to run them.

The full tier runs with ``pytest --full`` or ``RAGGEDFSDP_FULL_TESTS=1 pytest`` (``.ci/run`` does).
A full-tier test named on the command line by its file or node id runs anyway, and an explicit ``-m``
expression chooses the set itself (``-m slow``: the full tier only; ``-m 'not slow'``: the default).

The shared spawns of tests/dist (``tests/_cases.py``) run only their ``core`` cases when no selected
test is in the full tier (``_cases.CORE_ONLY``), so a default run starts no rank for a skipped case.
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

_HERE = os.path.dirname(os.path.abspath(__file__))
_MULTI_RANK_DIRS = tuple(os.path.join(_HERE, d) + os.sep for d in ("dist", "e2e", "frameworks"))
FULL_ENV = "RAGGEDFSDP_FULL_TESTS"


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="run the full tier too: every multi-rank (tests/dist) and end-to-end (tests/e2e) test, "
        f"not only those marked core (also: {FULL_ENV}=1; .ci/run passes it)",
    )


def full_tier_requested(config) -> bool:
    """``--full`` or ``RAGGEDFSDP_FULL_TESTS`` set to anything but '', '0', 'false', 'no'."""
    env = os.environ.get(FULL_ENV, "").strip().lower()
    return bool(config.getoption("--full")) or env not in ("", "0", "false", "no")


def is_full_tier(item) -> bool:
    """A test the default run leaves out: marked ``slow``, or in tests/dist or tests/e2e and not ``core``."""
    if item.get_closest_marker("slow") is not None:
        return True
    path = str(item.path)
    return path.startswith(_MULTI_RANK_DIRS) and item.get_closest_marker("core") is None


def _named_files(config) -> set[str]:
    """Files named on the command line (``path.py`` or ``path.py::node``), absolute."""
    out = set()
    for arg in config.args:
        path = arg.split("::", 1)[0]
        full = os.path.abspath(os.path.join(str(config.invocation_params.dir), path))
        if os.path.isfile(full):
            out.add(full)
    return out


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_full_tier(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    config._ragged_tier_left_out = 0
    if full_tier_requested(config) or config.getoption("markexpr"):
        return
    named = _named_files(config)
    keep, drop = [], []
    for item in items:
        (drop if is_full_tier(item) and str(item.path) not in named else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config._ragged_tier_left_out = len(drop)


def pytest_collection_finish(session):
    import _cases

    _cases.CORE_ONLY = not any(is_full_tier(item) for item in session.items)


def pytest_report_header(config):
    if full_tier_requested(config):
        return "raggedfsdp tests: full tier (--full)"
    return (
        f"raggedfsdp tests: default tier; the multi-rank full tier runs with `pytest --full` ({FULL_ENV}=1)"
    )


def pytest_terminal_summary(terminalreporter, config):
    n = getattr(config, "_ragged_tier_left_out", 0)
    if n:
        terminalreporter.write_line(
            f"default tier: {n} multi-rank/end-to-end tests of the full tier not run; "
            f"`pytest --full` runs them (CI does)"
        )
