"""Using the step-time model of :mod:`raggedfsdp.app.sizing.steptime`: search, fit, report.

* :func:`rank_configs`: every (unit, granularity, dp_replicate, tp, ep) at a world size, fastest first;
* :func:`calibrate`: fit a cluster's compute / network / host constants to measured steps
  (``raggedfsdp estimate-time --calibrate``; the measurer is ``bench/steptime.py``);
* :func:`format_time_report`: ours vs FSDP2's layout, side by side.

Pure arithmetic, nothing allocated. Units: seconds, bytes, FLOP/s.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from raggedfsdp.app.sizing.clusters import Cluster
from raggedfsdp.app.sizing.steptime import Parallel, StepTime, _n_experts, estimate_time

__all__ = ["calibrate", "format_time_report", "rank_configs"]


def rank_configs(
    units_by_unit: dict[str, Sequence[Any]],
    cfg: dict,
    *,
    cluster,
    world: int,
    batch: int,
    seq_len: int,
    fits=None,
    **kw,
) -> list[tuple[dict[str, Any], StepTime]]:
    """Every (unit, granularity, dp_replicate, tp, ep) with ``world`` ranks, fastest first (ours).

    ``units_by_unit`` maps a unit vocabulary word (``layer``, ``layers:2``, ...) to its units;
    ``fits(config) -> bool`` may drop configurations that do not fit in memory.
    """
    E = _n_experts(cfg)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    rows = []
    for unit, units in units_by_unit.items():
        for gran in ("row", "element"):
            for tp in (1, 2, 4, 8):
                if world % tp or heads % tp or kv % tp and kv >= tp:
                    continue
                for rep in [r for r in (1, 2, 4, 8, 16) if (world // tp) % r == 0]:
                    m = world // tp // rep
                    for ep in [
                        e for e in (1, 2, 4, 8, 16, 32) if m % e == 0 and (e == 1 or (E and E % e == 0))
                    ]:
                        conf = {
                            "unit": unit,
                            "granularity": gran,
                            "dp_shard": m,
                            "dp_replicate": rep,
                            "tp": tp,
                            "ep": ep,
                        }
                        if fits is not None and not fits(conf):
                            continue
                        st = estimate_time(
                            units,
                            cfg,
                            cluster=cluster,
                            parallel=Parallel(m, rep, tp, ep),
                            batch=batch * tp,
                            seq_len=seq_len,
                            policy=gran,
                            **kw,
                        )
                        rows.append((conf, st))
    rows.sort(key=lambda r: r[1].step_s)
    return rows


FIT_CONSTANTS = ("peak_flops", "hbm_bw", "intra_bw", "intra_lat", "host_s_per_unit", "host_s_per_tensor")
"""The :class:`Cluster` fields :func:`calibrate` fits (``mfu`` is set to 1: ``peak_flops`` is the speed)."""
_INVERSE = ("peak_flops", "hbm_bw", "intra_bw")  # the step time is linear in 1 / these


def calibrate(samples: Sequence[dict[str, Any]], base: Cluster) -> Cluster:
    """Fit ``base``'s compute speed, optimizer memory speed, collective bandwidth / latency and host
    costs (:data:`FIT_CONSTANTS`) to measured steps.

    ``samples``: dicts with ``units``, ``cfg``, ``parallel``, ``batch``, ``seq_len``, ``measured_s``
    (one rank's busy seconds per step, compared with :attr:`StepTime.work_s`: on a ``shared_host``
    its CPU seconds, which neither time-sharing nor other jobs inflate much), optionally
    ``measured_opt_s`` (the optimizer step's share, compared with ``optim_s``: it pins ``hbm_bw``
    apart from the collectives), ``layout``, ``param_bytes``, ``reduce_bytes``, ``optimizer``.
    A coarse-to-fine search, one constant at a time (log-spaced factors, then refined; 5 rounds),
    minimising the sum of squared relative errors; deterministic. Constants that the samples cannot
    tell apart (compute vs host cost at one batch size) keep a split the search finds first; their
    sum per sample is what is fitted. Returns the fitted cluster (``source`` says on how many samples).

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("calibrate: need at least one measured sample")

    def predict(s, cl: Cluster) -> tuple[float, float]:
        p = estimate_time(
            s["units"],
            s["cfg"],
            cluster=replace(cl, inter_bw=cl.intra_bw, inter_lat=cl.intra_lat),
            parallel=s["parallel"],
            batch=s["batch"],
            seq_len=s["seq_len"],
            layout=s.get("layout", "ours"),
            param_bytes=s.get("param_bytes", 4),
            reduce_bytes=s.get("reduce_bytes", 4),
            optimizer=s.get("optimizer", "adamw"),
        )
        return p.work_s, p.optim_s

    if not base.overlap:
        # nothing overlaps: work_s and optim_s are sums of terms each linear in one of 1/peak_flops,
        # 1/hbm_bw, 1/intra_bw, intra_lat, host_s_per_unit, host_s_per_tensor: take each term's
        # coefficient once (one estimate with that constant at 1, the others off), then every
        # candidate of the search is a dot product (the same numbers as estimate_time, exactly)
        off = replace(
            base, mfu=1.0, peak_flops=math.inf, hbm_bw=math.inf, intra_bw=math.inf, intra_lat=0.0,
            host_s_per_unit=0.0, host_s_per_tensor=0.0,
        )  # fmt: skip
        coefs = [[predict(s, replace(off, **{n: 1.0})) for n in FIT_CONSTANTS] for s in samples]

        def theta(cl: Cluster) -> list[float]:
            return [1 / v if n in _INVERSE else v for n, v in ((n, getattr(cl, n)) for n in FIT_CONSTANTS)]

        def err(cl: Cluster) -> float:
            th, e = theta(cl), 0.0
            for s, cs in zip(samples, coefs):
                work = sum(c[0] * t for c, t in zip(cs, th))
                opt = sum(c[1] * t for c, t in zip(cs, th))
                e += ((work - s["measured_s"]) / s["measured_s"]) ** 2
                if s.get("measured_opt_s"):
                    e += ((opt - s["measured_opt_s"]) / s["measured_opt_s"]) ** 2
            return e

    else:

        def err(cl: Cluster) -> float:
            e = 0.0
            for s in samples:
                work, opt = predict(s, cl)
                e += ((work - s["measured_s"]) / s["measured_s"]) ** 2
                if s.get("measured_opt_s"):
                    e += ((opt - s["measured_opt_s"]) / s["measured_opt_s"]) ** 2
            return e

    cur = replace(base, mfu=1.0)
    span = 100.0
    for _ in range(5):
        for name in FIT_CONSTANTS:
            v0 = getattr(cur, name)
            if v0 <= 0:
                raise ValueError(f"calibrate: base.{name}={v0!r} must be > 0 to be fitted (a start value)")
            best = (err(cur), v0)
            for f in [span ** (k / 6) for k in range(-6, 7)]:
                cand = replace(cur, **{name: v0 * f})
                e = err(cand)
                if e < best[0]:
                    best = (e, v0 * f)
            cur = replace(cur, **{name: best[1]})
        span = span**0.5
    return replace(
        cur,
        inter_bw=cur.intra_bw,
        inter_lat=cur.intra_lat,
        source=f"calibrated on {len(samples)} measured steps from {base.name}",
    )


