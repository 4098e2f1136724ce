"""``raggedfsdp estimate-time``: how fast? Predicted step time, MFU and tokens/s of an FSDP run.

Examples::

    raggedfsdp estimate-time --model llama3-8b --cluster h100 --world-size 8 --seq 8192
    raggedfsdp estimate-time --model gpt-oss-120b --cluster h100 --world-size 256 --ep 8 --seq 4096
    raggedfsdp estimate-time --model llama3-70b --cluster h200 --world-size 64 --tp 8 --replicate 2 --json
    raggedfsdp estimate-time --model llama3-8b --cluster b200 --world-size 64 --rank 5
    raggedfsdp estimate-time --calibrate --save cpu.json   # fit this machine from local gloo runs
    raggedfsdp estimate-time --model llama:small --cluster cpu.json --world-size 4 --seq 128 --batch 2 --param-dtype fp32

No GPU needed: the shapes come from the model (a planner table, a built-in model such as
llama:small, or a Hugging Face config.json), the constants from a cluster preset (h100, h200,
b200, cpu; sources in raggedfsdp/app/sizing/clusters.py) or a JSON file written by ``--calibrate``.
On a CPU host (the cpu cluster) the devices are its cores: ranks beyond them time-share, so the
report's step is the elapsed time on an idle machine (the work x ranks / cores).
Ours (the planner's layout, copy-free collectives) is printed next to FSDP2's layout (dim-0
padding, copy-in / copy-out) on the same model and dims. ``--rank N`` lists the N fastest
configurations (unit, granularity, dp_replicate, tp, ep) for the world size.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate-time",
        help="predicted step time / MFU / tokens per second vs FSDP2's layout (no GPU; --calibrate fits "
        "this box)",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", help="planner table (llama3-8b, gpt-oss-120b, ...), built-in (llama:small) or config.json"
    )
    p.add_argument(
        "--cluster", default="h100", help="h100 | h200 | b200 | cpu, or a JSON file from --calibrate"
    )
    p.add_argument("--world-size", "-m", type=int, help="ranks in all (dp_replicate x dp_shard x tp)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replica groups (default: 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree, inside dp_shard (default: 1)")
    p.add_argument(
        "--batch", type=int, default=1, help="sequences per data-parallel rank per step (default: 1)"
    )
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument(
        "--unit", default="layer", help="FSDP unit: layer | superblock | layers:K (default: layer)"
    )
    p.add_argument(
        "--granularity",
        default="element",
        help="planner block for matrices (default element, as fully_shard's): element | row | rows:K | ...",
    )
    p.add_argument(
        "--param-dtype", default="bf16", choices=["bf16", "fp32"], help="all-gathered dtype (default: bf16)"
    )
    p.add_argument(
        "--reduce-dtype",
        default="fp32",
        choices=["bf16", "fp32"],
        help="reduce-scatter dtype (default: fp32)",
    )
    p.add_argument(
        "--all-gather-dtype",
        default="none",
        choices=["none", "fp8_e4m3", "int8"],
        help="raggedfsdp's quantized parameter all-gather (8-bit codes + fp32 scale per 32x32 block): "
        "the estimate and the all-gather bytes it saves per step (default: none)",
    )
    p.add_argument("--ac", action="store_true", help="activation checkpointing (one more forward)")
    p.add_argument("--optim", default="adamw", choices=["adamw", "muon"], help="optimizer (default: adamw)")
    p.add_argument("--rank", type=int, default=0, metavar="N", help="also list the N fastest configurations")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="time local gloo runs (built-in dense and MoE at 1 and 2 ranks, one launch; a rank's CPU "
        "seconds) and fit the cpu cluster, this machine's cores as its devices",
    )
    p.add_argument("--save", default=None, metavar="FILE", help="with --calibrate: write the fitted cluster")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def _error(msg: str) -> int:
    print(f"raggedfsdp estimate-time: error: {msg}", file=sys.stderr)
    return 2


def resolve_model(name: str, unit: str):
    """``(units, cfg)`` for ``--model`` through the one sizing resolver (``sizing.registry.resolve``):
    a preset, a planner table, a built-in ``name:flavor`` or a ``config.json``."""
    from raggedfsdp.app.sizing.registry import resolve
    from raggedfsdp.app.sizing.steptime import builtin_cfg

    src = resolve(name)
    units = src.units(unit)
    if src.config is not None:
        return units, src.config
    return units[-1:] + units[:-1], builtin_cfg(src.family, src.flavor)  # the root unit gathers first


def _load_cluster(text: str):
    from raggedfsdp.app.sizing.steptime import CLUSTERS, Cluster

    if text in CLUSTERS:
        return CLUSTERS[text]
    try:
        with open(text) as f:
            return Cluster(**json.load(f))
    except FileNotFoundError:
        raise ValueError(f"--cluster {text!r}: not one of {sorted(CLUSTERS)} and no such file") from None
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"--cluster {text!r}: not a cluster JSON written by --calibrate ({e})") from None


CALIBRATION_MODELS = ("llama:small", "moe:moe-small")
"""The built-in dense and MoE models ``--calibrate`` measures (batch 2 x seq 128, fp32, AdamW)."""


def samples_from_rows(rows: list[dict]) -> list[dict]:
    """:func:`raggedfsdp.app.sizing.steptime_search.calibrate` samples from ``measure_steps`` rows: a rank's
    CPU seconds in its fastest step (``cpu_min_s``) and in its fastest optimizer step. The fastest,
    not the median: other jobs on the machine only ever add to a step (evicted caches, a shared core),
    so the least disturbed step is the best estimate of the work (at a load average of ~18 on 2 cores
    the median's predictions of 3-4 ranks were 8-18 % high, the fastest's within 5 %)."""
    from raggedfsdp.app.sizing.steptime import Parallel

    models = {}
    out = []
    for r in rows:
        if r["model"] not in models:
            models[r["model"]] = resolve_model(r["model"], "layer")
        units, cfg = models[r["model"]]
        out.append(
            {
                "units": units,
                "cfg": cfg,
                "parallel": Parallel(r["world_size"]),
                "batch": r.get("batch", 2),
                "seq_len": r.get("seq", 128),
                "measured_s": r["cpu_min_s"],
                "measured_opt_s": r.get("cpu_opt_min_s"),
                "param_bytes": 4,
                "reduce_bytes": 4,
            }
        )
    return out


def fit_rows(rows: list[dict]):
    """The ``cpu`` preset with this machine's core count, fitted to ``measure_steps`` rows."""
    import os
    from dataclasses import replace

    from raggedfsdp.app.sizing.steptime import CLUSTERS
    from raggedfsdp.app.sizing.steptime_search import calibrate

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return calibrate(samples_from_rows(rows), replace(CLUSTERS["cpu"], devices_per_node=cores))


