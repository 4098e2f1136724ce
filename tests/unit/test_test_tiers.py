"""The test tiers of tests/conftest.py (issue 41 item 15): a plain ``pytest`` (the README's command)
collects the default tier, ``--full`` or ``RAGGEDFSDP_FULL_TESTS=1`` (what ``.ci/run`` passes) every test.

Checked with ``pytest --collect-only`` in a subprocess (no test runs): the default tier leaves out the
long multi-rank and end-to-end tests, keeps one multi-rank guard per core feature, and the flag and the
environment variable bring the rest back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# one multi-rank guard per core feature, kept in the default tier
CORE = [
    "tests/dist/test_fsdp_parity.py::test_fp32_parity_with_single_process_and_torch_fsdp[3]",
    "tests/dist/test_fsdp_parity.py::test_fp32_parity_with_single_process_and_torch_fsdp[5]",
    "tests/dist/test_fsdp_parity.py::test_bf16_param_fp32_reduce_matches_torch_fsdp[3]",
    "tests/dist/test_optim_parity.py::test_optimizers_match_references_at_world_sizes[3]",
    "tests/dist/test_fsdp_checkpoint.py::test_dcp_save_at_4_resume_at_3_and_1",
    "tests/dist/test_ragged_api.py::test_torch_api_with_torch_names_imported_first[3-units0]",
    "tests/dist/test_ragged_redistribute.py::test_redistribute_1d[3]",
    "tests/e2e/test_train_cli.py::test_backends_agree",
]
# long ones the default tier leaves out
FULL_ONLY = [
    "tests/dist/test_fsdp_parity.py::test_fp32_parity_with_single_process_and_torch_fsdp[1]",
    "tests/dist/test_fsdp_grad_fold.py",
    "tests/e2e/test_train_faults.py::test_trainer_faults_at_two_ranks",
    "tests/e2e/test_train_checkpoint.py::test_crash_then_resume_auto_at_1_rank_and_resume_path_at_3_ranks",
]


def _collect(*args: str, **env: str) -> set[str]:
    e = {k: v for k, v in os.environ.items() if k != "RAGGEDFSDP_FULL_TESTS"}
    e.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {ln.strip() for ln in proc.stdout.splitlines() if "::" in ln}


def _has(ids: set[str], want: str) -> bool:
    return want in ids if "::" in want else any(i.startswith(want + "::") for i in ids)


@pytest.fixture(scope="module")
def default_ids() -> set[str]:
    return _collect("tests/dist", "tests/e2e")


def test_default_tier_keeps_the_core_and_leaves_out_the_long_tests(default_ids):
    for want in CORE:
        assert _has(default_ids, want), f"{want} is not in the default tier"
    for want in FULL_ONLY:
        assert not _has(default_ids, want), f"{want} is in the default tier"
    multi = [i for i in default_ids if i.startswith("tests/dist/")]
    assert 5 <= len(multi) <= 15, multi  # a handful of shared spawns, not the 119 multi-rank tests


def test_full_flag_brings_every_test_back(default_ids):
    ids = _collect("tests/dist", "tests/e2e", "--full")
    for want in CORE + FULL_ONLY:
        assert _has(ids, want), f"{want} is not collected with --full"
    assert default_ids < ids


def test_the_environment_variable_brings_every_test_back(default_ids):
    ids = _collect("tests/e2e", RAGGEDFSDP_FULL_TESTS="1")
    e2e = {i for i in default_ids if i.startswith("tests/e2e/")}
    assert _has(ids, FULL_ONLY[-1]) and e2e < ids


def test_a_test_named_by_its_file_runs_in_any_tier():
    ids = _collect("tests/dist/test_fsdp_parity.py")
    assert _has(ids, FULL_ONLY[0]) and _has(ids, CORE[0])


def test_ci_and_readme_name_the_flag():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[test]' && pytest\n" in readme  # the user's command, unchanged
    assert "pytest --full" in readme
    assert "RAGGEDFSDP_FULL_TESTS=1" in ci or "pytest --full" in ci
