"""``raggedfsdp estimate-memory``: will it fit? Persistent memory per rank for ZeRO stages 0-3.

Examples::

    raggedfsdp estimate-memory --params 27e9 --world-size 64
    raggedfsdp estimate-memory --model hybrid-27b --world-size 64,256,1024 --recipe muon
    raggedfsdp estimate-memory --model llama3-8b --world-size 64 --replicate 8 --json
    raggedfsdp estimate-memory --model path/to/config.json --world-size 32
    raggedfsdp estimate-memory --model hybrid:tiny --unit superblock --world-size 3 --recipe fp32
    raggedfsdp estimate-memory --model gpt-oss-120b --world-size 256 --ep 8
    raggedfsdp estimate-memory --model llama3-70b --world-size 1024 --tp 8 --replicate 2

No GPU, no process group, nothing allocated (built-in models are built on the meta device). With
``--model`` the shapes are known and sharded state is the planner's real per-rank shard (padding
included); with ``--params`` it is ``ceil(P / M)``. Figures are decimal (1 GB = 1e9 bytes).
See :mod:`raggedfsdp.app.sizing.memory_estimate` for the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import sys

from raggedfsdp.app.train.optimizer_table import OPTIMIZER_TABLE

# --recipe: the three AdamW precisions, then one per optimizer of the job (train/optimizer_table.py)


def _recipe_names() -> tuple[str, ...]:
    return ("mixed", "bf16", "fp32", *(n for n in OPTIMIZER_TABLE if n != "adamw"))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate-memory",
        help="persistent memory per rank for ZeRO stages 0-3 (no GPU, nothing allocated)",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count, e.g. 27e9 or 8_030_261_248")
    src.add_argument(
        "--model",
        help="a built-in model (llama:tiny, hybrid:debug, or a preset name such as llama-tiny, "
        "hybrid-tiny), a planner table (llama3-8b, hybrid-27b, ...) or a Hugging Face config.json",
    )
    p.add_argument(
        "--world-size",
        "-m",
        required=True,
        help="data-parallel ranks; a comma list estimates each (8,64,512)",
    )
    p.add_argument(
        "--recipe",
        default="mixed",
        choices=_recipe_names(),
        help="bytes per parameter: mixed (default: bf16 params/grads, fp32 master + AdamW moments, 16 B), "
        "bf16 (8 B), fp32 (16 B, no master), or an optimizer of --optim: "
        + ", ".join(
            f"{s.name} ({8 + s.state_bytes:.3g} B)" for s in OPTIMIZER_TABLE.values() if s.name != "adamw"
        ),
    )
    p.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="HSDP replica groups (must divide the world size; default: 1)",
    )
    p.add_argument("--unit", default="layer", help="FSDP unit with --model: layer | superblock (hybrids)")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size with --model: routed experts split over N ranks, sharded over world/N "
        "(default: 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size with --model (dense models): matrices split over N ranks, the TP-local "
        "shapes sharded over world/(replicate x N) (default: 1)",
    )
    p.add_argument(
        "--granularity",
        default="element",
        help="planner block for matrices (default element, as fully_shard's; row, rows:K, tile:RxC, ...)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (a list for several world sizes)"
    )
    p.set_defaults(func=run)
    return p


def _error(msg: str) -> int:
    print(f"raggedfsdp estimate-memory: error: {msg}", file=sys.stderr)
    return 2


def _parse_count(text: str) -> int:
    try:
        value = float(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise ValueError(f"--params {text!r}: not a number; use e.g. 27e9") from None
    if not value >= 0 or not value.is_integer():
        raise ValueError(f"--params {text!r}: must be a whole number >= 0")
    return int(value)


def run(args: argparse.Namespace) -> int:
    from raggedfsdp.app.sizing.memory_estimate import estimate_memory, format_report

    try:
        sizes = [int(s) for s in str(args.world_size).split(",") if s.strip()]
    except ValueError:
        return _error(f"--world-size {args.world_size!r}: give an integer or a comma list such as 8,64,512")
    if not sizes or min(sizes) < 1:
        return _error(f"--world-size {args.world_size!r}: every world size must be >= 1")
    try:
        if args.params is not None:
            label, units, count = "", None, _parse_count(args.params)
        else:
            from raggedfsdp.app.sizing.registry import resolve

            source = resolve(args.model)
            label, units = source.label, source.units(args.unit)
            count = None
    except ValueError as exc:
        return _error(f"--model {args.model!r}: {exc}" if args.model else str(exc))
    results = []
    try:
        for ws in _progress(sizes):
            results.append(
                estimate_memory(
                    count,
                    units=units,
                    world_size=ws,
                    recipe=args.recipe,
                    replicate=args.replicate,
                    policy=args.granularity if units is not None else None,
                    ep=args.ep,
                    tp=args.tp,
                )
            )
    except ValueError as exc:
        msg = str(exc)
        from raggedfsdp.app.sizing.modelplan import BlockError

        if isinstance(exc, BlockError):
            return _error(f"--granularity {args.granularity}: {msg}")
        if args.tp != 1 and not msg.startswith("--"):
            return _error(f"--tp {args.tp}: {msg.removeprefix('estimate_memory: ')}")
        return _error(
            f"--ep {args.ep}: {msg}" if args.ep != 1 and "ep" in msg and not msg.startswith("--ep") else msg
        )
    if args.json:
        out = [dict(r.to_dict(), model=label or None) for r in results]
        text = json.dumps(out[0] if len(out) == 1 else out, indent=1)
    else:
        text = "\n\n".join(format_report(r, label=label) for r in results)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`
        pass
    return 0


def _progress(items):
    """A tqdm bar for long sweeps when tqdm is installed (optional dependency)."""
    if len(items) < 8:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="estimate", unit="world size", file=sys.stderr)
