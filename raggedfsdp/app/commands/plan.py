"""``raggedfsdp plan``: plan a whole model's FSDP units from its architecture, without allocating it.

Examples::

    raggedfsdp plan --model llama3-70b --world-size 1024 --granularity rows:32
    raggedfsdp plan --model deepseek-v3-671b --world-size 256 --order best --json > plan.json
    raggedfsdp plan --model path/to/config.json --world-size 64
    raggedfsdp plan --model hybrid-27b --world-size 512 --unit superblock
    raggedfsdp plan --model llama3-70b --world-size 10240 --unit auto [--padding-target 0.03]
    raggedfsdp plan --model gpt-oss-120b --world-size 256 --ep 8
    raggedfsdp plan --model llama3-70b --world-size 1024 --tp 8

Sizes are elements. ``--align`` defaults to 8 elements: 16 bytes of bf16 and 32 bytes of fp32,
so every shard offset ``k*S`` of a bf16 or fp32 buffer is 16-byte aligned (paper-notes section 7.1).
``--unit auto`` picks the fewest layers per unit (super-blocks for hybrids) whose whole-model
padding is within ``--padding-target`` (embedding and head units stay separate) and says which
``K`` it chose, or that none reaches the target, with the best ``K`` and the order-free bound that
proves it. The text report groups runs of identical units; ``--json`` prints one object with every unit and
tensor (name, shape, granularity, offset, dims), enough to re-validate the plan from the output.
``--ep N`` (expert parallel, ``raggedfsdp.app.sizing.ep``): each of N EP ranks keeps 1/N of every MoE
layer's routed experts, sharded over the ``world/N`` ranks holding the same experts; everything else is
sharded over the whole world. The report gives both FSDP group sizes, both plans, the per-rank shard
and the largest layer's all-gather (ours vs FSDP2's even ``Shard(0)``) in elements and bf16 bytes.
``--tp N`` (tensor parallel, ``raggedfsdp.app.sizing.tp``): every attention / MLP / embedding / head matrix is
split over N TP ranks (Megatron's column / row split, ``raggedfsdp.app.models.apply_tp``); the planner
plans the
TP-local shapes over the FSDP group of ``world/N`` ranks (a block spec is defined on the global shape and no
TP boundary may cut it; ``row`` is one row of the TP-local tensor, ``fully_shard``'s default). Dense models
only: ``--tp`` with ``--ep`` (EP x TP) is refused.
"""

from __future__ import annotations

import argparse
import json
import sys

from raggedfsdp.app.sizing.archs import BUILTIN
from raggedfsdp.app.sizing.autounit import DEFAULT_TARGET, UnitChoice, choose_unit_size
from raggedfsdp.app.sizing.ep import EPPlan, plan_model_ep
from raggedfsdp.app.sizing.modelplan import BlockError, ModelPlan, gcd_fallback, plan_model
from raggedfsdp.planner.planner import ORDERS
from raggedfsdp.planner.policy import BlockSpec

