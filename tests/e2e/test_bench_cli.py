"""``raggedfsdp bench``: a 2-rank smoke run with --json (keys, loss agreement, copy/collective accounting)
and argument errors before any launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raggedfsdp.app.cli import main


def test_bench_json_smoke_moe_two_ranks():
    cmd = [
        sys.executable,
        "-m",
        "raggedfsdp.app.cli",
        "bench",
        "--model",
        "moe",
        "--flavor",
        "moe-debug",
        "--nproc",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--json",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "raggedfsdp bench: step 2/2" in res.stderr  # progress lines
    # no profiler / allocator log noise between the progress and the table (issue 24, rough edge 3)
    noise = [
        ln
        for ln in (res.stderr + res.stdout).splitlines()
        if ln.startswith(("USDT:", "STAGE:", "ERROR:", "WARNING:", "[W ", "[W1", "[W2"))
        or "CPUAllocator" in ln
        or "gpuGetDeviceCount" in ln
        or "profiler_st" in ln
    ]
    assert not noise, noise[:5]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("throughput_ratio", "peak_memory_ratio", "raggedfsdp", "torch"):
        assert key in r
    a, b = r["raggedfsdp"], r["torch"]
    for sysr in (a, b):
        for key in (
            "step_seconds_median",
            "copy_bytes",
            "padding_bytes",
            "collectives",
            "final_loss",
            "peak_memory_bytes",
            "host_syncs",
            "collective_bytes",
        ):
            assert key in sysr, key
        assert len(sysr["step_seconds"]) == 2 and sysr["peak_memory_bytes"] > 0
    assert r["nproc"] == 2 and r["model"] == "moe"
    for sysr in (a, b):  # no --all-gather-dtype: nothing quantized, the accounted step records exactly 0
        assert sysr["quantize_seconds"] == sysr["dequantize_seconds"] == 0
        assert sysr["quantize_calls"] == sysr["dequantize_calls"] == 0
    assert r["quantize_dequantize_step_fraction"] == 0
    # no op of a normal step makes DTensor move a RaggedShard operand (a hidden collective)
    assert a["implicit_redistributions"] == b["implicit_redistributions"] == 0, (a, b)
    # the no-FSDP, no-communication floor (--floor, default on) and what it explains
    fl = r["local_floor"]["step_seconds_median"]
    assert fl > 0 and len(r["local_floor"]["step_seconds"]) == 2
    assert r["throughput_ceiling"] == pytest.approx(b["step_seconds_median"] / fl)
    assert r["overhead_seconds"]["torch"] == pytest.approx(b["step_seconds_median"] - fl)
    for n, sysr in (("raggedfsdp", a), ("torch", b)):  # the step's collectives replayed alone
        assert sysr["comm_only_seconds"] > 0
        assert r["non_comm_overhead_seconds"][n] == pytest.approx(
            sysr["step_seconds_median"] - fl - sysr["comm_only_seconds"]
        )
        assert sysr["comm_only_cpu_seconds"] > 0  # the same split in CPU time
        assert r["non_comm_overhead_cpu_seconds"][n] == pytest.approx(
            sysr["cpu_seconds_median"]
            - r["local_floor"]["cpu_seconds_median"]
            - sysr["comm_only_cpu_seconds"]
        )
    nc = r["non_comm_overhead_cpu_seconds"]
    want = nc["raggedfsdp"] / nc["torch"] if nc["torch"] > 0 else float("inf")
    assert r["non_comm_overhead_cpu_ratio"] == pytest.approx(want)
    # the training thread's CPU above the floor's (paired per step): the runtime's own host work
    m = r["non_comm_overhead_main_thread_cpu_seconds"]
    for n, sysr in (("raggedfsdp", a), ("torch", b)):
        assert 0 < sysr["main_thread_cpu_seconds_median"] <= sysr["cpu_seconds_median"] * 1.05
        assert abs(m[n]) < sysr["main_thread_cpu_seconds_median"]
    assert r["non_comm_overhead_main_thread_cpu_ratio"] == pytest.approx(
        m["raggedfsdp"] / m["torch"] if m["torch"] > 0 else float("inf")
    )
    # that split cut at optimizer.step(): per step, fwd_bwd + optimizer is the whole thread time (so the
    # medians of the parts are taken over the same paired differences as the whole)
    sp, fl_opt = (
        r["non_comm_overhead_main_thread_split"],
        r["local_floor"]["main_thread_optimizer_cpu_seconds"],
    )
    fl_h = r["local_floor"]["main_thread_cpu_seconds"]
    for n, sysr in (("raggedfsdp", a), ("torch", b)):
        opt, whole = sysr["main_thread_optimizer_cpu_seconds"], sysr["main_thread_cpu_seconds"]
        assert len(opt) == 2 and all(0 < o < w for o, w in zip(opt, whole))
        fb = sorted((w - o) - (fw - fo) for w, o, fw, fo in zip(whole, opt, fl_h, fl_opt))
        assert sp[n]["fwd_bwd"] == pytest.approx(sum(fb) / 2)  # the median of two
        assert sp[n]["optimizer"] == pytest.approx(sum(o - fo for o, fo in zip(opt, fl_opt)) / 2)
    assert r["non_comm_overhead_main_thread_fwd_bwd_ratio"] == pytest.approx(
        sp["raggedfsdp"]["fwd_bwd"] / sp["torch"]["fwd_bwd"]
    )
    # same math: the two systems' losses agree (fp32)
    assert abs(a["final_loss"] - b["final_loss"]) < 1e-4
    # raggedfsdp gathers in place: its only copies are the model's own (the expert cat, shared by both)
    assert a["copy_bytes"] < b["copy_bytes"]
    assert b["copy_bytes_by_op"].get("fsdp.all_gather_copy_in", 0) > 0
    assert a["copy_bytes_by_op"].get("aten.cat") == b["copy_bytes_by_op"].get("aten.cat")
    # both all-gather and reduce-scatter the same parameters (3 units: 2 blocks + root)
    # the reduce-scatter NCCL runs, on gloo too; + 1 all-reduce of the used flags per backward
    ours = a["collectives_by_op"]
    assert ours.get("_reduce_scatter_base_", 0) == 3 and ours.get("allreduce_", 0) == 1, ours
    assert b["collectives_by_op"]["_reduce_scatter_base_"] == 3
    assert a["collectives_by_op"]["_allgather_base_"] == b["collectives_by_op"]["_allgather_base_"]


@pytest.mark.slow
def test_bench_json_moe_ep2_four_ranks():
    """``--ep 2``: both systems run the same expert-parallel model (dp 2 x ep 2): same losses, the same
    all-to-alls (per MoE layer 3 in forward: counts, dispatch, combine; 2 in backward), no floor/replay."""
    cmd = [
        sys.executable,
        "-m",
        "raggedfsdp.app.cli",
        "bench",
        "--model",
        "moe",
        "--flavor",
        "moe-debug",
        "--ep",
        "2",
        "--nproc",
        "4",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--json",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    a, b = r["raggedfsdp"], r["torch"]
    assert r["ep"] == 2 and r["experts"] == "fused" and "local_floor" not in r
    assert abs(a["final_loss"] - b["final_loss"]) < 1e-4
    for sysr in (a, b):
        assert sysr["collectives_by_op"]["alltoall_base_"] == 5 * 2, sysr["collectives_by_op"]  # 2 MoE layers
        assert sysr["all_to_all_bytes"] > 0
    assert a["all_to_all_bytes"] == b["all_to_all_bytes"]


@pytest.mark.core
@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "sparse"], "invalid choice"),
        (["--model", "dense", "--ep", "2"], "applies to --model moe only"),
        (["--ep", "3"], "must divide --nproc 4"),
        (["--ep", "2", "--experts", "separate"], "splits fused expert stacks"),
        (["--model", "dense", "--experts", "fused"], "apply to --model moe only"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--model", "moe", "--flavor", "huge"], "unknown moe flavor 'huge'"),
        (["--wrap", "superblock2"], "is not a policy of model 'moe'"),
        (["--all-gather-dtype", "fp4"], "invalid choice"),
        (["--ep", "2", "--reduce-scatter-wire-dtype", "bf16"], "could not be told apart"),
    ],
)
def test_bench_bad_arguments_fail_before_launch(argv, match, capsys):
    try:
        rc = main(["bench", *argv])
    except SystemExit as e:  # argparse choices
        rc = e.code
    assert rc == 2
    assert match in capsys.readouterr().err


def test_bench_quantized_wire_bytes_against_torch_two_ranks():
    """``--all-gather-dtype fp8_e4m3 --reduce-scatter-wire-dtype bf16`` (issue 40): both systems report
    ``all_gather_wire_bytes`` / ``reduce_scatter_wire_bytes`` counted in the same run; raggedfsdp's are
    <= 0.55x torch's bf16 all-gather and fp32 reduce-scatter, and the losses stay close."""
    cmd = [sys.executable, "-m", "raggedfsdp.app.cli", "bench", "--model", "dense", "--flavor", "small"]
    cmd += ["--nproc", "2", "--steps", "1", "--warmup", "1", "--batch", "2", "--seq", "16", "--no-floor"]
    cmd += ["--param-dtype", "bf16", "--all-gather-dtype", "fp8_e4m3", "--reduce-scatter-wire-dtype", "bf16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    a, b = r["raggedfsdp"], r["torch"]
    assert r["all_gather_dtype"] == "fp8_e4m3" and r["reduce_scatter_wire_dtype"] == "bf16"
    assert b["all_gather_wire_bytes"] > 0 and b["reduce_scatter_wire_bytes"] > 0
    # torch: two bf16 all-gathers per block (forward, backward re-gather; the root's once) ~ one fp32
    # reduce-scatter of the same padded elements
    assert b["all_gather_wire_bytes"] == pytest.approx(b["reduce_scatter_wire_bytes"], rel=0.05)
    assert 0.45 < r["all_gather_wire_bytes_ratio"] <= 0.55, r["all_gather_wire_bytes_ratio"]
    assert 0.45 < r["reduce_scatter_wire_bytes_ratio"] <= 0.55, r["reduce_scatter_wire_bytes_ratio"]
    assert r["all_gather_wire_bytes_ratio"] == a["all_gather_wire_bytes"] / b["all_gather_wire_bytes"]
    assert abs(a["final_loss"] - b["final_loss"]) < 2e-2
    # the quantize / dequantize work of one accounted step: one payload per unit, one dequantize per
    # all-gather (the counted step's, the same step structure); torch's fully_shard quantizes nothing
    assert a["quantize_seconds"] > 0 and a["dequantize_seconds"] > 0
    assert (
        b["quantize_seconds"] == b["dequantize_seconds"] == 0 == b["quantize_calls"] == b["dequantize_calls"]
    )
    gathers = sum(v for op, v in a["collectives_by_op"].items() if "allgather" in op)
    assert a["dequantize_calls"] == gathers > a["quantize_calls"] > 0, (a["collectives_by_op"], a)
    frac = (a["quantize_seconds"] + a["dequantize_seconds"]) / a["step_seconds_median"]
    assert r["quantize_dequantize_step_fraction"] == pytest.approx(frac)
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "(raggedfsdp fp8_e4m3 / torch bf16)" in table.stdout
    assert "of the raggedfsdp step" in table.stdout


def test_failed_bench_ends_with_one_line_and_the_report_in_out(tmp_path):
    """A rank that raises inside the bench (``RAGGEDFSDP_FAULT=raise@step0:rank1``: its first warm-up
    step) ends the run as a failed ``raggedfsdp train`` does (the same launcher, launch/launcher.py):
    one error line, the last, naming rank 1 and the report; the traceback once, rank-tagged; torchrun's
    failure table, log lines and every rank's traceback in ``--out`` (failure.log), not on the console."""
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "raggedfsdp.app.cli", "bench", "--model", "moe", "--flavor", "moe-debug",
           "--nproc", "2", "--steps", "1", "--warmup", "1", "--seq", "16", "--no-floor",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAGGEDFSDP_FAULT": "raise@step0:rank1"}
    env.pop("RANK", None)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 1, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert [ln for ln in lines if " error: " in ln] == [lines[-1]], res.stderr
    assert lines[-1] == (
        "raggedfsdp bench: [rank 1/2] error: RuntimeError: injected failure on rank 1 at step 0 "
        f"(debug.fail_rank/fail_step) (every rank's report: {out / 'failure.log'})"
    ), lines[-1]
    for noise in ("FAILED", "Root Cause", "closing signal", "exitcode", "frame #"):
        assert noise not in res.stderr, res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    assert "[rank 1/2]     raise RuntimeError(" in res.stderr
    report = (out / "failure.log").read_text()
    assert "the 2-rank bench failed" in report and "Root Cause" in report and lines[-1] in report, report
    assert "rank      : 1 (local_rank: 1)" in report and "    raise RuntimeError(" in report, report


def test_foreach_dispatch_benchmark_runs():
    """``benchmarks/foreach_dispatch.py`` (the command in benchmarks/README.md, "Sharding propagation of
    foreach ops"), small: every system runs in its own process and reports its three step times."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "benchmarks", "foreach_dispatch.py")
    cmd = [sys.executable, script, "--layers", "3", "--dim", "8", "--world-size", "3", "--steps", "1"]
    cmd.append("--json")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert [r["system"] for r in rows] == ["raggedfsdp", "raggedfsdp, fast path off", "torch fully_shard"]
    assert all(r["params"] == 6 and min(r["first"], r["steady"], r["new_set"]) > 0 for r in rows)
    bad = subprocess.run([sys.executable, script, "--layers", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--layers must be >= 1, got 0" in bad.stderr
