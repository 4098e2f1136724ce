"""Driver of benchmarks/gpu/run.sh: tests/gpu, then memory and speed vs torch's fully_shard; one JSON.

Stages (each in a subprocess with its own time limit, so one hang cannot eat the slot):

1. ``env``: torch / CUDA / GPU versions; ``import raggedfsdp`` (the error, if it fails: e.g. an
   unsupported torch version).
2. ``tests``: ``pytest tests/gpu`` (junit XML -> per-test outcomes; each test's measurements from
   ``$RAGGEDFSDP_GPU_RESULTS``).
3. ``memory``: ``benchmarks/memory_vs_torch.py --device cuda`` (CUDA allocator peak of one step,
   both backends, ratios).
4. ``speed``: ``benchmarks/fsdp_vs_torch.py --device cuda`` under torchrun (interleaved step times).

``--dry-run`` (CPU): stage 1, ``pytest --collect-only tests/gpu``, the memory benchmark on a tiny
model with the fake process group and the speed benchmark's ``--help``: it checks that everything
imports, collects and parses, without a GPU. The summary's ``ok`` is true when every stage ran
and no test failed. Total budget: < 8 minutes on one GPU from a bare machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(cmd, timeout, env=None, log=None):
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    if log:
        with open(log, "w") as f:
            f.write(out)
    return rc, out, round(time.monotonic() - t0, 1)


def _last_json(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def stage_env(py):
    code = (
        "import json, sys, torch\n"
        "info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "        'cuda_available': torch.cuda.is_available(), 'gpus': torch.cuda.device_count(),\n"
        "        'gpu_names': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],\n"
        "        'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}\n"
        "try:\n"
        "    import raggedfsdp, raggedfsdp.fsdp.memory\n"
        "    info['raggedfsdp_import'] = 'ok'\n"
        "except Exception as e:\n"
        "    info['raggedfsdp_import'] = f'{type(e).__name__}: {e}'\n"
        "print(json.dumps(info))\n"
    )
    rc, out, dt = _run([py, "-c", code], 120)
    info = _last_json(out) or {"error": out[-2000:]}
    info["rc"], info["seconds"] = rc, dt
    return info


def stage_tests(py, out_dir, dry_run):
    env = dict(os.environ, RAGGEDFSDP_GPU_RESULTS=os.path.join(out_dir, "results"))
    junit = os.path.join(out_dir, "junit.xml")
    cmd = [py, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rA",
           f"--junitxml={junit}"]
    if dry_run:
        cmd = [py, "-m", "pytest", "tests/gpu", "tests/dist/test_fsdp_memory.py", "tests/unit/test_memory.py",
               "--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    rc, out, dt = _run(cmd, 420, env=env, log=os.path.join(out_dir, "pytest.log"))
    res = {"rc": rc, "seconds": dt}
    if dry_run:
        ids = [ln for ln in out.splitlines() if "::" in ln]
        res["collected"] = len(ids)
        res["collected_gpu"] = sum(ln.startswith("tests/gpu") for ln in ids)
        res["tail"] = out.strip().splitlines()[-3:]
        return res
    outcomes = {}
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("name")
            state = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    state = child.tag
                    outcomes[name] = {"outcome": state, "message": (child.get("message") or "")[:600]}
                    break
                if child.tag == "skipped":
                    state = "skipped"
                    outcomes[name] = {"outcome": state, "message": (child.get("message") or "")[:200]}
                    break
            else:
                outcomes[name] = {"outcome": state, "seconds": float(case.get("time", 0))}
    res["tests"] = outcomes
    for k in ("passed", "failure", "error", "skipped"):
        res[k] = sum(v["outcome"] == k for v in outcomes.values())
    res["measurements"] = {}
    rdir = env["RAGGEDFSDP_GPU_RESULTS"]
    if os.path.isdir(rdir):
        for fn in sorted(os.listdir(rdir)):
            with open(os.path.join(rdir, fn)) as f:
                res["measurements"][fn.removesuffix(".json")] = json.load(f)
    if not outcomes:
        res["tail"] = out.strip().splitlines()[-30:]
    return res


def stage_memory(py, out_dir, dry_run):
    args = ["--device", "cuda", "--dim", "2048", "--blocks", "8", "--batch", "32"]
    if dry_run:
        args = ["--nproc", "2", "--dim", "64", "--blocks", "2", "--batch", "4"]
    rc, out, dt = _run([py, "benchmarks/memory_vs_torch.py", *args], 240, log=os.path.join(out_dir, "memory.log"))
    summary = _last_json(out)
    res = {"rc": rc, "seconds": dt, "command": "python benchmarks/memory_vs_torch.py " + " ".join(args)}
    if summary:
        res["ratios"] = {dt_: {k: round(v, 4) for k, v in row.items() if k.startswith("ratio")}
                         for dt_, row in summary["results"].items()}
        res["mib"] = {dt_: {b: {k: round(v / 2**20, 2) for k, v in row[b].items()} for b in ("ragged", "torch")}
                      for dt_, row in summary["results"].items()}
    else:
        res["tail"] = out.strip().splitlines()[-20:]
    return res


def stage_speed(py, out_dir, dry_run, gpus):
    if dry_run:
        cmd = [py, "benchmarks/fsdp_vs_torch.py", "--help"]
    else:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={max(gpus, 1)}",
               "benchmarks/fsdp_vs_torch.py", "--device", "cuda", "--flavor", "small", "--steps", "10",
               "--batch", "8", "--seq", "512", "--param-dtype", "bf16"]
    rc, out, dt = _run(cmd, 240, log=os.path.join(out_dir, "speed.log"))
    res = {"rc": rc, "seconds": dt, "command": " ".join(cmd[1:])}
    keep = ("step time", "copy bytes", "peak memory", "peak reserved", "max |loss", "model=")
    res["lines"] = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(keep)]
    if rc != 0:
        res["tail"] = out.strip().splitlines()[-20:]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: import, collect and parse everything")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/raggedfsdp-gpu")
    ap.add_argument("--skip", nargs="*", default=[], choices=["tests", "memory", "speed"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    t0 = time.monotonic()
    summary = {"dry_run": args.dry_run, "env": stage_env(py)}
    print(f"[run.sh] env: {json.dumps(summary['env'])}", flush=True)
    gpus = summary["env"].get("gpus") or 0
    if not args.dry_run and not gpus:
        summary["error"] = "no CUDA device visible; use --dry-run on CPU"
    else:
        if "tests" not in args.skip:
            summary["tests"] = stage_tests(py, args.out, args.dry_run)
            print(f"[run.sh] tests done in {summary['tests']['seconds']} s (rc {summary['tests']['rc']})", flush=True)
        if "memory" not in args.skip:
            summary["memory"] = stage_memory(py, args.out, args.dry_run)
            print(f"[run.sh] memory done in {summary['memory']['seconds']} s", flush=True)
        if "speed" not in args.skip:
            summary["speed"] = stage_speed(py, args.out, args.dry_run, gpus)
            print(f"[run.sh] speed done in {summary['speed']['seconds']} s", flush=True)
    tests = summary.get("tests", {})
    stages_ok = all(summary.get(s, {}).get("rc", 0) == 0 for s in ("memory", "speed"))
    tests_ok = tests.get("rc", 0) == 0 and not tests.get("failure") and not tests.get("error")
    summary["ok"] = bool("error" not in summary and stages_ok and tests_ok
                         and summary["env"].get("raggedfsdp_import") == "ok")
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
