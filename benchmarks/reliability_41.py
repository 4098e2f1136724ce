"""Issue 41's third fault pass: the time from the command to its last line, the exit code and that line,
for the faults this pass fixed that a command shows (convert, resume, pre-launch refusals).

    python benchmarks/reliability_41.py [--only convert-flip,resume-no-run-json]

One 4-step one-process ``raggedfsdp.app.launch.worker`` run of the debug model makes the checkpoints
(step-2, step-4); each case then damages a copy and runs the user's command as a subprocess
(``raggedfsdp`` from this tree: ``python -m raggedfsdp.app.cli``). Prints one row per case.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = ["--model", "debug", "--batch-size", "4", "--seq-len", "32", "--data.max_bytes", "200000",
        "--metrics.eval_batches", "1", "--log-every", "1", "--checkpoint-interval", "2"]  # fmt: skip
CLI = [sys.executable, "-m", "raggedfsdp.app.cli"]
WORKER = [sys.executable, "-m", "raggedfsdp.app.launch.worker"]


def _run(cmd: list[str]) -> tuple[float, int, str]:
    """(seconds, exit code, the line to show): the last line, or for a run that went on, its note
    about ``run.json`` and where it resumed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    lines = (p.stderr.strip() or p.stdout.strip()).splitlines()
    shown = lines[-1] if lines else ""
    if p.returncode == 0:
        shown = " / ".join(ln for ln in lines if "run.json was" in ln or "resumed from" in ln) or shown
    return time.monotonic() - t0, p.returncode, shown


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def cases(tmp: Path, run: Path) -> dict:
    ck = run / "checkpoints"

    def flip():
        d = _copy(ck / "step-4", tmp / "flip" / "step-4")
        f = sorted(d.glob("*.distcp"))[0]
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x40
        f.write_bytes(bytes(b))
        return [*CLI, "convert", str(d), "--to", "torch", str(tmp / "flip.pt")]

    def trunc():
        d = _copy(ck / "step-4", tmp / "trunc" / "step-4")
        f = sorted(d.glob("*.distcp"))[0]
        f.write_bytes(f.read_bytes()[:100])
        return [*CLI, "convert", str(d), "--to", "torch", str(tmp / "trunc.pt")]

    def unfinished():
        d = _copy(ck / "step-4", tmp / "tmpsave" / "step-6.tmp")
        return [*CLI, "convert", str(d), "--to", "torch", str(tmp / "tmp.pt")]

    def resume(kind):
        def make():
            out = tmp / f"resume-{kind}"
            shutil.copytree(run, out)
            if kind == "deleted":
                (out / "run.json").unlink()
            else:
                (out / "run.json").write_text('{"run_id": ')
            return [*WORKER, *ARGS, "--steps", "6", "--out", str(out), "--resume", "auto"]

        return make

    def init_from():
        return [*CLI, "train", "--nproc", "2", *ARGS, "--steps", "4", "--model.init_from", str(tmp / "nope"),
                "--out", str(tmp / "init")]  # fmt: skip

    def other_model():
        wide = ["--model.dim", "48", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
        return [*CLI, "train", "--nproc", "2", *ARGS, "--steps", "6", *wide, "--out", str(tmp / "other"),
                "--resume", str(ck / "step-4")]  # fmt: skip

    return {
        "convert-flip": flip,
        "convert-trunc": trunc,
        "convert-tmp": unfinished,
        "resume-no-run-json": resume("deleted"),
        "resume-corrupt-run-json": resume("corrupt"),
        "init-from-missing": init_from,
        "resume-other-model": other_model,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        run = tmp / "run"
        s, rc, last = _run([*WORKER, *ARGS, "--steps", "4", "--out", str(run)])
        assert rc == 0, last
        print(
            f"setup: 4-step run in {s:.1f}s (run id {json.loads((run / 'run.json').read_text())['run_id']})"
        )
        want = set(filter(None, args.only.split(",")))
        print("| case | command -> last line | exit | last line |\n|---|---|---|---|")
        for name, make in cases(tmp, run).items():
            if want and name not in want:
                continue
            s, rc, last = _run(make())
            print(f"| `{name}` | {s:.1f} s | {rc} | `{last[:400]}` |", flush=True)


if __name__ == "__main__":
    main()
