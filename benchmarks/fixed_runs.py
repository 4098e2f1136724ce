"""The fixed set of runs of issue #18: a refactor must leave their losses and JSON bit-identical.

    python benchmarks/fixed_runs.py --out /tmp/fixed-before            # on the old commit
    python benchmarks/fixed_runs.py --out /tmp/fixed-after             # on the new one
    python benchmarks/fixed_runs.py --compare /tmp/fixed-before /tmp/fixed-after
    python benchmarks/fixed_runs.py --rehash /tmp/fixed-before     # after a change of what is hashed

Each run writes into its own folder under ``--out``; ``OUT/hashes.json`` holds one SHA-256 (first 16
hex digits) per run. Runs (CPU, gloo, 2 ranks where a launcher is involved):

- ``train-default``: ``raggedfsdp train`` with its defaults (llama tiny, 600 steps, 2 ranks);
- ``train-moe`` / ``train-hybrid`` / ``train-muon`` / ``train-adamw8bit``: 40-step trains, every step logged;
- ``bench``: ``raggedfsdp bench --json`` (moe, 2 ranks, 4 steps);
- ``plan-*``: ``raggedfsdp plan --json``; ``estimate-*``: ``raggedfsdp estimate-memory --json``.

What is hashed: for a train, every ``metrics.jsonl`` record without its wall-clock fields
(``DROP_TRAIN``: throughput, step time, elapsed time, process peak memory, the straggler report) --
i.e. step, loss,
grad_norm, lr, tokens_seen, eval_loss, eval_ppl and whatever else a record holds; for a JSON command,
its stdout JSON without the keys matching ``DROP_JSON`` (timings, throughput and ratios built from
them, the measured local floor). The exit code is hashed with it, so a run that fails before and
passes after (or the reverse) shows as a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TRAIN_LEN = 40
RUNS: dict[str, tuple[str, list[str]]] = {
    "train-default": ("train", ["train"]),
    "train-moe": ("train", ["train", "--model.name", "moe", "--steps", str(TRAIN_LEN), "--log-every", "1"]),
    "train-hybrid": (
        "train",
        ["train", "--config", "hybrid-tiny", "--steps", str(TRAIN_LEN), "--log-every", "1"],
    ),
    "train-muon": ("train", ["train", "--optim", "muon", "--steps", str(TRAIN_LEN), "--log-every", "1"]),
    "train-adamw8bit": (
        "train",
        ["train", "--optim", "adamw8bit", "--steps", str(TRAIN_LEN), "--log-every", "1"],
    ),
    "bench": ("json", ["bench", "--model", "moe", "--nproc", "2", "--steps", "4", "--json", "--quiet"]),
    "plan-llama3-70b": ("json", ["plan", "--model", "llama3-70b", "--world-size", "1024", "--json"]),
    "plan-auto": (
        "json",
        ["plan", "--model", "llama3-70b", "--world-size", "512", "--unit", "auto", "--json"],
    ),
    "plan-hybrid-27b": (
        "json",
        ["plan", "--model", "hybrid-27b", "--world-size", "64", "--unit", "superblock", "--json"],
    ),
    "estimate-params": ("json", ["estimate-memory", "--params", "27e9", "--world-size", "64", "--json"]),
    "estimate-llama3-8b": (
        "json",
        ["estimate-memory", "--model", "llama3-8b", "-m", "64", "--replicate", "8", "--json"],
    ),
    "estimate-hybrid-tiny": (
        "json",
        [
            "estimate-memory",
            "--model",
            "hybrid:tiny",
            "--unit",
            "superblock",
            "--world-size",
            "3",
            "--recipe",
            "fp32",
            "--json",
        ],
    ),
    # The README's command; it fails with exit code 2 before issue #18's resolver (a known difference).
    "estimate-hybrid-27b": (
        "json",
        ["estimate-memory", "--model", "hybrid-27b", "--world-size", "64,256", "--recipe", "muon", "--json"],
    ),
}

# the straggler report names the slowest unit of a step by wall clock
DROP_TRAIN = {"tokens_per_s", "tokens_per_s_per_rank", "step_time_s", "elapsed_s", "peak_memory_bytes"}
DROP_TRAIN |= {"mfu", "straggler"}
DROP_JSON = re.compile(r"seconds|tokens_per_second|throughput|overhead|local_floor|cpu_time")


def _scrub(x):
    if isinstance(x, dict):
        return {k: _scrub(v) for k, v in x.items() if not DROP_JSON.search(k)}
    if isinstance(x, list):
        return [_scrub(v) for v in x]
    return x


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def run_one(name: str, out: Path) -> dict:
    kind, argv = RUNS[name]
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run each time (train refuses a used --out)
    folder.mkdir(parents=True)
    if kind == "train":
        argv = argv + ["--out", str(folder / "run")]
    cmd = [sys.executable, "-m", "raggedfsdp.app.cli", *argv]
    with open(folder / "stdout.txt", "w") as so, open(folder / "stderr.txt", "w") as se:
        rc = subprocess.run(cmd, stdout=so, stderr=se, cwd=folder, env=os.environ.copy()).returncode
    return hash_run(name, folder, rc)


def hash_run(name: str, folder: Path, rc: int) -> dict:
    """The record of run ``name`` whose outputs are in ``folder`` (``--rehash`` recomputes it)."""
    kind, argv = RUNS[name]
    if kind == "train":
        argv = argv + ["--out", str(folder / "run")]
    if kind == "train":
        path = folder / "run" / "metrics.jsonl"
        recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        body = [{k: v for k, v in r.items() if k not in DROP_TRAIN} for r in recs]
        last = next((r["loss"] for r in reversed(recs) if "loss" in r), None)
        note = f"{len(recs)} records, last loss {last}"
    else:
        text = (folder / "stdout.txt").read_text()
        try:
            body = _scrub(json.loads(text))
            note = f"{len(text)} chars of JSON"
        except json.JSONDecodeError:
            body = None
            note = (
                "no JSON: " + (folder / "stderr.txt").read_text().strip().splitlines()[-1:][0][:80]
                if (folder / "stderr.txt").read_text().strip()
                else "no JSON"
            )
    return {
        "cmd": "raggedfsdp " + " ".join(argv),
        "rc": rc,
        "hash": _digest({"rc": rc, "body": body}),
        "note": note,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for the runs (one subfolder each) and hashes.json")
    ap.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    ap.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="print the table of two earlier --out folders and exit",
    )
    ap.add_argument(
        "--rehash",
        type=Path,
        metavar="OUT",
        help="recompute OUT/hashes.json from the runs' saved outputs (after DROP_TRAIN / DROP_JSON change)",
    )
    a = ap.parse_args()
    if a.rehash:
        path = a.rehash / "hashes.json"
        hashes = json.loads(path.read_text())
        for name, h in hashes.items():
            hashes[name] = hash_run(name, a.rehash / name, h["rc"])
        path.write_text(json.dumps(hashes, indent=1))
        return 0
    if a.compare:
        before, after = (json.loads((p / "hashes.json").read_text()) for p in a.compare)
        print("| run | before | after | same |\n|---|---|---|---|")
        for name in RUNS:
            b, f = before.get(name, {}), after.get(name, {})
            same = "yes" if b.get("hash") == f.get("hash") and b else "**no**"
            print(
                f"| {name} | {b.get('hash')} (rc {b.get('rc')}) | {f.get('hash')} (rc {f.get('rc')}) | "
                f"{same} |"
            )
        return 0
    if a.out is None:
        ap.error("--out DIR is required (or --compare BEFORE AFTER)")
    a.out.mkdir(parents=True, exist_ok=True)
    names = a.only.split(",") if a.only else list(RUNS)
    hashes_path = a.out / "hashes.json"
    hashes = json.loads(hashes_path.read_text()) if hashes_path.exists() else {}
    for name in names:
        hashes[name] = run_one(name, a.out)
        hashes_path.write_text(json.dumps(hashes, indent=1))
        h = hashes[name]
        print(f"{name:<22} {h['hash']}  rc {h['rc']}  {h['note']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