DEFAULT_ALIGN = 8


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``subparsers``; sets ``func(args) -> int``."""
    p = subparsers.add_parser(
        "plan",
        help="plan a model's FSDP buffers (padding, shard sizes) from shapes only",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__.split("Examples::\n\n", 1)[1].split("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"built-in table ({', '.join(BUILTIN)}), a preset, a trainable model name:flavor (llama:tiny), "
        "a Hugging Face config.json, or a folder with one (one resolver: raggedfsdp.app.sizing.registry)",
    )
    p.add_argument(
        "--world-size", "-m", type=int, required=True, help="FSDP group size M (ranks per shard group)"
    )
    p.add_argument(
        "--granularity",
        default="element",
        help="block for matrices: element (default, as fully_shard's: least padding) | row | rows:K | "
        "tile:RxC | "
        "slice | matrix (vectors: element)",
    )
    p.add_argument(
        "--unit",
        default="layer",
        help="layer | superblock (hybrid models) | layers:K | auto (fewest layers per unit within "
        "--padding-target)",
    )
    p.add_argument(
        "--padding-target",
        type=float,
        default=DEFAULT_TARGET,
        help=f"--unit auto: whole-model padding ratio to reach (default {DEFAULT_TARGET:g} = "
        f"{100 * DEFAULT_TARGET:g}%%)",
    )
    p.add_argument(
        "--max-k",
        type=int,
        default=None,
        help="--unit auto: at most this many layers (super-blocks for hybrids) per unit (default: all; "
        "a unit of K layers all-gathers K layers at once)",
    )
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
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size: routed experts split over N EP ranks, FSDP-sharded over world/N "
        "(default 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: matrices split over N TP ranks, TP-local shapes planned over world/N "
        "(dense models; default 1)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with every unit and tensor")
    p.set_defaults(func=run)
    return p


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def _ratio(pad: int, numel: int) -> str:
    return _pct(pad / (numel + pad) if numel + pad else 0.0)


def _sig(u) -> tuple:
    return (u.layout.numels, u.layout.granularities)


def _run_label(units, a: int, b: int) -> str:
    return units[a].name if a == b else f"{units[a].name} .. {units[b].name} (x{b - a + 1})"


def _repeat(runs, units, r: int) -> tuple[int, int]:
    """The period (2-8 runs) and count of the longest pattern of runs repeating from ``runs[r]``."""
    best = (1, 1)
    for period in range(2, 9):
        pat = [(b - a, _sig(units[a])) for a, b in runs[r : r + period]]
        if len(pat) < period:
            break
        reps = 1
        while [(b - a, _sig(units[a])) for a, b in runs[r + reps * period : r + (reps + 1) * period]] == pat:
            reps += 1
        if reps >= 2 and period * reps > best[0] * best[1]:
            best = (period, reps)
    return best


def _text_report(args, plan: ModelPlan, choice: UnitChoice | None = None) -> str:
    m = plan.world_size
    unit = args.unit if choice is None else f"auto ({choice.unit})"
    units = plan.units
    runs = []  # (first, last) of each run of identical consecutive units
    i = 0
    while i < len(units):
        j = i
        while j + 1 < len(units) and _sig(units[j + 1]) == _sig(units[i]):
            j += 1
        runs.append((i, j))
        i = j + 1
    rows = []  # (label, unit index) ; a repeating pattern of runs (hybrid: 3 linear + 1 attention) once
    r = 0
    while r < len(runs):
        period, reps = _repeat(runs, units, r)
        if reps >= 2:
            first, last = runs[r][0], runs[r + period * reps - 1][1]
            rows.append(
                (f"{units[first].name} .. {units[last].name}: {reps} x the {period} rows below", None)
            )
            rows += [("  " + _run_label(units, a, b), a) for a, b in runs[r : r + period]]
            r += period * reps
        else:
            rows.append((_run_label(units, *runs[r]), runs[r][0]))
            r += 1
    width = max([24] + [len(label) for label, k in rows if k is not None])
    header = (
        f"{'unit':<{width}} {'tensors':>7} {'shard_size':>12} {'padding':>9} {'bound':>9} {'FSDP2':>9} "
        f"{'FSDP2+blk':>9}"
    )
    lines = [
        (
            f"model {args.model}: {plan.numel / 1e9:.2f}B params in {len(plan.units)} units "
            f"({plan.distinct_units} distinct); M={m}, granularity {args.granularity}, unit {unit}, "
            f"order {args.order}, align {plan.align}"
        ),
        header,
    ]
    for label, k in rows:
        if k is None:
            lines.append(label)
            continue
        u = units[k]
        lay = u.layout
        tot = lay.total_numel
        lines.append(
            f"{label:<{width}} {len(lay.numels):>7} {lay.shard_size:>12} {_pct(lay.padding_ratio):>9} "
            f"{_ratio(m * u.bound_shard_size - tot, tot):>9} {_ratio(u.fsdp2_padding, tot):>9} "
            f"{_ratio(u.fsdp2_block_padding, tot):>9}"
        )
    lines.append(
        f"total padding {_pct(plan.padding_ratio)} (order-free bound {_pct(plan.bound_padding_ratio)}); "
        f"FSDP2 {_pct(plan.fsdp2_padding_ratio)}, FSDP2 keeping blocks "
        f"{_pct(plan.fsdp2_block_padding_ratio)}, FSDP1/flat {_pct(plan.fsdp1_padding_ratio)}; worst unit "
        f"{_pct(plan.max_unit_padding_ratio)}; planning {plan.plan_seconds:.3f} s"
    )
    per_rank = sum(u.layout.shard_size for u in plan.units)
    lines.append(
        f"per rank: {per_rank:,} elements = {2 * per_rank / 1e9:.3g} GB of bf16 params; ZeRO-3 persistent "
        f"state {16 * per_rank / 1e9:.3g} GB at 16 B/param (other recipes, stages: raggedfsdp "
        f"estimate-memory)"
    )
    if choice is not None:
        lines.append(f"{choice.summary()}; search {choice.seconds:.3f} s")
    return "\n".join(lines)


def _all_gather_line(plan: EPPlan) -> str:
    """The layer with the largest all-gather (ours), ours vs FSDP2, elements and bf16 bytes."""
    layers = [u.name for u in plan.dense.units if u.name.startswith("layers.")]
    if not layers:
        return ""
    best = max(layers, key=lambda n: plan.layer_all_gather(n)[0])
    ours, f2 = plan.layer_all_gather(best)
    return (
        f"largest all-gather ({best}{' + its experts' if plan.experts is not None else ''}): ours {ours:,} "
        f"elements "
        f"= {2 * ours / 1e9:.3g} GB bf16; FSDP2 Shard(0) {f2:,} = {2 * f2 / 1e9:.3g} GB "
        f"(FSDP2 / ours = {f2 / ours:.2f}x)"
    )


def _ep_report(args, plan: EPPlan) -> str:
    m, ep = plan.world_size, plan.ep
    lines = [
        (
            f"EP {ep}: world {m} = {m // ep} x {ep}; routed experts sharded over FSDP groups of {m // ep} "
            f"ranks (each holding 1/{ep} of the experts), everything else over all {m}"
        ),
        "-- non-expert units, FSDP group " + str(m),
        _text_report(args, plan.dense),
        f"-- expert units (EP-local, 1/{ep} of the experts), FSDP group {m // ep}",
        _text_report(args, plan.experts),
    ]
    per = plan.shard_numel
    lines.append(
        f"per rank with EP {ep}: {per:,} elements = {2 * per / 1e9:.3g} GB of bf16 params; ZeRO-3 persistent "
        f"state {16 * per / 1e9:.3g} GB at 16 B/param"
    )
    return "\n".join(lines)


def _bad_config(args, exc: Exception) -> int:
    return _error(
        f"--model: {args.model!r} is not a supported Hugging Face config "
        f"({type(exc).__name__}: {exc}); see raggedfsdp.app.sizing.archs for the supported model types"
    )


def _error(msg: str) -> int:
    print(f"raggedfsdp plan: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns 0, or 2 with one line on stderr (naming the argument) for bad input."""
    if args.world_size < 1:
        return _error(f"--world-size {args.world_size}: the FSDP group size must be >= 1")
    from raggedfsdp.app.sizing.registry import resolve

    try:
        source = resolve(args.model)  # preset | table | name:flavor | name-flavor | config.json
    except ValueError as exc:
        return _error(f"--model: {exc}")
    cfg = source.config
    try:
        spec = BlockSpec.parse(args.granularity)
    except ValueError as exc:
        return _error(f"--granularity: {exc}")
    auto = args.unit == "auto"
    if auto and not args.padding_target >= 0:
        return _error(f"--padding-target {args.padding_target}: must be a padding ratio >= 0 (e.g. 0.03)")
    if auto and args.max_k is not None and args.max_k < 1:
        return _error(f"--max-k {args.max_k}: must be >= 1")
    if auto and cfg is None:
        return _error(
            f"--unit auto: --model {args.model} is a trainable model; the unit search needs a real-size "
            "table or a config.json (or give --unit layer | superblock | layers:K)"
        )
    try:
        units = source.units("layer" if auto else args.unit)  # auto: checks the config up front
    except ValueError as exc:
        arg = f"--unit {args.unit}" if "unit=" in str(exc) else f"--model {args.model}"
        return _error(f"{arg}: {exc}")
    except (KeyError, TypeError, AttributeError) as exc:  # a config.json with unexpected values
        return _bad_config(args, exc)
    choice: UnitChoice | None = None
    if args.tp != 1:
        return _run_tp(args, units, spec)
    if args.ep != 1:
        return _run_ep(args, units, spec)
    try:
        policy = gcd_fallback(spec) if args.on_indivisible == "gcd" else spec
        if auto:
            choice = choose_unit_size(
                cfg,
                args.world_size,
                policy=policy,
                target=args.padding_target,
                align=args.align,
                order=args.order,
                max_k=args.max_k,
            )
            plan = choice.plan
        else:
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
        d.update(
            model=args.model, granularity=args.granularity, unit=args.unit if choice is None else choice.unit
        )
        if choice is not None:
            d["unit_choice"] = choice.to_dict()
        text = json.dumps(d, separators=(",", ":"))
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except BrokenPipeError:  # e.g. piped into `head`
            return 0
    else:
        print(_text_report(args, plan, choice))
        print(_all_gather_line(EPPlan(plan.world_size, 1, plan, None)))
    return 0


