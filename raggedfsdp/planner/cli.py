"""``raggedfsdp plan``: plan a whole model's FSDP units from its architecture, without allocating it.

Examples::

    raggedfsdp plan --model llama3-70b --world-size 1024 --granularity rows:32
    raggedfsdp plan --model deepseek-v3-671b --world-size 256 --order best --json > plan.json
    raggedfsdp plan --model path/to/config.json --world-size 64
    raggedfsdp plan --model hybrid-27b --world-size 512 --unit superblock

Sizes are elements. ``--align`` defaults to 8 elements: 16 bytes of bf16 and 32 bytes of fp32,
so every shard offset ``k*S`` of a bf16 or fp32 buffer is 16-byte aligned (paper-notes section 7.1).
The text report groups runs of identical units; ``--json`` prints one object with every unit and
tensor (name, shape, granularity, offset, dims), enough to re-validate the plan from the output.
"""

from __future__ import annotations

import argparse
import json
import sys

from raggedfsdp.planner.archs import BUILTIN, load_config, model_units
from raggedfsdp.planner.modelplan import BlockError, ModelPlan, gcd_fallback, plan_model
from raggedfsdp.planner.planner import ORDERS
from raggedfsdp.planner.policy import BlockSpec

DEFAULT_ALIGN = 8


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``subparsers``; sets ``func(args) -> int``."""
    p = subparsers.add_parser(
        "plan",
        help="plan a model's FSDP buffers (padding, shard sizes) from shapes only",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"built-in table ({', '.join(BUILTIN)}), a Hugging Face config.json, or a folder with one",
    )
    p.add_argument(
        "--world-size", "-m", type=int, required=True, help="FSDP group size M (ranks per shard group)"
    )
    p.add_argument(
        "--granularity",
        default="row",
        help="block for matrices: element | row | rows:K | tile:RxC | slice | matrix (vectors: element)",
    )
    p.add_argument("--unit", default="layer", help="layer | superblock (hybrid models) | layers:K")
    p.add_argument(
        "--order", default="default", choices=(*ORDERS, "best"), help="tensor order (default: module order)"
    )
    p.add_argument(
        "--align",
        type=int,
        default=DEFAULT_ALIGN,
        help=f"shard size multiple in elements (default {DEFAULT_ALIGN} = 16 B of bf16)",
    )
    p.add_argument(
        "--on-indivisible",
        choices=("error", "gcd"),
        default="error",
        help="a rows:K/tile block that does not tile a tensor: raise (default) or use gcd(K, rows) rows",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with every unit and tensor")
    p.set_defaults(func=run)
    return p


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def _ratio(pad: int, numel: int) -> str:
    return _pct(pad / (numel + pad) if numel + pad else 0.0)


def _text_report(args, plan: ModelPlan) -> str:
    m = plan.world_size
    header = (
        f"{'unit':<24} {'tensors':>7} {'shard_size':>12} {'padding':>9} {'bound':>9} {'FSDP2':>9} "
        f"{'FSDP2+blk':>9}"
    )
    lines = [
        (
            f"model {args.model}: {plan.numel / 1e9:.2f}B params in {len(plan.units)} units "
            f"({plan.distinct_units} distinct); M={m}, granularity {args.granularity}, unit {args.unit}, "
            f"order {args.order}, align {plan.align}"
        ),
        header,
    ]
    i = 0
    units = plan.units
    while i < len(units):
        j = i
        sig = (units[i].layout.numels, units[i].layout.granularities)
        while j + 1 < len(units) and (units[j + 1].layout.numels, units[j + 1].layout.granularities) == sig:
            j += 1
        u = units[i]
        lay = u.layout
        name = u.name if i == j else f"{u.name} .. {units[j].name} (x{j - i + 1})"
        tot = lay.total_numel
        lines.append(
            f"{name:<24} {len(lay.numels):>7} {lay.shard_size:>12} {_pct(lay.padding_ratio):>9} "
            f"{_ratio(m * u.bound_shard_size - tot, tot):>9} {_ratio(u.fsdp2_padding, tot):>9} "
            f"{_ratio(u.fsdp2_block_padding, tot):>9}"
        )
        i = j + 1
    lines.append(
        f"total padding {_pct(plan.padding_ratio)} (order-free bound {_pct(plan.bound_padding_ratio)}); "
        f"FSDP2 {_pct(plan.fsdp2_padding_ratio)}, "
        f"FSDP2 keeping blocks {_pct(plan.fsdp2_block_padding_ratio)}, "
        f"FSDP1/flat {_pct(plan.fsdp1_padding_ratio)}; worst unit {_pct(plan.max_unit_padding_ratio)}; "
        f"planning {plan.plan_seconds:.3f} s"
    )
    return "\n".join(lines)


def _error(msg: str) -> int:
    print(f"raggedfsdp plan: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns 0, or 2 with one line on stderr (naming the argument) for bad input."""
    if args.world_size < 1:
        return _error(f"--world-size {args.world_size}: the FSDP group size must be >= 1")
    try:
        cfg = load_config(args.model)
    except ValueError as exc:
        return _error(f"--model: {exc}")
    try:
        spec = BlockSpec.parse(args.granularity)
    except ValueError as exc:
        return _error(f"--granularity: {exc}")
    try:
        units = model_units(cfg, args.unit)
    except ValueError as exc:
        arg = f"--unit {args.unit}" if "unit=" in str(exc) else f"--model {args.model}"
        return _error(f"{arg}: {exc}")
    except (KeyError, TypeError, AttributeError) as exc:  # a config.json with unexpected values
        return _error(
            f"--model: {args.model!r} is not a supported Hugging Face config "
            f"({type(exc).__name__}: {exc}); see raggedfsdp.planner.archs for the supported model types"
        )
    try:
        policy = gcd_fallback(spec) if args.on_indivisible == "gcd" else spec
        plan = plan_model(units, args.world_size, policy=policy, align=args.align, order=args.order)
    except BlockError as exc:
        fix = "use a --granularity that fits every tensor (e.g. row)"
        if exc.block.kind in ("rows", "tile") and args.on_indivisible == "error":
            fix = (
                f"add --on-indivisible gcd to shrink the block to gcd({exc.block.rows}, rows) rows on such "
                f"tensors, or use a --granularity whose row count divides every tensor's (e.g. row)"
            )
        return _error(f"--granularity {args.granularity}: {exc}; {fix}")
    except ValueError as exc:
        return _error(str(exc))
    if args.json:
        d = plan.to_dict()
        d.update(model=args.model, granularity=args.granularity, unit=args.unit)
        text = json.dumps(d, separators=(",", ":"))
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except BrokenPipeError:  # e.g. piped into `head`
            return 0
    else:
        print(_text_report(args, plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raggedfsdp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
