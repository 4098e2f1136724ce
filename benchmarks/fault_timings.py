"""Fault campaign for `raggedfsdp train` (issue 11): for each injected fault, the time from the fault
to the last line the user sees (printed after every rank exited), the exit code and that line.

    python benchmarks/fault_timings.py [--nproc 2] [--only nan,hang]

Each case is one real 2-rank launch of the debug model (``RAGGEDFSDP_FAULT``, see
``raggedfsdp/app/train/faults.py``). The fault's wall time comes from the rank's own log line
(``debug: injecting fault KIND@stepN (t=...)``); SIGINT and kill -9 are sent to the launcher by this
script (``ctrl-c-*``: to the job's whole process group, as a terminal does, while every rank sleeps
inside the save of step 4: ``slowsave``; ``truncdata*``: the ``--data`` file is truncated the moment
the launcher prints its ``launching`` line, i.e. after its pre-launch check, before the ranks load;
``truncate-bin``: a ``.bin`` ``--data`` cut to half in place by rank 0 at step 3, mid-run).
Prints one row per case: the time, the exit code, how many ``error:`` lines the user saw (1: one clear
last line), whether torchrun's failure table or a C++ stack was printed (``noise``), and the last line.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = [
    "--model", "debug", "--batch-size", "4", "--seq-len", "32", "--data.max_bytes", "200000",
    "--optimizer.warmup_steps", "1", "--metrics.eval_batches", "1", "--log-every", "1",
    "--checkpoint-interval", "2",
]  # fmt: skip

CASES = {
    "nan": ("nan@step3:rank1", []),
    "inf-skip": ("inf@step3:rank1", ["--training.on_nonfinite", "skip"]),
    "raise": ("raise@step3:rank1", []),
    "exit": ("exit@step3:rank1", []),
    "hang": ("hang@step3:rank1", ["--job.hang_timeout_s", "5"]),
    "enospc": ("enospc@step2:rank1", []),
    "eacces": ("eacces@step2:rank1", []),
    "oom": ("oom@step3:rank1", []),
    "badtoken": ("badtoken@step3:rank1", []),
    "shortbatch": ("shortbatch@step3:rank1", []),
    "sigterm-rank": ("sigterm@step3:rank1", []),
    "nangrad": ("nangrad@step3:rank1", []),
    "nanparam-ckpt-off": ("nanparam@step2:rank0", ["--checkpoint-interval", "0"]),
    "swapdata": ("swapdata@step0:rank1", []),
    "swapdata-step3": ("swapdata@step3:rank1", []),
    "hang-pg20": ("hang@step8:rank1", ["--steps", "12", "--job.pg_timeout_s", "20"]),
    "savehang-pg20": ("savehang@step2:rank1", ["--job.pg_timeout_s", "20"]),
    "truncdata-empty": ("", []),
    "truncdata-half": ("", []),
    "truncate-bin": ("truncate@step3:rank0", []),
    "sigint-launcher": ("", []),
    "kill9-launcher": ("", []),
    "ctrl-c-mid-save": ("slowsave@step4", []),
    "ctrl-c-twice-mid-save": ("slowsave@step4", []),
}


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("raggedfsdp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "raggedfsdp.app.cli"]


def _fault_t(text: str) -> float | None:
    m = re.search(r"debug: injecting fault \S+ \(t=([0-9.]+)\)", text)
    return float(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return kids


NOISE = ("FAILED", "Root Cause", "closing signal", "frame #")  # torchrun's table and log lines, C++ stacks


def _shape(text: str) -> str:
    """``E errors[, noise]``: the ``error:`` lines the user saw and whether any noise was printed."""
    errors = sum(" error: " in ln for ln in text.splitlines())
    return f"{errors} error{'s' if errors != 1 else ''}" + (
        ", noise" if any(n in text for n in NOISE) else ""
    )


def run_case(name: str, nproc: int, tmp: Path) -> tuple[str, float, int, str, str]:
    fault, extra = CASES[name]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "RAGGEDFSDP_OUT_LOCK_HELD")}
    env["RAGGEDFSDP_FAULT"] = fault
    steps = "400" if name.endswith("launcher") else "8"
    cmd = [*_cli(), "train", "--nproc", str(nproc), *ARGS, "--steps", steps, "--out", str(tmp / name), *extra]
    if name.startswith("ctrl-c"):
        return _ctrl_c_mid_save(name, cmd, env)
    data = None
    if name.startswith("truncdata"):  # a 200 kB text file, truncated after the pre-launch check
        data = tmp / f"{name}.txt"
        data.write_text(
            "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(4000))
        )
        cmd += ["--data", str(data)]
    if name == "truncate-bin":  # a 200 kB .bin of byte tokens, cut to half by rank 0 at step 3
        import numpy as np

        from raggedfsdp.app.train.data import write_token_bin

        text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2000))
        ids = np.frombuffer(text.encode(), dtype=np.uint8)
        cmd += ["--data", str(write_token_bin(tmp / f"{name}.bin", [ids], vocab_size=256))]
    if not name.endswith("launcher"):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines, t_last, t0 = [], time.time(), None
        for line in proc.stderr:  # the time of the last line the user sees (all ranks have exited)
            lines.append(line)
            t_last = time.time()
            if data is not None and t0 is None and "launching" in line:
                whole = data.read_bytes()
                data.write_bytes(b"" if name.endswith("empty") else whole[: len(whole) // 2])
                t0 = time.time()
        out = proc.stdout.read()
        proc.wait()
        t0 = t0 or _fault_t("".join(lines))
        last = (lines[-1] if lines else "").strip()
        if proc.returncode == 0:
            last = (out.strip().splitlines() or [""])[-1]
            t_last = time.time()
        return name, (t_last - t0) if t0 else float("nan"), proc.returncode, _shape("".join(lines)), last
    err_path = tmp / f"{name}.err"
    err_fh = open(err_path, "w")  # noqa: SIM115 (the ranks inherit it)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_fh, text=True, env=env)
    while "step   3/400" not in (proc.stdout.readline() or "step   3/400"):
        pass
    ranks = _children(proc.pid)
    t0 = time.time()
    if name == "sigint-launcher":
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
        err_fh.close()
        err = err_path.read_text()
        return name, time.time() - t0, proc.returncode, _shape(err), err.strip().splitlines()[-1]
    proc.kill()
    proc.wait()
    while any(map(_alive, ranks)) and time.time() - t0 < 60:
        time.sleep(0.05)
    dt = time.time() - t0
    left = [r for r in ranks if _alive(r)]
    time.sleep(1.0)
    err_fh.close()
    err = err_path.read_text()
    stacks = err.count("frame #0:")
    what = f"ranks {ranks} {'still alive: ' + str(left) if left else 'all exited'}; {stacks} C++ stack(s)"
    return name, dt, -9, _shape(err), what


def _ctrl_c_mid_save(name: str, cmd: list[str], env: dict[str, str]) -> tuple[str, float, int, str, str]:
    """SIGINT (once, or twice 2.5 s apart) to the job's process group during the save of step 4."""
    import threading

    env = {**env, "RAGGEDFSDP_FAULT_SLEEP_S": "4" if name == "ctrl-c-mid-save" else "60"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    while not any("debug: slow save" in ln for ln in lines) and proc.poll() is None:
        time.sleep(0.05)
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    if name == "ctrl-c-twice-mid-save":
        time.sleep(2.5)  # past the ranks' grace period
        os.killpg(proc.pid, signal.SIGINT)
    proc.wait()
    reader.join(timeout=10)
    return (
        name,
        time.time() - t0,
        proc.returncode,
        _shape("".join(lines)),
        (lines[-1] if lines else "").strip(),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = p.parse_args()
    names = [n for n in CASES if not args.only or n in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            n, dt, rc, shape, last = run_case(name, args.nproc, Path(tmp))
            print(f"{n:22s} fault->end {dt:6.2f}s  rc {rc:4d}  {shape:16s} last: {last}", flush=True)


if __name__ == "__main__":
    main()
