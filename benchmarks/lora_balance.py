"""Per-rank trainable state of a LoRA model: raggedfsdp.fully_shard vs torch's fully_shard (issue 39 item 5).

The model is ``tests/_lora.py``'s ``LoraNet`` (PEFT-style ``LoRALinear``: frozen ``base_layer``, trainable
``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)``; ``--blocks`` blocks of six LoRA linears, one FSDP
unit each; a LoRA head ``d -> 2d`` as a unit of one LoRA linear; a frozen input projection in the root).
Both backends train it from the same init on real gloo ranks (CPU); after the first AdamW step each rank
reports, per unit and in all: elements of its trainable sharded params, bytes of their sharded grads
(``grad``: the local pieces; ``storage``: the distinct storages behind them, what the rank allocates),
and bytes of the AdamW state (``exp_avg`` + ``exp_avg_sq``). ``--one-buffer`` plans raggedfsdp's units
as one buffer (no trainable segment; what it did before), for comparison.

    PYTHONPATH=. python benchmarks/lora_balance.py --ws 2 3 [--d 256] [--r 8] [--one-buffer]

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

FIELDS = ("param_elems", "grad_bytes", "grad_storage_bytes", "adamw_state_bytes")


def _one_buffer() -> None:
    """Plan every unit as one buffer (the segment ids ignored)."""
    import raggedfsdp.fsdp._param_group as pg
    from raggedfsdp.planner import plan_layout

    pg.plan_segments = lambda numels, grans, ws, ids, **kw: plan_layout(numels, grans, ws, **kw)


def _worker(rank, ws, d, r, n, one_buffer, path):
    import torch.distributed as dist
    from _lora import measure

    if one_buffer:
        _one_buffer()
    res = measure(rank, ws, r=r, d=d, n=n, steps=2)
    states = [None] * ws
    dist.all_gather_object(states, {b: res[b]["state"] for b in ("ragged", "torch")})
    if rank == 0:
        with open(path, "w") as f:
            json.dump(states, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ws", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--one-buffer", action="store_true")
    args = ap.parse_args()
    import tempfile

    from _dist import run_distributed

    out = {}
    for ws in args.ws:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "states.json")
            run_distributed(_worker, ws, args.d, args.r, args.blocks, args.one_buffer, path, timeout=900)
            with open(path) as f:
                states = json.load(f)
        out[ws] = states
        print(f"\nws={ws}, d={args.d}, r={args.r}{' (one buffer)' if args.one_buffer else ''}")
        print(
            f"{'unit':<9} {'rank':>4} | {'ours params':>11} {'grad B':>8} {'storage B':>9} {'AdamW B':>9} | "
            f"{'torch params':>12} {'grad B':>8} {'storage B':>9} {'AdamW B':>9}"
        )
        for unit in states[0]["ragged"]:
            total = sum(s["ragged"][unit]["param_elems"] for s in states)
            for rank, s in enumerate(states):
                o, t = s["ragged"][unit], s["torch"][unit]
                print(
                    f"{unit:<9} {rank:>4} | {o['param_elems']:>11} {o['grad_bytes']:>8} "
                    f"{o['grad_storage_bytes']:>9} {o['adamw_state_bytes']:>9} | {t['param_elems']:>12} "
                    f"{t['grad_bytes']:>8} {t['grad_storage_bytes']:>9} {t['adamw_state_bytes']:>9}"
                )
            worst = {
                b: max(s[b][unit]["param_elems"] for s in states) * ws / total for b in ("ragged", "torch")
            }
            print(f"{unit:<9}  max/even params: ours {worst['ragged']:.3f}, torch {worst['torch']:.3f}")
    print(json.dumps({"d": args.d, "r": args.r, "one_buffer": args.one_buffer, "states": out}))


if __name__ == "__main__":
    main()
