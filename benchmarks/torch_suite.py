"""Run torch's own FSDP2 unit tests (``test/distributed/_composable/fsdp/*.py`` of the installed torch
version) on CPU, once with torch's ``fully_shard`` and once with ``raggedfsdp.fully_shard`` swapped in,
and print one table: test, torch, raggedfsdp, and for every difference its class from ``CLASSIFIED``.

torch's test files are not in the wheel and are not vendored here: fetch them (``benchmarks/torch_suite.md``
says how) into a folder and pass it. The patches (``benchmarks/torch_suite/sitecustomize.py``) are installed
in every process of the run, spawned ranks included: gloo, CPU ranks for GPU-only test classes, the
``fully_shard`` swap. Needs ``expecttest`` importable (``pip install expecttest``, or ``--site DIR``).

    python benchmarks/torch_suite.py --tests /path/to/torch/test/distributed/_composable/fsdp \\
        test_fully_shard_frozen.py test_fully_shard_state_dict.py --out /tmp/suite.json

Not a pytest test (it runs minutes and needs files from outside the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# test id (file::Class::test) -> (class, reason). Classes: "torch-internals" (asserts on torch's private
# FSDPParam / FSDPParamGroup state or its even Shard(0) split), "unsupported" (a documented raggedfsdp
# limit, docs/fsdp.md "Not yet matched from FSDP2"), "environment" (needs CUDA or the multithreaded PG).
_F, _SD = (
    "test_fully_shard_frozen.py::TestFullyShardFrozen::",
    "test_fully_shard_state_dict.py::TestFullyShardStateDict",
)
_I, _C = "test_fully_shard_init_excerpt.py::", "test_fully_shard_clip_grad_norm_"
_T = "test_fully_shard_training.py::"
_D = "test_fully_shard_dtensor.py::TestFullyShardDTensorCPU::"
_E = "test_fully_shard_extensions.py::TestFullyShardAllGatherExtensions"
CLASSIFIED: dict[str, tuple[str, str]] = {
    _C + ".py::TestClipGradNormWorldSize2::test_clip_grad_norm_1d": (
        "even-split",
        "asserts every rank's local grad piece has norm > max_norm; ragged pieces leave ranks empty "
        "(the _variant without it: grads, total norm, one all-reduce all equal torch's)",
    ),
    _C + "variant.py::TestClipGradNormWorldSize2::test_clip_grad_norm_1d": (
        "even-split",
        "after the total-norm checks (passed), inf norm of an empty local piece raises in the test itself",
    ),
    _I + "TestFullyShardHSDPBroadcast::test_hsdp_broadcast_across_replicas": (
        "even-split",
        "assertNotEqual across replicas of local pieces: empty pieces (norm.weight RS(16, 0)) compare equal",
    ),
    _I + "TestFullyShardLazyInit::test_fully_shard_double_lazy_init": (
        "torch-internals",
        "calls the private FSDPState._lazy_init() on a nested state, expects torch's message",
    ),
    _I + "TestFullyShardLazyInit::test_fully_shard_is_root": ("torch-internals", "reads FSDPState._is_root"),
    _I + "TestFullyShardLazyInit::test_fully_shard_module_and_param_fqns": (
        "torch-internals",
        "reads FSDPState._fsdp_param_group / FSDPParam._param_fqn",
    ),
    _I + "TestFullyShardLazyInit::test_fully_shard_multi_module_root": (
        "torch-internals",
        "calls the private _lazy_init() on a grouped state without a root, expects RuntimeError",
    ),
    _I + "TestFullyShardShardedParameterTensor::test_shard_tensor_parameters": (
        "placement",
        "asserts Shard(0) and torch.chunk pieces: raggedfsdp's params are RaggedShard by design",
    ),
    _I + "TestFullyShardShardedParameterDTensor::test_shard_dtensor_parameters": (
        "unsupported",
        "TP-sharded DTensor params with uneven TP pieces (27 rows on tp=2) are refused (ValueError); torch "
        "gives _StridedShard",
    ),
    _F + "test_train_mixed_requires_grad_across_groups": (
        "torch-internals",
        "counts calls of torch's RegisterPostBackwardFunction.backward (losses match before it)",
    ),
    _F + "test_train_mixed_requires_grad_per_group": (
        "torch-internals",
        "counts RegisterPostBackwardFunction.backward calls; patches dist.reduce_scatter_tensor",
    ),
    _SD + "MultiProcess::test_dp_state_dict_save_load": (
        "even-split",
        "data_ptr()==0 (an empty local piece) is asserted to happen only on ranks > 0 (dim-0 tail padding)",
    ),
    _T + "TestFullyShard1DTrainingCompose::test_partial_group_forward_grad_accum_chunked": (
        "placement",
        "compares grad.to_local() of a [norm, head] unit with separate norm / head units: RaggedShard pieces "
        "follow each unit's plan (16 vs 32 elements); with full_tensor() (_variant) the grads are equal",
    ),
    _T + "TestFullyShard1DTrainingCompose::test_partial_group_forward_then_standalone": (
        "placement",
        "same to_local() comparison across groupings; with full_tensor() (_variant) grads, params and "
        "the loss parity with the unsharded model hold",
    ),
    _T + "TestFullyShard1DTrainingCompose::test_partial_group_reshard_toggle": (
        "torch-internals",
        "reads FSDPState._fsdp_param_group.is_unsharded",
    ),
    _T + "TestFullyShardRegisteredParams::test_modules_to_run_forward_empty_for_single_module": (
        "torch-internals",
        "reads FSDPState._modules_to_run_forward",
    ),
    _T + "TestFullyShardGradientAccumulation::test_gradient_accumulation": (
        "comm-pattern",
        "counts c10d _reduce_scatter_base_ / allreduce_ / _allgather_base_ calls (CommDebugMode); ours "
        "reduces over gloo with an all-reduce; without the counts (_variant) losses and grads equal torch's",
    ),
    _T + "TestFullyShardSharedParams::test_shared_params_separate_fsdp_groups_error": (
        "earlier-error",
        "torch's ValueError and sentence, raised by the second fully_shard call (before any sharding state "
        "is built twice) instead of the first forward, outside the test's assertRaises",
    ),
    _D + "test_dtensor_train_parity_cpu": (
        "unsupported",
        "its DDP-only cases (dp_mesh_dims, replicate and no shard dim): NotImplementedError, docs/fsdp.md",
    ),
    _D + "test_fsdp_tp_dtensor_sharded_params_cpu": ("placement", "asserts Shard on the DP dim: RaggedShard"),
    _D + "test_sharded_param_correctness_1d_cpu": ("placement", "asserts Shard on the DP dim: RaggedShard"),
    **{
        _E + name: (
            "unsupported",
            "tensor-subclass all-gather extension (fsdp_pre_all_gather): NotImplementedError naming the "
            "parameter on every rank, at fully_shard (or the first forward for a monkey-patched local "
            "tensor); docs/fsdp.md",
        )
        for name in (
            "MultiProcess::test_all_gather_extensions_train_parity",
            "MultiThread::test_all_gather_extension_hsdp_mesh",
            "MultiThread::test_all_gather_extension_outer_size_stride",
            "MultiThread::test_all_gather_extensions_end_to_end",
            "MultiThread::test_all_gather_extensions_monkey_patch",
        )
    },
    "test_fully_shard_debug.py::TestFullyShardDebug::test_fully_shard_module_and_param_fqns": (
        "torch-internals",
        "calls the private FSDPState._lazy_init(), reads _fsdp_param_group._module_fqn and "
        "FSDPParam._param_fqn (the same test as init's test_fully_shard_module_and_param_fqns)",
    ),
    _SD + "MultiProcess::test_dp_tp_state_dict_save_load": (
        "even-split",
        "same data_ptr()==0 => rank > 0 assertion as test_dp_state_dict_save_load",
    ),
}


# --cuda-to-cpu: textual rewrites of a copy of each file (the tests that hard-code CUDA)
_CUDA_TO_CPU = [
    (r'torch\.device\("cuda",\s*\d+\)', 'torch.device("cpu")'),
    (r'torch\.device\("cuda"\)', 'torch.device("cpu")'),
    (r'device="cuda"', 'device="cpu"'),
    (r"\.cuda\(\)", ".cpu()"),
    (r'init_device_mesh\(\s*"cuda"', 'init_device_mesh("cpu"'),
    (r'\.to\("cuda"\)', '.to("cpu")'),
    (r"^[ \t]*@unittest\.skipIf\(not TEST_CUDA[^\n]*\n", ""),
    # world_size properties that ask for 4 or 8 CPU ranks: min(n, device_count()) = --ranks instead
    (r'^[ \t]*if device_type\.type == "cpu":\n[ \t]*return min_world_size\n', ""),
]


def _cpu_copy(tests: Path, files: list[str]) -> Path:
    """Copy ``files`` (and every helper ``_*.py`` next to them) into a temp folder with ``_CUDA_TO_CPU``."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="torch_suite_cpu_"))
    for f in [*files, *(q.name for q in tests.glob("_*.py"))]:
        text = (tests / f).read_text()
        for pat, rep in _CUDA_TO_CPU:
            text = re.sub(pat, rep, text, flags=re.MULTILINE)
        (out / f).write_text(text)
    return out