def _run_ep(args, units, spec) -> int:
    """``--ep N``: the two plans of :func:`raggedfsdp.app.sizing.ep.plan_model_ep`."""
    if args.unit == "auto":
        return _error(f"--unit auto with --ep {args.ep}: not supported; give --unit layer")
    try:
        policy = gcd_fallback(spec) if args.on_indivisible == "gcd" else spec
        plan = plan_model_ep(
            units, args.world_size, args.ep, policy=policy, align=args.align, order=args.order
        )
    except BlockError as exc:
        return _error(f"--granularity {args.granularity}: {exc}")
    except ValueError as exc:
        return _error(str(exc) if str(exc).startswith("--ep") else f"--ep {args.ep}: {exc}")
    if args.json:
        d = plan.to_dict()
        d.update(model=args.model, granularity=args.granularity, unit=args.unit)
        sys.stdout.write(json.dumps(d, separators=(",", ":")) + "\n")
    else:
        print(_ep_report(args, plan))
        print(_all_gather_line(plan))
    return 0


def _run_tp(args, units, spec) -> int:
    """``--tp N``: :func:`raggedfsdp.app.sizing.tp.plan_model_tp` (TP-local shapes over world/N ranks)."""
    from raggedfsdp.app.sizing.tp import plan_model_tp

    if args.ep != 1:
        return _error(
            f"--tp {args.tp} with --ep {args.ep}: EP x TP is not supported (raggedfsdp.app.models.apply_tp "
            "has "
            "no expert TP plan); plan one of them: --ep for a mixture of experts, --tp for a dense model"
        )
    if args.unit == "auto":
        return _error(f"--unit auto with --tp {args.tp}: not supported; give --unit layer | layers:K")
    try:
        policy = gcd_fallback(spec) if args.on_indivisible == "gcd" else spec
        plan = plan_model_tp(
            units, args.world_size, args.tp, policy=policy, align=args.align, order=args.order
        )
    except BlockError as exc:
        return _error(f"--granularity {args.granularity} with --tp {args.tp}: {exc}")
    except ValueError as exc:
        return _error(str(exc) if str(exc).startswith("--tp") else f"--tp {args.tp}: {exc}")
    m = plan.world_size
    if args.json:
        d = plan.to_dict()
        d.update(
            model=args.model,
            granularity=args.granularity,
            unit=args.unit,
            tp=args.tp,
            world=args.world_size,
            fsdp_group=m,
        )
        sys.stdout.write(json.dumps(d, separators=(",", ":")) + "\n")
        return 0
    total = sum(u.numel for u in units)
    print(
        f"TP {args.tp}: world {args.world_size} = {m} x {args.tp}; every unit is planned on its TP-local "
        f"shapes (one TP rank's {plan.numel / 1e9:.2f}B of the model's {total / 1e9:.2f}B params) over an "
        f"FSDP group of {m} ranks"
    )
    print(_text_report(args, plan))
    print(
        _all_gather_line(EPPlan(m, 1, plan, None)).replace(
            "largest all-gather", "largest all-gather per TP rank"
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raggedfsdp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
