"""Metrics: model FLOPs per token against torch's FlopCounterMode on the built-in models, MFU in
the record and the line, peak memory in the line, TensorBoard event files, plot of a run folder."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from raggedfsdp.app.train.metrics import MetricsLogger, format_line, model_flops_per_token


@pytest.mark.parametrize(
    "name,flavor,kw,tol",
    [
        ("llama", "debug", {}, 0.01),
        ("llama", "debug", {"tie_embeddings": True}, 0.01),
        ("hybrid", "debug", {}, 0.05),
    ],
)
def test_flops_per_token_matches_flop_counter(name, flavor, kw, tol):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from raggedfsdp.app.models import build_model

    m = build_model(name, flavor, **kw)
    m.init_weights(0)
    T = 128
    tok = torch.randint(0, 256, (2, T + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:  # math SDPA: counted bmm
        F.cross_entropy(m(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten()).backward()
    c = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    # torch's convolution_backward count ignores groups (depthwise conv): use 2x the forward instead
    measured = c.get("aten.mm", 0) + c.get("aten.bmm", 0) + 3 * c.get("aten.convolution", 0)
    measured /= 2 * T
    assert model_flops_per_token(m.cfg, T) == pytest.approx(measured, rel=tol)


def test_mfu_memory_and_tensorboard(tmp_path):
    log = MetricsLogger(
        tmp_path,
        enabled=True,
        jsonl=True,
        total_steps=10,
        flops_per_token=1e6,
        peak_flops=1e12,
        tensorboard=True,
    )
    rec = {
        "step": 1,
        "loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 3e5,
        "tokens_per_s_per_rank": 1e5,
        "step_time_s": 0.1,
        "peak_memory_bytes": 3 * 2**30,
    }
    log.log(rec)
    log.log({"step": 1, "eval_loss": 2.5, "elapsed_s": 1.0})
    log.close()
    got = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got[0]["mfu"] == pytest.approx(0.1)  # 1e5 tok/s * 1e6 FLOP/tok / 1e12 FLOP/s
    line = format_line(got[0], 10)
    assert "mfu 10.0%" in line and "mem 3.00 GiB" in line
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    tags = ev.Tags()["scalars"]
    assert "train/mfu" in tags and "train/loss" in tags and "eval/eval_loss" in tags
    assert ev.Scalars("train/mfu")[0].value == pytest.approx(0.1)


def test_plot_accepts_run_folder(tmp_path):
    pytest.importorskip("matplotlib")
    from raggedfsdp.app.train.plot import plot_metrics

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0, "grad_norm": 1.0}) + "\n"
    )
    import matplotlib.pyplot as plt

    figs = []
    close = plt.close
    plt.close = lambda fig=None: (figs.append(fig), close(fig))
    try:
        assert plot_metrics([tmp_path / "run"], tmp_path / "p.png").is_file()
    finally:
        plt.close = close
    ax_norm = figs[0].axes[1]  # the log-scale grad norm: plain tick labels (issue 24 rough edge 9)
    for fmt in (ax_norm.yaxis.get_major_formatter(), ax_norm.yaxis.get_minor_formatter()):
        assert [fmt(v, 0) for v in (3.0, 0.5, 10.0)] == ["3", "0.5", "10"]
    with pytest.raises(ValueError, match="without a metrics.jsonl"):
        plot_metrics([tmp_path], tmp_path / "q.png")


def test_line_names_aux_once_rss_eta_and_why_no_mfu(tmp_path):
    """Issue 24 rough edges 5/7: ``aux`` once, ``mem ... rss`` on CPU, an ETA, and a hint when the peak
    FLOP/s is unknown (the reference: the record's own fields)."""
    import io

    rec = {"step": 4, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "aux_loss": 0.0123, "tokens_per_s": 3e5,
           "tokens_per_s_per_rank": 1e5, "step_time_s": 0.5, "peak_memory_bytes": 2**30,
           "peak_memory_source": "rss"}  # fmt: skip
    line = format_line(rec, 250)
    assert line.count("aux 0.0123") == 1, line
    assert "mem 1.00 GiB rss" in line
    assert line.endswith("eta 2m03s"), line  # (250 - 4) steps x 0.5 s = 123 s
    assert "eta" not in format_line(dict(rec, step=250), 250)  # the last step: nothing left
    assert "rss" not in format_line(dict(rec, peak_memory_source="cuda"), 250)
    out = io.StringIO()
    log = MetricsLogger(tmp_path, enabled=True, jsonl=False, total_steps=250, stream=out,
                        flops_per_token=1e6, peak_flops=None)  # fmt: skip
    log.log(rec)
    log.log(dict(rec, step=5))
    text = out.getvalue()
    assert text.count("no mfu column") == 1 and "--job.peak_tflops" in text and "| mfu" not in text
