"""Driver of benchmarks/gpu/run.sh: one prepared GPU command, one internal deadline, JSON after every stage.

Stages, each a subprocess in its own session (killed with its whole process group at its limit),
each writing its own result file after every sub-measurement, so a stage that runs out of time
still reports what it measured:

========  ===================================  ==========  =================================================
stage     script                               budget (s)  what
========  ===================================  ==========  =================================================
A env     (inline)                             20          python / torch / CUDA / NCCL / GPU, ``import raggedfsdp``
B smoke   benchmarks/gpu/smoke.py              60          bf16 grad parity vs FSDP2, offload accumulation,
                                                           meta init, profiler count of synchronizing CUDA
                                                           calls per phase (both backends, two controls)
C1 dense  benchmarks/gpu/train_compare.py      75          ~1.08B Llama, bf16/fp32, ws 1: ragged vs torch vs
                                                           no-FSDP floor (tokens/s, phase times, host time,
                                                           loss diff, peak memory per system alone)
C2 moe    train_compare.py --model moe         65          ~1.2B MoE (16 fused experts, top-2), the same
D sim8    benchmarks/gpu/sim_ws8.py            60          fake-PG ws 8 rank 0 on the GPU: per-rank memory,
                                                           step time without comm, copy bytes, overlap
E moe128  benchmarks/gpu/moe128.py             110         issue 22 item 4: ``raggedfsdp bench`` with 128
                                                           separate experts per layer, ws 1 NCCL, the
                                                           floor split's main-thread CPU ratio vs torch
F quant   benchmarks/gpu/quant.py              70          issue 40 item 3: ``raggedfsdp bench
                                                           --all-gather-dtype fp8_e4m3`` and ``none``, ws 1
                                                           NCCL: quantize / dequantize seconds per step
                                                           beside both systems' step time and peak memory
========  ===================================  ==========  =================================================

Budget on one H200 (issue 21 / docs research note ``cuda-path-read-2026-12.md`` section 4): the
stage estimates there are A 15 s, B 60-90 s, C1 90-120 s, C2 90 s, D 60-90 s (E was added later;
the first H200 runs took 8-10 / 10-19 / 25-28 / 31 / 23 / 86-92 s; F, added after them, is not yet
measured on a GPU: it comes last, so it also gets what the earlier stages left unused); the budgets
above add to 460 s,
the **460 s internal deadline** (``--deadline``), which itself sits inside run.sh's 520 s outer guard
and the 600 s device-command cap. A stage may use
time an earlier stage left unused; it is always cut so that every later stage keeps at least half
its budget, and nothing runs past the deadline. ``summary.json`` (in ``--out``, default ``$OUT``) and
one ``[run.sh] <stage>`` JSON line are written after every stage; the last stdout line is the
whole summary.

``--dry-run`` (CPU, no GPU): every stage on tiny shapes (gloo / the fake process group), same code
paths, in a few minutes; ``tests/e2e/test_gpu_script.py`` and ``.ci/run`` run it in an environment
that has only torch. Nothing is installed and nothing but torch and raggedfsdp is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.join("benchmarks", "gpu")

# (name, argv after the interpreter, budget in seconds on the GPU)
STAGES = [
    ("smoke", [os.path.join(HERE, "smoke.py")], 60),
    ("dense", [os.path.join(HERE, "train_compare.py"), "--model", "dense"], 75),
    ("moe", [os.path.join(HERE, "train_compare.py"), "--model", "moe"], 65),
    ("sim8", [os.path.join(HERE, "sim_ws8.py")], 60),
    ("moe128", [os.path.join(HERE, "moe128.py")], 110),
    ("quant", [os.path.join(HERE, "quant.py")], 70),
]
ENV_BUDGET = 20
DEADLINE = 460.0  # >= ENV_BUDGET + the stage budgets (460 s); run.sh's outer guard is 520 s
ENV_CODE = (
    "import json, sys, torch\ninfo = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': "
    "torch.version.cuda,\n        'cuda_available': torch.cuda.is_available(), 'gpus': "
    "torch.cuda.device_count()}\nif torch.cuda.is_available():\n    info['gpu_names'] = "
    "[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]\n    info['nccl'] = "
    "'.'.join(map(str, torch.cuda.nccl.version()))\nfor mod in ('pytest', 'numpy', 'transformers'):\n    "
    "import importlib.util\n    info[f'has_{mod}'] = importlib.util.find_spec(mod) is not None\ntry:\n    "
    "import raggedfsdp, raggedfsdp.app.bench.memory, raggedfsdp.app.models.llama, raggedfsdp.app.models.moe\n    "
    "info['raggedfsdp_import'] = 'ok'\nexcept Exception as e:\n    info['raggedfsdp_import'] = "
    "f'{type(e).__name__}: {e}'\nprint(json.dumps(info))\n"
)


def run_stage(cmd, timeout: float, log: str) -> tuple[object, float, str]:
    """Run ``cmd`` in a new session; on timeout kill its whole process group. (rc or "timeout", seconds,
    tail)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: object = p.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            rc = "timeout"
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
    with open(log, errors="replace") as f:
        tail = f.read()[-3000:]
    return rc, round(time.monotonic() - t0, 1), tail


