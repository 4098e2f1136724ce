"""``estimate-memory`` next to torch's own FSDP2 memory tracker and to our measured state, per rank.

For each tiny model and world size: torch's ``fully_shard`` trains one step under
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (torch's private FSDP2 tracker; rank 0
of torch's fake process group, real tensors on the CPU) and its peak snapshot is split by category;
``raggedfsdp.app.sizing.memory_estimate.estimate_memory`` (recipe fp32, the planner's layout) gives
params / optimizer state / the ZeRO-3 working set; the same step under ``raggedfsdp.fully_shard``
gives our real per-rank state (storages behind the local shards and AdamW state).

    python benchmarks/estimate_vs_tracker.py [--models llama:debug,moe:debug] [--world-sizes 2,3,4] [--json]

Differences are explained in docs/memory.md ("The estimator next to torch's tracker").
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def _step(model, opt, tok):
    loss = model(tok[:, :-1]).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def compare(family: str, flavor: str, ws: int) -> dict:
    """One row: torch's tracker, our estimate and our measured state (bytes, rank 0 of ``ws``)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raggedfsdp import fully_shard
    from raggedfsdp.app.models import build_model
    from raggedfsdp.app.sizing.memory_estimate import estimate_memory
    from raggedfsdp.app.sizing.registry import model_units

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ws)
    try:
        mesh = init_device_mesh("cpu", (ws,))
        tok = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        rows = {}
        for name, shard in (("torch", torch_fully_shard), ("raggedfsdp", fully_shard)):
            torch.manual_seed(0)
            m = build_model(family, flavor)
            m.init_weights(0)
            for b in m.layers:
                shard(b, mesh=mesh)
            shard(m, mesh=mesh)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            _step(m, opt, tok)  # the optimizer state exists from here on
            if name == "torch":
                t = FSDPMemTracker(m, opt)
                t.track_inputs((tok,))
                with t:
                    _step(m, opt, tok)
                snap = t.get_tracker_snapshot("peak")
                cat = {str(k).rsplit(".", 1)[-1]: v for k, v in next(iter(snap.values())).items()}
                rows["tracker"] = cat
            else:
                opt_t = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
                rows["measured"] = {
                    "SHARDED_PARAM": _storage_bytes(m.parameters()),
                    "OPT": _storage_bytes(opt_t),
                }
        est = estimate_memory(units=model_units(family, flavor), world_size=ws, recipe="fp32")
        s3 = est.stage(3)
        rows["estimate"] = {"SHARDED_PARAM": s3.params, "OPT": s3.optim, "WORKING": est.working_bytes}
        rows.update(model=f"{family}:{flavor}", world_size=ws)
        return rows
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama:debug,moe:debug")
    p.add_argument("--world-sizes", default="2,3,4")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    out = [compare(*m.split(":"), int(w)) for m in a.models.split(",") for w in a.world_sizes.split(",")]
    if a.json:
        print(json.dumps(out))
        return 0
    print(
        f"{'model':12s}{'ws':>3s} | {'params: est / ours / torch-tracker (KiB)':>42s} | "
        f"{'AdamW state: est / ours / tracker':>36s} | {'working est / tracker unsharded+act+temp':>42s}"
    )
    for r in out:
        e, o, t = r["estimate"], r["measured"], r["tracker"]
        k = 1024
        print(
            f"{r['model']:12s}{r['world_size']:3d} | {e['SHARDED_PARAM'] / k:12.1f} "
            f"{o['SHARDED_PARAM'] / k:12.1f} {t['SHARDED_PARAM'] / k:14.1f} | {e['OPT'] / k:10.1f} "
            f"{o['OPT'] / k:10.1f} {t['OPT'] / k:12.1f} | {e['WORKING'] / k:14.1f} "
            f"{t['UNSHARDED_PARAM'] / k:8.1f}+{t['ACT'] / k:.1f}+{t['TEMP'] / k:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
