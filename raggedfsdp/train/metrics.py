"""Metrics: one console line per log step (rank 0) and ``OUT/metrics.jsonl``.

JSONL records (one object per line):

- train records: ``step``, ``loss`` (mean over the global batch), ``grad_norm`` (before clipping),
  ``lr``, ``tokens_per_s`` (all ranks together), ``tokens_per_s_per_rank``, ``step_time_s`` (mean
  over the steps since the previous record), ``tokens_seen``, ``elapsed_s``;
- eval records: ``step``, ``eval_loss`` (mean over the held-out windows), ``elapsed_s``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLogger", "format_line", "read_jsonl"]


def format_line(rec: dict[str, Any], total_steps: int) -> str:
    """The console line of one record."""
    width = len(str(total_steps))
    head = f"step {rec['step']:>{width}}/{total_steps}"
    if "eval_loss" in rec:
        ppl = math.exp(min(rec["eval_loss"], 50.0))
        return f"{head} | eval_loss {rec['eval_loss']:.4f} | eval_ppl {ppl:.2f}"
    return (
        f"{head} | loss {rec['loss']:.4f} | grad_norm {rec['grad_norm']:.3f} | lr {rec['lr']:.2e}"
        + (f" | aux {rec['aux_loss']:.4f}" if "aux_loss" in rec else "")
        + f" | tok/s {rec['tokens_per_s']:,.0f} | step {rec['step_time_s'] * 1e3:.0f} ms"
    )


class MetricsLogger:
    """Prints and records metrics; a no-op unless ``enabled`` (rank 0)."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        enabled: bool,
        jsonl: bool,
        total_steps: int,
        stream: TextIO | None = None,
        resume_step: int | None = None,
    ) -> None:
        """``resume_step``: a resumed run keeps the records of ``OUT/metrics.jsonl`` up to that step
        (those of the interrupted run) and appends; None starts a new file."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream
        self._fh = None
        if enabled and jsonl:
            path = Path(out_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and path.exists():
                for line in path.read_text().splitlines():
                    try:  # a crash may have left a partial last line
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and rec.get("step", 0) <= resume_step:
                        kept.append(rec)
            self._fh = open(path, "w", buffering=1)  # line-buffered: readable while training
            for rec in kept:
                self._fh.write(json.dumps(rec) + "\n")

    def log(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        print(format_line(rec, self.total_steps), file=self.stream, flush=True)
        if self._fh is not None:
            self._fh.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
