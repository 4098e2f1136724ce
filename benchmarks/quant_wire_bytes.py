"""Wire bytes of the quantized all-gather vs torch's bf16 all-gather, measured in the same run (issue 40).

Run (CPU, gloo):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/quant_wire_bytes.py \
        --flavor small --steps 6 --batch 4 --seq 128

Four systems train the same LLaMA (same init, same data, AdamW, ``param_dtype`` bf16, ``reduce_dtype``
fp32, one FSDP unit per block plus the root): torch's ``fully_shard``, raggedfsdp's ``fully_shard``
without and with ``all_gather_policy=QuantizedAllGatherPolicy("fp8_e4m3" | "int8")`` (32x32 tiles), and
fp8 plus the bf16-wire reduce-scatter (``set_reduce_scatter_wire_dtype(torch.bfloat16)``).
Each system's wire bytes of one whole step (forward all-gathers, backward re-gathers, reduce-scatters)
are counted with ``raggedfsdp.buffer.wire.count_wire_bytes`` (every c10d collective, the larger of its
input and output in bytes), on a step after the warm-up; the step time is the median of the other steps
(no counting mode active), the loss is the last step's. Printed on rank 0 as one JSON line per system
and a table with the ratios to torch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.distributed as dist


def _build(system: str, flavor: str, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from raggedfsdp import MixedPrecisionPolicy, QuantizedAllGatherPolicy, fully_shard
    from raggedfsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.flavor(flavor))
    model.init_weights(0)
    if system == "torch":
        fs, kw = (
            torch_fully_shard,
            {"mp_policy": TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        )
    else:
        fs = fully_shard
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if system != "ragged":
            dtype = system.removeprefix("ragged-").removesuffix("+rs-bf16")
            kw["all_gather_policy"] = QuantizedAllGatherPolicy(dtype)
    for layer in model.layers:
        fs(layer, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    if system.endswith("+rs-bf16"):
        model.set_reduce_scatter_wire_dtype(torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, tok):
    logits = model(tok[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4, help="per-rank batch")
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.buffer.wire import count_wire_bytes

    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(1 + rank)
    data = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps)]
    rows = {}
    for system in ("torch", "ragged", "ragged-fp8_e4m3", "ragged-int8", "ragged-fp8_e4m3+rs-bf16"):
        model, opt = _build(system, args.flavor, mesh)
        times, loss, wire = [], None, None
        for i, tok in enumerate(data):
            if i == 1:
                with count_wire_bytes() as w:
                    loss = _step(model, opt, tok)
                wire = w
                continue
            t0 = time.perf_counter()
            loss = _step(model, opt, tok)
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times[1:] or times), loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        rows[system] = {
            "system": system,
            "world_size": ws,
            "flavor": args.flavor,
            **wire.as_dict(),
            "all_to_all_wire_bytes": wire.all_to_all,
            "step_time_s": round(t[0].item() / ws, 4),
            "loss": round(t[1].item() / ws, 6),
        }
        del model, opt
    if rank == 0:
        ref = rows["torch"]
        for r in rows.values():
            print(json.dumps(r))
        print(
            "\n| system | all-gather bytes/step | vs torch | gradient-reduction bytes/step | vs torch "
            "| step s | loss |"
        )
        print("|---|---|---|---|---|---|---|")

        def red(
            r,
        ):  # gloo: raggedfsdp's reduce-scatter is an all-reduce of the same buffer; bf16 wire: all-to-all
            return r["reduce_scatter_wire_bytes"] + r["all_reduce_wire_bytes"] + r["all_to_all_wire_bytes"]

        for r in rows.values():
            print(
                f"| {r['system']} | {r['all_gather_wire_bytes']:,} | "
                f"{r['all_gather_wire_bytes'] / ref['all_gather_wire_bytes']:.3f} | {red(r):,} | "
                f"{red(r) / red(ref):.3f} | {r['step_time_s']} | {r['loss']} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
