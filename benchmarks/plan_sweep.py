"""Padding and planning-time sweep of the structure-aware planner over models and FSDP sizes.

Prints, per model and granularity, one markdown table with a row per world size M:

- ``plan``: padding of the planner (sum over units of ``m*S - E`` over ``sum m*S``);
- ``bound``: padding at the order-free lower bound (``shard_size_lower_bound``) -- no tensor order
  and no planner under the same contract (equal shards, whole blocks, contiguous tensors) can pad less;
- ``FSDP2``: per-parameter dim-0 padding ``ceil(d0/M)*M`` (block-unaware);
- ``FSDP2+blk``: even ``Shard(0)`` chunks that keep the same blocks whole;
- ``FSDP1``: flat element-wise buffer (the planner's flat lower bound);
- ``worst unit``: the largest single-unit padding;
- ``note``: ``>3%`` / ``>FSDP2`` flags; "unavoidable: bound" when the order-free bound alone already
  exceeds the target / FSDP2's padding (so no order, no planner under the contract can do better),
  and "plan = bound" when the planner reaches the bound (optimal over all orders).

Then the whole-model planning time of ``moe-2.4t`` (best of ``--repeat``), per-layer units and
``--unit auto``.

With ``--unit auto`` each row is :func:`~raggedfsdp.app.sizing.autounit.choose_unit_size`: the
smallest ``K`` (layers per unit; embedding and head units separate) whose padding is within
``--target``, or the best ``K`` when none is. Columns: ``K``, ``plan``, ``FSDP2`` and
``FSDP2+blk`` for the same units (both per parameter, so they do not depend on ``K``), ``bound@K``,
``min bound`` = the smallest order-free bound over every ``K`` (above the target: no ``K`` can
meet it), ``unit GB`` = the largest layer unit unsharded in bf16 (what one all-gather materialises),
``search s``. Where the plan pads more than FSDP2 the note says whether some ``K`` would not
(a second search with FSDP2's padding as the target) or that the bound rules it out at every ``K``.

Usage::

    python benchmarks/plan_sweep.py                        # the README tables
    python benchmarks/plan_sweep.py --models gpt-oss-120b --granularities rows:128 --breakdown
    python benchmarks/plan_sweep.py --models llama3-70b,deepseek-v3-671b --unit auto --no-timing
"""

from __future__ import annotations

import argparse
import time

from raggedfsdp.app.sizing.archs import model_units
from raggedfsdp.app.sizing.autounit import UnitChoice, choose_unit_size
from raggedfsdp.app.sizing.modelplan import ModelPlan, gcd_fallback, plan_model

WORLD_SIZES = (
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1000,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    10240,
)


def _pct(x: float) -> str:
    return f"{100 * x:.3f}"


def _row(m: int, p: ModelPlan, target: float) -> str:
    pad, bound, f2 = p.padding_ratio, p.bound_padding_ratio, p.fsdp2_padding_ratio
    pad_n = p.padding
    bound_n = sum(m * u.bound_shard_size - u.layout.total_numel for u in p.units)
    f2_n = sum(u.fsdp2_padding for u in p.units)
    notes = []
    if pad > target:
        notes.append(
            f">{100 * target:g}% ({'unavoidable: bound' if bound > target else 'bound below target'})"
        )
    if pad_n > f2_n:
        notes.append(f">FSDP2 ({'unavoidable: bound' if bound_n > f2_n else 'not proven unavoidable'})")
    if notes and pad_n == bound_n:
        notes.append("plan = bound")
    return (
        f"| {m:>6} | {_pct(pad):>8} | {_pct(bound):>8} | {_pct(f2):>8} | "
        f"{_pct(p.fsdp2_block_padding_ratio):>9} | {_pct(p.fsdp1_padding_ratio):>7} | "
        f"{_pct(p.max_unit_padding_ratio):>8} | {p.plan_seconds:6.3f} | {'; '.join(notes)} |"
    )


def _breakdown(p: ModelPlan) -> str:
    seen, out = {}, []
    for u in p.units:
        key = (u.layout.numels, u.layout.granularities)
        if key in seen:
            seen[key][1] += 1
            continue
        seen[key] = [u, 1]
    for u, n in seen.values():
        lay = u.layout
        out.append(
            f"    {u.name:<10} x{n:<3} S={lay.shard_size:<10} pad={_pct(lay.padding_ratio)}% "
            f"bound={_pct((p.world_size * u.bound_shard_size - lay.total_numel) / (p.world_size * u.bound_shard_size))}%"
        )
    return "\n".join(out)


def sweep(models, granularities, world_sizes, order, align, unit, target, breakdown) -> None:
    for model in models:
        units = model_units(model, unit)
        for gran in granularities:
            print(f"\n### {model}, granularity {gran}, order {order}, align {align}, unit {unit}\n")
            print(
                "|      M |  plan % | bound % |  FSDP2 % | FSDP2+blk % | FSDP1 % | worst unit % | plan s | "
                "note |"
            )
            print(
                "|-------:|--------:|--------:|---------:|------------:|--------:|-------------:|-------:|------|"
            )
            for m in world_sizes:
                p = plan_model(units, m, policy=gcd_fallback(gran), align=align, order=order)
                print(_row(m, p, target))
                if breakdown:
                    print(_breakdown(p))


def _pct_note(x: float) -> str:
    """Percent for notes: three decimals, or two significant digits below 0.001% (never a bare 0.000)."""
    return f"{100 * x:.3f}" if x == 0 or 100 * x >= 0.001 else f"{100 * x:.1e}"


