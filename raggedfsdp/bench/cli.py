"""``raggedfsdp bench``: raggedfsdp.fully_shard vs torch's fully_shard, same model, data and seed, one run.

``raggedfsdp bench --model dense|moe [--experts separate|fused] --nproc N --steps K
[--param-dtype fp32|bf16] [--json]`` launches N ranks with torchrun (``--standalone``) running
``raggedfsdp.bench.worker`` (see its docstring for the phases and what is measured). Rank 0 prints a
table of both systems with ratios, or with ``--json`` one JSON object::

    {"throughput_ratio": torch step time / raggedfsdp step time (> 1: raggedfsdp faster),
     "cpu_time_ratio": the same for the CPU seconds a rank spends per step (robust on a loaded machine),
     "peak_memory_ratio": raggedfsdp peak / torch peak (max over ranks; < 1: raggedfsdp smaller),
     "raggedfsdp": {"step_seconds_median", "copy_bytes", "padding_bytes", "collectives",
                    "collective_bytes", "host_syncs", "peak_memory_bytes", "final_loss", ...},
     "torch": {... the same keys ...}, "model", "nproc", "torch_version", ...,
     with --floor (default): "local_floor": {"step_seconds_median", ...} (no FSDP, no communication),
     "throughput_ceiling": torch step / floor step (the best ratio any FSDP could reach here),
     "overhead_seconds": {"raggedfsdp", "torch"} (step - floor), "overhead_ratio": torch's / ours}

Progress lines go to stderr. Exit code 2 for a bad argument (checked before the launch).
"""

from __future__ import annotations

import argparse
import os
import sys

_EPILOG = """\
examples:
  raggedfsdp bench --model moe --nproc 4 --json                 # 16 separate experts per block
  raggedfsdp bench --model moe --experts fused --param-dtype bf16
  raggedfsdp bench --model dense --nproc 4 --steps 10
  raggedfsdp bench --model moe --nproc 4 --profile outputs/prof  # + cProfile of rank 0 per system
  raggedfsdp bench --model moe --device cuda --nproc 1           # GPU: NCCL, CUDA allocator peak
"""


