"""The options of ``raggedfsdp bench`` (shared by the subcommand and the worker), their checks, and
the worker's command line. Importing this module imports no torch (``raggedfsdp bench --help``)."""

from __future__ import annotations

import argparse


def build_arg_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench options to ``p`` (shared by the subcommand and the worker)."""
    from raggedfsdp.app.bench.registry import BENCH_MODELS

    p.add_argument("--model", default="moe", choices=sorted(BENCH_MODELS), help="model family (default: moe)")
    p.add_argument("--flavor", default=None, help="named size (default: dense 'small', moe 'moe-small')")
    p.add_argument(
        "--n-layers", dest="n_layers", type=int, default=None, help="override the number of blocks"
    )
    p.add_argument(
        "--experts",
        default=None,
        choices=["separate", "fused"],
        help="MoE expert storage (default: the flavor's, 'separate' for moe-small)",
    )
    p.add_argument(
        "--n-experts", dest="n_experts", type=int, default=None, help="MoE: routed experts per block"
    )
    p.add_argument("--top-k", dest="top_k", type=int, default=None, help="MoE: experts per token")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="MoE: expert-parallel size (experts split over N ranks, all-to-all dispatch, experts "
        "FSDP-sharded over nproc/N, the rest over nproc; both systems; implies --experts fused; default: 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="dense: tensor-parallel degree; both systems get the same TP plan (models.apply_tp) and "
        "shard over the dp = nproc/tp ranks (default: 1)",
    )
    p.add_argument(
        "--wrap", default=None, help="FSDP wrapping policy of the model family (default: its first, 'layer')"
    )
    p.add_argument("--steps", type=int, default=10, help="timed repetitions per system (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system first (default: 2)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default: 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument(
        "--param-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="all-gathered param dtype (default: fp32)",
    )
    p.add_argument(
        "--reduce-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="reduce-scatter dtype (default: fp32)",
    )
    p.add_argument(
        "--all-gather-dtype",
        default="none",
        choices=["none", "fp8_e4m3", "int8"],
        help="raggedfsdp's parameter all-gather: 8-bit codes + fp32 scale per 32x32 block "
        "(QuantizedAllGatherPolicy; torch's fully_shard gathers in --param-dtype); default: none",
    )
    p.add_argument(
        "--reduce-scatter-wire-dtype",
        default="none",
        choices=["none", "bf16"],
        help="raggedfsdp's gradient wire dtype: bf16 pieces over an all-to-all, summed in --reduce-dtype "
        "(set_reduce_scatter_wire_dtype; torch reduce-scatters in --reduce-dtype); default: none",
    )
    p.add_argument(
        "--foreach",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AdamW foreach=True (torch's default on CUDA; on CPU torch defaults to the per-tensor "
        "loop, whose DTensor dispatch costs both systems a third of the step); default: on",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile each block (fullgraph, inductor) before fully_shard, for every system "
        "(raggedfsdp.app.models.apply_compile); default: off",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default: 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL)")
    p.add_argument(
        "--profile", default=None, metavar="DIR", help="also cProfile rank 0; write DIR/<system>.pstats"
    )
    p.add_argument(
        "--profile-steps",
        dest="profile_steps",
        type=int,
        default=3,
        help="steps per system to profile (default: 3)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="process-group timeout in seconds (default: 600)"
    )
    p.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the model without FSDP or communication (each rank its own replica): the "
        "floor of the step time, giving throughput_ceiling and overhead_ratio; default: on",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def validate(args) -> None:
    from raggedfsdp.app.bench.registry import get_bench_model

    for name in ("nproc", "steps", "batch", "seq", "profile_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    spec = get_bench_model(args.model)
    if args.wrap is not None and args.wrap not in spec.wraps:
        raise ValueError(
            f"--wrap {args.wrap!r} is not a policy of model {args.model!r}; choose one of "
            f"{sorted(spec.wraps)}"
        )
    if args.model != "moe" and (args.experts or args.n_experts or args.top_k):
        raise ValueError(f"--experts/--n-experts/--top-k apply to --model moe only, not {args.model!r}")
    if args.ep < 1:
        raise ValueError(f"--ep must be >= 1, got {args.ep}")
    if args.ep > 1:
        if args.model != "moe":
            raise ValueError(f"--ep {args.ep} applies to --model moe only, not {args.model!r}")
        if args.experts == "separate":
            raise ValueError(f"--ep {args.ep} splits fused expert stacks; drop --experts separate")
        if args.nproc % args.ep:
            raise ValueError(
                f"--ep {args.ep} must divide --nproc {args.nproc} (the world is (nproc/ep) x ep)"
            )
        if args.wrap not in (None, "layer"):
            raise ValueError(f"--ep {args.ep} needs --wrap layer (experts get their own unit per block)")
        args.experts = "fused"
        args.floor = False  # the collective replay runs on the whole group: not the EP sub-groups
    if args.reduce_scatter_wire_dtype != "none" and args.ep > 1:
        raise ValueError(
            f"--reduce-scatter-wire-dtype {args.reduce_scatter_wire_dtype} with --ep {args.ep}: the gradient "
            "all-to-all could not be told apart from the token all-to-all in reduce_scatter_wire_bytes; "
            "drop one of them"
        )
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.tp > 1:
        if args.model != "dense" or args.ep > 1:
            raise ValueError(f"--tp {args.tp} applies to --model dense (a llama) without --ep")
        if args.nproc % args.tp:
            raise ValueError(f"--tp {args.tp} must divide --nproc {args.nproc} (the mesh is (nproc/tp) x tp)")
        args.floor = False  # the collective replay runs on the whole group, not the dp sub-groups
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
        if args.nproc > torch.cuda.device_count():
            raise ValueError(f"--nproc {args.nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    args.flavor = args.flavor or spec.default_flavor
    spec.build(argparse.Namespace(**{**vars(args), "flavor": args.flavor}))  # bad flavor/shape: error here
    if args.tp > 1:
        from raggedfsdp.app.models.parallelize import tp_plan_errors

        model = spec.build(argparse.Namespace(**{**vars(args), "flavor": args.flavor}))
        errs = tp_plan_errors(model.cfg, args.tp)
        if errs:
            raise ValueError(f"--tp {args.tp}: " + "; ".join(errs))


def worker_argv(args) -> list[str]:
    """The worker's flags reproducing ``args`` (everything but the launcher's ``--nproc``, ``--out``)."""
    out = []
    for key, val in vars(args).items():
        if key in ("nproc", "out", "func", "command") or val is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key in ("foreach", "floor"):
            out.append(flag if val else f"--no-{key}")
            continue
        if val is False:
            continue
        out += [flag] if val is True else [flag, str(val)]
    return out


WRAP_BENCH_DESCRIPTION = (
    "Choose the FSDP unit by measurement: the same model wrapped two (or more) ways, side by side."
)


def wrap_bench_parser() -> argparse.ArgumentParser:
    """The options of ``raggedfsdp wrap-bench`` (its worker parses them; the subcommand copies them)."""
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp.app.bench.wrap_compare", description=WRAP_BENCH_DESCRIPTION
    )
    p.add_argument("--model", default="hybrid", help="model family (default: hybrid)")
    p.add_argument("--flavor", default="tiny", help="named size (default: tiny)")
    p.add_argument(
        "--wrap", default="layer,superblock", help="comma list of FSDP units (default: layer,superblock)"
    )
    p.add_argument("--steps", type=int, default=6, help="measured steps per unit (default: 6)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up steps per unit (default: 1)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default: 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="compute dtype of the gathered parameters (default: fp32)")  # fmt: skip
    p.add_argument("--backend", default="ragged", choices=["ragged", "torch"],
                   help="whose fully_shard: raggedfsdp's or torch's (default: ragged)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default: 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (gloo) or cuda (NCCL, one GPU per rank) (default: cpu)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p