def calibrate_here(out=sys.stderr, world_sizes=(1, 2)):
    """Measure the built-in dense and MoE steps at ``world_sizes`` gloo ranks (one torchrun launch,
    ``bench/steptime.py``) and fit the ``cpu`` preset; returns ``(cluster, rows)``."""
    from raggedfsdp.app.bench.steptime import measure_steps

    rows = measure_steps(list(CALIBRATION_MODELS), list(world_sizes), batch=2, seq=128)
    for r in rows:
        print(
            f"measured {r['model']} on {r['world_size']} rank(s): {r['cpu_min_s'] * 1e3:.1f} ms CPU per step "
            f"(fastest of {len(r['cpu_steps'])}; {r['cpu_opt_min_s'] * 1e3:.1f} ms in the optimizer), "
            f"{r['wall_s'] * 1e3:.1f} ms elapsed",
            file=out,
            flush=True,
        )
    return fit_rows(rows), rows


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from raggedfsdp.app.sizing.steptime import Parallel, estimate_time
    from raggedfsdp.app.sizing.steptime_search import format_time_report, rank_configs

    if args.calibrate:
        cluster, _ = calibrate_here()
        if args.save:
            with open(args.save, "w") as f:
                json.dump(asdict(cluster), f, indent=1)
        print(
            json.dumps(asdict(cluster), indent=1)
            if args.json
            else f"fitted: {cluster.peak_flops / 1e9:.3g} GFLOP/s per rank, optimizer "
            f"{cluster.hbm_bw / 1e9:.3g} GB/s, "
            f"network {cluster.intra_bw / 1e9:.3g} GB/s, {cluster.intra_lat * 1e6:.1f} us per ring step, "
            f"host "
            f"{cluster.host_s_per_unit * 1e6:.0f} us per unit + {cluster.host_s_per_tensor * 1e6:.0f} us per "
            f"tensor, {cluster.devices_per_node} cores" + (f"; written to {args.save}" if args.save else "")
        )
        if not args.model:
            return 0
        args.cluster = args.save or args.cluster
    if not args.model or args.world_size is None:
        return _error("give --model and --world-size (or --calibrate alone)")
    if args.world_size < 1:  # 0 used to read as "not given"
        return _error(f"--world-size {args.world_size}: must be >= 1 (ranks in all), e.g. --world-size 8")
    try:
        cluster = _load_cluster(args.cluster)
        units, cfg = resolve_model(args.model, args.unit)
        m = args.world_size // (args.replicate * args.tp) if args.world_size else 0
        if m < 1 or m * args.replicate * args.tp != args.world_size:
            raise ValueError(
                f"--world-size {args.world_size} must equal --replicate x dp_shard x --tp "
                f"({args.replicate} x ? x {args.tp}); choose dims whose product is the world size"
            )
        par = Parallel(m, args.replicate, args.tp, args.ep)
        pb = 2 if args.param_dtype == "bf16" else 4
        rb = 2 if args.reduce_dtype == "bf16" else 4
        kw = {
            "cluster": cluster,
            "parallel": par,
            "batch": args.batch,
            "seq_len": args.seq,
            "param_bytes": pb,
            "reduce_bytes": rb,
            "activation_checkpointing": args.ac,
            "optimizer": args.optim,
        }
        ours = estimate_time(
            units, cfg, policy=args.granularity, all_gather_dtype=args.all_gather_dtype, **kw
        )
        plain = ours  # --all-gather-dtype: the same layout gathered in param_dtype, for the bytes it saves
        if args.all_gather_dtype != "none":
            plain = estimate_time(units, cfg, policy=args.granularity, **kw)
        fsdp2 = estimate_time(units, cfg, layout="fsdp2", **kw)
        ranked = []
        if args.rank:
            kw2 = {k: v for k, v in kw.items() if k not in ("parallel", "batch", "seq_len", "cluster")}
            ranked = rank_configs(
                {args.unit: units},
                cfg,
                cluster=cluster,
                world=args.world_size,
                batch=args.batch,
                seq_len=args.seq,
                **kw2,
            )[: args.rank]
    except ValueError as e:
        return _error(str(e))
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "cluster": cluster.name,
                    "parallel": asdict(par),
                    "batch": args.batch,
                    "seq": args.seq,
                    "raggedfsdp": ours.to_dict(),
                    "fsdp2": fsdp2.to_dict(),
                    "speedup_vs_fsdp2": fsdp2.step_s / ours.step_s,
                    "all_gather_dtype": args.all_gather_dtype,
                    "ag_wire_bytes_unquantized": plain.ag_wire_bytes,
                    "ag_wire_bytes_saved": plain.ag_wire_bytes - ours.ag_wire_bytes,
                    "ranked": [{"config": c, "step_s": s.step_s, "mfu": s.mfu} for c, s in ranked],
                }
            )
        )
        return 0
    print(
        format_time_report(
            ours,
            fsdp2,
            label=f"{args.model} on {args.world_size} x {cluster.name} "
            f"(dp_shard {m}, replicate {args.replicate}, tp {args.tp}, ep {args.ep}), "
            f"batch {args.batch} x seq {args.seq}",
        )
    )
    if args.all_gather_dtype != "none":
        saved = plain.ag_wire_bytes - ours.ag_wire_bytes
        print(
            f"all-gather {args.all_gather_dtype}: {ours.ag_wire_bytes / 1e9:.3f} GB per rank per pass of all "
            f"units vs {plain.ag_wire_bytes / 1e9:.3f} GB in {args.param_dtype} (saves {saved / 1e9:.3f} GB, "
            f"x{ours.ag_wire_bytes / max(plain.ag_wire_bytes, 1):.3f}); all-gather time "
            f"{ours.ag_s * 1e3:.2f} ms vs {plain.ag_s * 1e3:.2f} ms, step {ours.step_s * 1e3:.2f} ms vs "
            f"{plain.step_s * 1e3:.2f} ms"
        )
    for i, (c, s) in enumerate(ranked, 1):
        print(f"#{i}: {c}  step {s.step_s * 1e3:.1f} ms  MFU {s.mfu:.1%}")
    return 0