def stage_timeout(i: int, t_start: float, deadline: float, bank: float, dry_run: bool) -> float:
    """Budget of stage ``i`` plus unused earlier time, cut so each later stage keeps half its budget."""
    if dry_run:
        return max(deadline - (time.monotonic() - t_start), 1.0)
    left = deadline - (time.monotonic() - t_start)
    reserve = sum(b for _, _, b in STAGES[i + 1 :]) / 2
    return max(1.0, min(STAGES[i][2] + bank, left - reserve))


def write(summary: dict, out: str) -> None:
    tmp = os.path.join(out, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "summary.json"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: every stage on tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/raggedfsdp-gpu")
    ap.add_argument(
        "--deadline",
        type=float,
        default=DEADLINE,
        help=f"internal deadline in seconds (default {DEADLINE:.0f})",
    )
    ap.add_argument("--only", nargs="*", default=None, choices=[s for s, _, _ in STAGES])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    t_start = time.monotonic()
    summary: dict = {
        "dry_run": args.dry_run,
        "deadline_s": args.deadline,
        "budget_s": dict(env=ENV_BUDGET, **{s: b for s, _, b in STAGES}),
    }
    rc, dt, tail = run_stage(
        [py, "-c", ENV_CODE], ENV_BUDGET * (6 if args.dry_run else 1), os.path.join(args.out, "env.log")
    )
    env: dict = {"rc": rc, "seconds": dt}
    for line in reversed(tail.strip().splitlines()):
        if line.startswith("{"):
            env.update(json.loads(line))
            break
    else:
        env["tail"] = tail[-1500:]
    summary["env"] = env
    write(summary, args.out)
    print(f"[run.sh] env {json.dumps(env)}", flush=True)
    if not args.dry_run and not env.get("gpus"):
        summary["error"] = "no CUDA device visible; use --dry-run on CPU"
    elif env.get("raggedfsdp_import") != "ok":
        summary["error"] = f"import raggedfsdp failed: {env.get('raggedfsdp_import')}"
    else:
        bank = 0.0
        for i, (name, argv, budget) in enumerate(STAGES):
            if args.only is not None and name not in args.only:
                continue
            timeout = stage_timeout(i, t_start, args.deadline, bank, args.dry_run)
            res_path = os.path.join(args.out, f"{name}.json")
            if os.path.exists(res_path):
                os.remove(res_path)
            cmd = [py, *argv, "--out", res_path] + (["--dry-run"] if args.dry_run else [])
            rc, dt, tail = run_stage(cmd, timeout, os.path.join(args.out, f"{name}.log"))
            bank = max(0.0, budget + bank - dt)
            r: dict = {}
            if os.path.exists(res_path):
                with open(res_path) as f:
                    r = json.load(f)
            r.update(rc=rc, wall_s=dt, limit_s=round(timeout, 1))
            if rc != 0:
                r["tail"] = tail.strip().splitlines()[-25:]
            summary[name] = r
            summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
            write(summary, args.out)
            print(
                f"[run.sh] {name} {json.dumps({k: r.get(k) for k in ('rc', 'ok', 'wall_s', 'limit_s')})}",
                flush=True,
            )
    ran = [s for s, _, _ in STAGES if s in summary]
    summary["ok"] = bool(
        "error" not in summary
        and ran
        and all(summary[s].get("rc") == 0 and summary[s].get("ok") for s in ran)
    )
    summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
    write(summary, args.out)
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