def format_time_report(ours: StepTime, fsdp2: StepTime, *, label: str = "") -> str:
    """A short table: ours vs FSDP2's layout, milliseconds and ratios."""
    rows = [
        ("step", "step_s"),
        ("compute", "compute_s"),
        ("exposed comm+copy+host", "exposed_comm_s"),
        ("all-gather (total)", "ag_s"),
        ("reduce-scatter (total)", "rs_s"),
        ("HSDP all-reduce", "ar_s"),
        ("TP/EP collectives", "tp_ep_s"),
        ("copies", "copy_s"),
        ("optimizer", "optim_s"),
        ("host", "host_s"),
    ]
    out = [label] if label else []
    out.append(f"{'':26s}{'ours':>12s}{'fsdp2':>12s}")
    for text, key in rows:
        out.append(f"{text:26s}{getattr(ours, key) * 1e3:10.2f}ms{getattr(fsdp2, key) * 1e3:10.2f}ms")
    if ours.work_s != ours.step_s:  # a shared CPU host with more ranks than cores
        out.append(
            f"{'work per rank (CPU)':26s}{ours.work_s * 1e3:10.2f}ms{fsdp2.work_s * 1e3:10.2f}ms"
            "  (ranks time-share the cores)"
        )
    # whole tokens with thousands separators (as the train log's tok/s): .4g printed 7.4e+04 next to 7.316e+04
    out.append(f"{'tokens/s':26s}{ours.tokens_per_s:12,.0f}{fsdp2.tokens_per_s:12,.0f}")
    out.append(f"{'MFU':26s}{ours.mfu:12.1%}{fsdp2.mfu:12.1%}")
    out.append(
        f"{'all-gather buffer':26s}{ours.allgather_bytes / 1e9:10.3f}GB{fsdp2.allgather_bytes / 1e9:10.3f}GB"
    )
    out.append(f"speed-up vs fsdp2 layout: {fsdp2.step_s / ours.step_s:.3f}x")
    return "\n".join(out)
