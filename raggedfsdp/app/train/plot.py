"""``raggedfsdp plot``: loss (train and eval) and grad-norm curves from metrics.jsonl files.

Needs matplotlib (``pip install raggedfsdp[plot]``); it is imported only here.
"""

from __future__ import annotations

import os
from pathlib import Path

from raggedfsdp.app.train.metrics import read_jsonl

__all__ = ["plot_metrics"]


def _label(path: Path) -> str:
    return path.parent.name if path.name == "metrics.jsonl" and path.parent.name else path.stem


def plot_metrics(
    paths: list[str | os.PathLike], output: str | os.PathLike, *, title: str | None = None
) -> Path:
    """Draw loss and grad norm of one or more runs (one color per file) into ``output`` (PNG, SVG, PDF)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "raggedfsdp plot needs matplotlib: pip install 'raggedfsdp[plot]' (or pip install matplotlib)"
        ) from e
    fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(11, 4))
    for i, p in enumerate(map(Path, paths)):
        if p.is_dir():  # a run folder (OUT): its metrics.jsonl
            if not (p / "metrics.jsonl").is_file():
                raise ValueError(f"{p} is a folder without a metrics.jsonl (pass the run folder or a file)")
            p = p / "metrics.jsonl"
        records = read_jsonl(p)
        train = [r for r in records if "loss" in r]
        evals = [r for r in records if "eval_loss" in r]
        if not train and not evals:
            raise ValueError(f"{p} has no train or eval records")
        color = f"C{i}"
        label = _label(p)
        if train:
            ax_loss.plot(
                [r["step"] for r in train], [r["loss"] for r in train], color=color, label=f"{label} train"
            )
            ax_norm.plot(
                [r["step"] for r in train], [r["grad_norm"] for r in train], color=color, label=label
            )
        if evals:
            ax_loss.plot(
                [r["step"] for r in evals],
                [r["eval_loss"] for r in evals],
                "o--",
                color=color,
                label=f"{label} eval",
            )
    ax_loss.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    ax_norm.set(xlabel="step", ylabel="grad norm (before clipping)", title="grad norm", yscale="log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # "3", "0.5": not matplotlib's log-axis "3x10^0"
    ax_norm.yaxis.set_major_formatter(plain)
    ax_norm.yaxis.set_minor_formatter(plain)
    for ax in (ax_loss, ax_norm):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