def _auto_row(model: str, gran: str, m: int, c: UnitChoice, order: str, align: int, max_k) -> str:
    p = c.plan
    pad_n = p.padding
    f2_n = sum(u.fsdp2_padding for u in p.units)
    t = f"{100 * c.target:g}%"
    every = "every K" if max_k is None else f"every K <= {max_k}"
    notes = []
    if c.met:
        notes.append(f"<= {t}")
    else:
        notes.append(
            f"> {t} at {every} (bound >= {_pct_note(c.min_bound_ratio)}% at K={c.min_bound_k})"
            if c.min_bound_ratio > c.target
            else f"> {t} (not proven at {every})"
        )
    if pad_n > f2_n:
        f2 = p.fsdp2_padding_ratio
        c2 = choose_unit_size(
            model,
            m,
            policy=gcd_fallback(gran),
            target=f2,
            align=align,
            order=order,
            max_k=max_k,
            search_best=False,
        )
        if c2.met:
            notes.append(f">FSDP2; K={c2.k} would match it ({_pct_note(c2.padding_ratio)}%)")
        elif c2.min_bound_ratio > f2:
            notes.append(
                f">FSDP2 at {every} (bound >= {_pct_note(c2.min_bound_ratio)}% at K={c2.min_bound_k})"
            )
        else:
            notes.append(">FSDP2 (not proven unavoidable)")
    layer_units = [u for u in p.units if u.name not in ("embed", "head")]
    gb = 2 * max(u.layout.total_numel for u in layer_units) / 1e9
    return (
        f"| {m:>6} | {c.k:>3} | {_pct(p.padding_ratio):>7} | {_pct(p.fsdp2_padding_ratio):>7} "
        f"| {_pct(p.fsdp2_block_padding_ratio):>9} | {_pct(p.bound_padding_ratio):>7} "
        f"| {_pct(c.min_bound_ratio):>9} | {gb:>7.1f} | {c.seconds:6.2f} | {'; '.join(notes)} |"
    )


def sweep_auto(models, granularities, world_sizes, order, align, target, max_k=None) -> None:
    cap = "" if max_k is None else f", K <= {max_k}"
    for model in models:
        for gran in granularities:
            print(
                f"\n### {model}, granularity {gran}, order {order}, align {align}, "
                f"unit auto (target {100 * target:g}%{cap})\n"
            )
            print(
                "|      M |   K |  plan % | FSDP2 % | FSDP2+blk % | bound@K % | min bound % | unit GB | "
                "search s | note |"
            )
            print(
                "|-------:|----:|--------:|--------:|------------:|----------:|------------:|--------:|---------:|------|"
            )
            for m in world_sizes:
                c = choose_unit_size(
                    model, m, policy=gcd_fallback(gran), target=target, align=align, order=order, max_k=max_k
                )
                print(_auto_row(model, gran, m, c, order, align, max_k), flush=True)


def timing(model: str, m: int, granularities, orders, align: int, repeat: int, target: float = 0.03) -> None:
    print(f"\n### planning time, {model} at M={m} (best of {repeat}; distinct units planned once)\n")
    t_tables = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        units = model_units(model)
        t_tables.append(time.perf_counter() - t0)
    tab = min(t_tables)
    print(
        f"shape tables: {len(units)} units, {sum(len(u.params) for u in units)} tensors, built in {tab:.3f} "
        f"s\n"
    )
    print("| granularity | order | plan s | tables + plan s | padding % |")
    print("|---|---|---:|---:|---:|")
    for gran in granularities:
        for order in orders:
            runs = [
                plan_model(units, m, policy=gcd_fallback(gran), align=align, order=order)
                for _ in range(repeat)
            ]
            best = min(r.plan_seconds for r in runs)
            print(f"| {gran} | {order} | {best:.3f} | {tab + best:.3f} | {_pct(runs[0].padding_ratio)} |")
    print(
        f"\n--unit auto (target {100 * target:g}%): choose_unit_size wall time, including building the shape "
        f"tables and every bound (best of {repeat})\n"
    )
    print("| granularity | order | chosen K | search s | padding % |")
    print("|---|---|---:|---:|---:|")
    for gran in granularities:
        for order in orders:
            runs = [
                choose_unit_size(model, m, policy=gcd_fallback(gran), target=target, align=align, order=order)
                for _ in range(repeat)
            ]
            best = min(r.seconds for r in runs)
            print(f"| {gran} | {order} | {runs[0].k} | {best:.3f} | {_pct(runs[0].padding_ratio)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama3-70b,deepseek-v3-671b,gpt-oss-120b")
    ap.add_argument("--granularities", default="row,rows:32")
    ap.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)))
    ap.add_argument("--order", default="best")
    ap.add_argument("--align", type=int, default=8)
    ap.add_argument("--unit", default="layer", help="layer | superblock | layers:K | auto (choose_unit_size)")
    ap.add_argument("--target", type=float, default=0.03, help="padding target flagged in the notes")
    ap.add_argument("--max-k", type=int, default=None, help="--unit auto: at most K layers per unit")
    ap.add_argument("--breakdown", action="store_true", help="per distinct unit S and padding under each row")
    ap.add_argument("--timing-model", default="moe-2.4t")
    ap.add_argument("--timing-world-size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args()
    args = [a.models.split(","), a.granularities.split(","), [int(x) for x in a.world_sizes.split(",")]]
    if a.unit == "auto":
        sweep_auto(*args, a.order, a.align, a.target, a.max_k)
    else:
        sweep(*args, a.order, a.align, a.unit, a.target, a.breakdown)
    if not a.no_timing:
        timing(
            a.timing_model,
            a.timing_world_size,
            ["element", "row", "rows:32"],
            ["default", "best"],
            a.align,
            a.repeat,
            a.target,
        )


if __name__ == "__main__":
    main()