def build_arg_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench options to ``p`` (shared by the subcommand and the worker)."""
    from raggedfsdp.bench.registry import BENCH_MODELS

    p.add_argument("--model", default="moe", choices=sorted(BENCH_MODELS), help="model family (default: moe)")
    p.add_argument("--flavor", default=None, help="named size (default: dense 'small', moe 'moe-small')")
    p.add_argument("--n-layers", dest="n_layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--experts", default=None, choices=["separate", "fused"],
                   help="MoE expert storage (default: the flavor's, 'separate' for moe-small)")
    p.add_argument("--n-experts", dest="n_experts", type=int, default=None, help="MoE: routed experts per block")
    p.add_argument("--top-k", dest="top_k", type=int, default=None, help="MoE: experts per token")
    p.add_argument("--wrap", default=None, help="FSDP wrapping policy of the model family (default: its first, 'layer')")
    p.add_argument("--steps", type=int, default=10, help="timed repetitions per system (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system first (default: 2)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default: 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"], help="all-gathered param dtype")
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"], help="reduce-scatter dtype")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True,
                   help="AdamW foreach=True (torch's default on CUDA; on CPU torch defaults to the per-tensor "
                        "loop, whose DTensor dispatch costs both systems a third of the step); default: on")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default: 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--profile", default=None, metavar="DIR", help="also cProfile rank 0; write DIR/<system>.pstats")
    p.add_argument("--profile-steps", dest="profile_steps", type=int, default=3, help="steps per system to profile")
    p.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the model without FSDP or communication (each rank its own replica): the "
                        "floor of the step time, giving throughput_ceiling and overhead_ratio; default: on")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``bench`` subcommand."""
    p = sub.add_parser(
        "bench",
        help="benchmark raggedfsdp.fully_shard against torch's fully_shard (same run, alternated steps)",
        description=__doc__.split("\n\n")[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=4, metavar="N", help="ranks to launch (default: 4)")
    build_arg_parser(p)
    p.set_defaults(func=run_bench)


def _validate(args) -> None:
    from raggedfsdp.bench.registry import get_bench_model

    for name in ("nproc", "steps", "batch", "seq", "profile_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    spec = get_bench_model(args.model)
    if args.wrap is not None and args.wrap not in spec.wraps:
        raise ValueError(f"--wrap {args.wrap!r} is not a policy of model {args.model!r}; choose one of {sorted(spec.wraps)}")
    if args.model != "moe" and (args.experts or args.n_experts or args.top_k):
        raise ValueError(f"--experts/--n-experts/--top-k apply to --model moe only, not {args.model!r}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
        if args.nproc > torch.cuda.device_count():
            raise ValueError(f"--nproc {args.nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    args.flavor = args.flavor or spec.default_flavor
    spec.build(argparse.Namespace(**{**vars(args), "flavor": args.flavor}))  # bad flavor/shape: error here


def worker_argv(args) -> list[str]:
    """The worker's flags reproducing ``args`` (everything but ``--nproc``)."""
    out = []
    for key, val in vars(args).items():
        if key in ("nproc", "func", "command") or val is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key in ("foreach", "floor"):
            out.append(flag if val else f"--no-{key}")
            continue
        if val is False:
            continue
        out += [flag] if val is True else [flag, str(val)]
    return out


def run_bench(args: argparse.Namespace) -> int:
    try:
        _validate(args)
    except ValueError as e:
        print(f"raggedfsdp bench: error: {e}", file=sys.stderr)
        return 2
    if "OMP_NUM_THREADS" not in os.environ:
        from raggedfsdp.train.worker import _available_cpus

        os.environ["OMP_NUM_THREADS"] = str(max(1, _available_cpus() // args.nproc))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not args.quiet:
        print(f"raggedfsdp bench: launching {args.nproc} rank(s) (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}): "
              f"model {args.model}/{args.flavor}, {args.steps} alternated steps per system",
              file=sys.stderr, flush=True)
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={args.nproc}", "--module",
                        "raggedfsdp.bench.worker", *worker_argv(args)]))
    except ChildFailedError as e:
        from raggedfsdp.train.cli import failure_report

        summary, last_line = failure_report(e, args.nproc)
        print(f"raggedfsdp bench: the {args.nproc}-rank run failed\n{summary}\n{last_line}", file=sys.stderr)
        return 1
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:9.2f} MiB"


def _fb(r: dict) -> str:
    return f"{r['forward_peak_bytes'] / 2**20:.1f} / {r['backward_peak_bytes'] / 2**20:.1f}"


def format_report(r: dict) -> str:
    """A human-readable table of a bench result (the ``--json`` object)."""
    a, b = r["raggedfsdp"], r["torch"]
    lines = [
        f"model {r['model']}/{r['flavor']} experts={r['experts']} wrap={r['wrap']} params={r['num_params']:,} | "
        f"{r['nproc']} ranks on {r['device']} ({r['threads_per_rank']} threads each), torch {r['torch_version']} | "
        f"batch/rank {r['batch_per_rank']} x seq {r['seq']}, param {r['param_dtype']} reduce {r['reduce_dtype']}, "
        f"{r['steps']} alternated steps after {r['warmup']} warm-up",
        f"{'':22s}{'raggedfsdp':>16s}{'torch':>16s}   ratio",
        f"{'step time median':22s}{a['step_seconds_median'] * 1e3:13.1f} ms{b['step_seconds_median'] * 1e3:13.1f} ms"
        f"   throughput x{r['throughput_ratio']:.3f}",
        f"{'CPU time / step / rank':22s}{a['cpu_seconds_median'] * 1e3:13.1f} ms{b['cpu_seconds_median'] * 1e3:13.1f} ms"
        f"   x{r['cpu_time_ratio']:.3f}",
        f"{'peak memory (max rank)':22s}{_mib(a['peak_memory_bytes']):>16s}{_mib(b['peak_memory_bytes']):>16s}"
        f"   x{r['peak_memory_ratio']:.3f}",
        f"{'  peak fwd / bwd (MiB)':22s}{_fb(a):>16s}{_fb(b):>16s}   (bwd: above the end of forward)",
        f"{'copy bytes / step':22s}{a['copy_bytes']:16,d}{b['copy_bytes']:16,d}",
        f"{'collectives / step':22s}{a['collectives']:16d}{b['collectives']:16d}",
        f"{'collective bytes/step':22s}{a['collective_bytes']:16,d}{b['collective_bytes']:16,d}",
        f"{'padding bytes':22s}{a['padding_bytes']:16,d}{b['padding_bytes']:16,d}",
        f"{'host syncs / step':22s}{a['host_syncs']:16d}{b['host_syncs']:16d}",
        f"{'final loss':22s}{a['final_loss']:16.6f}{b['final_loss']:16.6f}   |diff| {r['final_loss_abs_diff']:.2e}",
    ]
    if "local_floor" in r:
        f = r["local_floor"]["step_seconds_median"]
        o = r["overhead_seconds"]
        lines += [
            f"{'floor: no FSDP, no comm':22s}{f * 1e3:13.1f} ms   best possible throughput ratio x{r['throughput_ceiling']:.3f}",
            f"{'FSDP overhead / step':22s}{o['raggedfsdp'] * 1e3:13.1f} ms{o['torch'] * 1e3:13.1f} ms"
            f"   torch / raggedfsdp x{r['overhead_ratio']:.3f}",
            f"{'  of it: collectives':22s}{a['comm_only_seconds'] * 1e3:13.1f} ms{b['comm_only_seconds'] * 1e3:13.1f} ms"
            "   (the step's collectives replayed alone)",
            f"{'  the rest':22s}{r['non_comm_overhead_seconds']['raggedfsdp'] * 1e3:13.1f} ms"
            f"{r['non_comm_overhead_seconds']['torch'] * 1e3:13.1f} ms   (hooks, copies, grad traffic, exposed waits)",
        ]
    return "\n".join(lines)