def _reason(text: str) -> str:
    """The innermost exception line of a (remote, multi-process) failure report."""
    lines = [ln[1:].strip() if ln.startswith("E ") else ln.strip() for ln in text.splitlines()]
    cut = next((i for i, ln in enumerate(lines) if ln.startswith("To execute this test")), len(lines))
    for ln in reversed(lines[:cut]):
        if re.match(r"^(\w+\.)*\w*(Error|Exception|Exit)\b", ln) and not ln.startswith(
            "RuntimeError: Process"
        ):
            return ln[:160].replace("|", "/")
    return (lines[0] if lines else "?")[:160].replace("|", "/")


def _run(
    impl: str,
    tests: Path,
    files: list[str],
    ranks: int,
    site: str | None,
    timeout: float,
    kexpr: str | None,
    dynamo: bool = False,
) -> dict[str, str]:
    out: dict[str, str] = {}
    env = dict(os.environ)
    paths = [str(HERE / "torch_suite"), str(ROOT)] + ([site] if site else []) + [env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        RAGGEDFSDP_TORCH_SUITE=impl,
        RAGGEDFSDP_TORCH_SUITE_RANKS=str(ranks),
        OMP_NUM_THREADS="1",
    )
    if dynamo:
        env["RAGGEDFSDP_TORCH_SUITE_DYNAMO"] = "1"
    for f in files:
        xml = Path(f"/tmp/torch_suite_{impl}_{Path(f).stem}.xml")
        xml.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(tests / f),
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            "-o",
            "junit_family=xunit1",
        ] + (["-k", kexpr] if kexpr else [])
        t0 = time.monotonic()
        try:
            subprocess.run(
                cmd, env=env, cwd=str(tests), timeout=timeout, capture_output=True, text=True, check=False
            )
        except subprocess.TimeoutExpired:
            out[f"{f}::<file>"] = "timeout"
            continue
        if not xml.exists():
            out[f"{f}::<file>"] = "error (no report)"
            continue
        for case in ET.parse(xml).getroot().iter("testcase"):
            cls = case.get("classname", "").rsplit(".", 1)[-1]
            key = f"{f}::{cls}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                node = case.find("failure") if case.find("failure") is not None else case.find("error")
                out[key] = "fail: " + _reason((node.get("message") or "") + "\n" + (node.text or ""))
            elif case.find("skipped") is not None:
                out[key] = "skip"
            else:
                out[key] = "pass"
        print(f"# {impl} {f}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return out


def _counts(r: dict[str, str]) -> str:
    n = {s: sum(v.split(":")[0] == s for v in r.values()) for s in ("pass", "fail", "skip")}
    return f"{n['pass']} pass, {n['fail']} fail, {n['skip']} skip"


def _print_tables(res: dict[str, dict[str, str]]) -> None:
    """One markdown table per test file (test, torch, raggedfsdp, class of a difference), then the counts
    of each implementation for that file; a difference not in ``CLASSIFIED`` prints as UNCLASSIFIED."""
    keys = sorted(set().union(*res.values()))
    for f in sorted({k.split("::")[0] for k in keys}):
        print(f"\n### {f}\n\n| test | torch | raggedfsdp | class |\n|---|---|---|---|")
        for k in (k for k in keys if k.split("::")[0] == f):
            t, o = res.get("torch", {}).get(k, "-"), res.get("ours", {}).get(k, "-")
            kind, why = CLASSIFIED.get(k, ("UNCLASSIFIED", ""))
            cls = "" if t.split(":")[0] == o.split(":")[0] else f"{kind}: {why}"
            if "-" in (t, o):  # run with one library only (a -k selection)
                cls = f"not run with {'torch' if t == '-' else 'raggedfsdp'}"
            print(f"| `{k.split('::', 1)[1]}` | {t} | {o} | {cls} |")
        print()
        for impl, r in res.items():
            print(f"{impl}: {_counts({k: v for k, v in r.items() if k.split('::')[0] == f})}  ")
    for impl, r in res.items():
        print(f"\nall files, {impl}: {_counts(r)} of {len(r)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="test file names inside --tests")
    ap.add_argument("--tests", type=Path, default=None, help="folder holding torch's fsdp test files")
    ap.add_argument("--from-json", type=Path, default=None, help="re-print the table of an earlier --out")
    ap.add_argument("--impl", nargs="+", default=["torch", "ours"], choices=["torch", "ours"])
    ap.add_argument("--ranks", type=int, default=2, help="CPU ranks given to GPU-only test classes")
    ap.add_argument("--site", default=None, help="extra sys.path entry (e.g. where expecttest is installed)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per file and implementation")
    ap.add_argument("-k", dest="kexpr", default=None, help="pytest -k expression")
    ap.add_argument(
        "--cuda-to-cpu",
        action="store_true",
        help="run rewritten copies: torch.device('cuda'[, 0]) / device='cuda' / .cuda() -> CPU, "
        "and no @unittest.skipIf(not TEST_CUDA)",
    )
    ap.add_argument(
        "--dynamo",
        action="store_true",
        help="for torch.compile tests: torch.accelerator.is_available() stays False (without it, dynamo asks "
        "the CPU that the harness reports as the accelerator for its current stream and fails)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the raw results as JSON")
    a = ap.parse_args(argv)
    if a.from_json is not None:
        res = json.loads(a.from_json.read_text())
    elif a.tests is None or not a.files:
        ap.error("give --tests DIR and test files (or --from-json)")
    else:
        tests = _cpu_copy(a.tests, a.files) if a.cuda_to_cpu else a.tests
        res = {
            impl: _run(impl, tests, a.files, a.ranks, a.site, a.timeout, a.kexpr, a.dynamo) for impl in a.impl
        }
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    _print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
