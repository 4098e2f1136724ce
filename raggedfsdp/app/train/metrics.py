"""Metrics: one console line per log step (rank 0) and ``OUT/metrics.jsonl``.

JSONL records (one object per line):

- train records: ``step``, ``loss`` (mean over the global batch), ``grad_norm`` (before clipping),
  ``lr``, ``tokens_per_s`` (all ranks together), ``tokens_per_s_per_rank``, ``step_time_s`` (mean
  over the steps since the previous record), ``tokens_seen``, ``elapsed_s``;
- eval records: ``step``, ``eval_loss`` (mean over the held-out windows), ``elapsed_s``.

Added when known: ``mfu`` (model FLOPs utilisation, 0-1: achieved model FLOP/s per rank over the
device's peak; model FLOPs from :func:`model_flops_per_token`, peak from ``--job.peak_tflops`` or
:data:`PEAK_TFLOPS`), ``peak_memory_bytes`` (max over ranks: the CUDA allocator's peak on GPU, the
process's peak resident set on CPU, ``peak_memory_source`` ``"cuda"`` or ``"rss"`` says which; the
line prints ``mem X rss`` for the latter) and ``aux_loss`` (MoE load balancing). With ``tensorboard``
installed (``pip install 'raggedfsdp[tensorboard]'``) every numeric field also goes to TensorBoard
event files under ``OUT/tb`` (``train/*``, ``eval/*``). The line ends with ``eta`` (steps left x
``step_time_s``); without a known peak FLOP/s (CPU) one line says why there is no ``mfu``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "PEAK_TFLOPS",
    "MetricsLogger",
    "format_line",
    "model_flops_per_token",
    "peak_flops",
    "peak_memory_bytes",
    "read_jsonl",
]

# Dense peak TFLOP/s per GPU (vendor datasheets, no sparsity): bf16 tensor cores and TF32 (fp32 matmuls).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 494.0},
    "H100 SXM": {"bf16": 989.0, "fp32": 494.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 378.0},
    "H100": {"bf16": 989.0, "fp32": 494.0},
    "H800": {"bf16": 989.0, "fp32": 494.0},
    "B200": {"bf16": 2250.0, "fp32": 1100.0},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "A800": {"bf16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp32": 183.0},
    "L4": {"bf16": 121.0, "fp32": 60.0},
    "A10G": {"bf16": 70.0, "fp32": 35.0},
    "RTX 4090": {"bf16": 165.0, "fp32": 82.6},
}


def model_flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a built-in model config.

    ``6 N`` for the matmul parameters ``N`` (all parameters but the input embedding, which is a
    lookup; it counts when tied, since it then also makes the logits), plus attention
    scores ``12 * L_attn * H * E * T`` (PaLM, Chowdhery et al. 2022, appendix B; like PaLM and
    torchtitan, the causal mask is not discounted), plus for each Gated DeltaNet layer the matmuls
    of the chunked form per token and value head, ``3 * (4 C Dk + 2 C Dv + 6 Dk Dv)`` (chunk length
    ``C``; the per-chunk triangular solve is not counted). A config with ``flops_per_token`` (e.g. a
    MoE config counting active experts only) is asked instead. Tested against
    ``torch.utils.flop_counter.FlopCounterMode`` on the built-in models.
    """
    own = getattr(cfg, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    n = cfg.num_params()
    if not getattr(cfg, "tie_embeddings", False):
        n -= cfg.vocab_size * cfg.dim
    flops = 6.0 * n
    interval = getattr(cfg, "full_attention_interval", 0)
    n_attn = cfg.n_layers // interval if interval else cfg.n_layers
    flops += 12.0 * n_attn * cfg.n_heads * cfg.head_dim * seq_len
    if interval:  # chunked gated delta rule (models/hybrid.py), matmuls per token and head, forward
        c, dk, dv = min(cfg.chunk_size, seq_len), cfg.linear_key_head_dim, cfg.linear_value_head_dim
        fwd = 4 * c * dk + 2 * c * dv + 6 * dk * dv  # K K^T, Q K^T; (M * QK^T) U; W_k S, Q S, K^T U
        flops += 3.0 * (cfg.n_layers - n_attn) * cfg.linear_num_value_heads * fwd
    return flops


def peak_flops(device, param_dtype: str = "bf16", override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one ``device``: ``override_tflops`` (> 0), else :data:`PEAK_TFLOPS` by the CUDA
    device name (``fp32`` compute uses the TF32 figure); ``None`` when unknown (CPUs: pass
    ``--job.peak_tflops``)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            return PEAK_TFLOPS[key]["fp32" if param_dtype == "fp32" else "bf16"] * 1e12
    return None


def peak_memory_bytes(device) -> int:
    """This process's peak memory: the CUDA allocator's peak on a GPU, else the peak resident set."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_line(rec: dict[str, Any], total_steps: int) -> str:
    """The console line of one record."""
    width = len(str(total_steps))
    head = f"step {rec['step']:>{width}}/{total_steps}"
    if "eval_loss" in rec:
        ppl = math.exp(min(rec["eval_loss"], 50.0))
        return f"{head} | eval_loss {rec['eval_loss']:.4f} | eval_ppl {ppl:.2f}"
    line = (
        f"{head} | loss {rec['loss']:.4f} | grad_norm {rec['grad_norm']:.3f} | lr {rec['lr']:.2e}"
        + (f" | aux {rec['aux_loss']:.4f}" if "aux_loss" in rec else "")
        + f" | tok/s {rec['tokens_per_s']:,.0f} | step {rec['step_time_s'] * 1e3:.0f} ms"
    )
    if "mfu" in rec:
        line += f" | mfu {100 * rec['mfu']:.1f}%"
    if "peak_memory_bytes" in rec:  # CPU: the process's peak resident set (RSS), not tensor bytes
        line += f" | mem {_gib(rec['peak_memory_bytes'])}" + (
            " rss" if rec.get("peak_memory_source") == "rss" else ""
        )
    left = total_steps - rec["step"]
    if left > 0:  # at the recent step time (the mean since the previous log line)
        line += f" | eta {_duration(left * rec['step_time_s'])}"
    return line


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
        if s >= 60
        else f"{s}s"
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
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        tensorboard: bool = False,
    ) -> None:
        """``resume_step``: a resumed run keeps the records of ``OUT/metrics.jsonl`` up to that step
        (those of the interrupted run) and appends; None starts a new file. ``flops_per_token`` and
        ``peak_flops`` (FLOP/s of one device): a train record gets ``mfu``. ``tensorboard``: also
        write event files under ``OUT/tb`` when the ``tensorboard`` package is installed."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._fh = None
        self._tb = None
        self._said_no_mfu = False
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional dependency: pip install 'raggedfsdp[tensorboard]'
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tb"), purge_step=resume_step)
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
        if "tokens_per_s_per_rank" in rec and self.flops_per_token and self.peak_flops:
            rec = dict(rec, mfu=rec["tokens_per_s_per_rank"] * self.flops_per_token / self.peak_flops)
        elif "tokens_per_s_per_rank" in rec and not self.peak_flops and not self._said_no_mfu:
            self._said_no_mfu = True
            print("(no mfu column: this device's peak FLOP/s is unknown (CPU, or a GPU outside the table); "
                  "set --job.peak_tflops T to get one)", file=self.stream, flush=True)  # fmt: skip
        print(format_line(rec, self.total_steps), file=self.stream, flush=True)
        if self._fh is not None:
            self._fh.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            kind = "eval" if "eval_loss" in rec else "train"
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, global_step=rec["step"])

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
