"""Stage B of benchmarks/gpu/run.sh: correctness smoke on one GPU (NCCL, world size 1), no pytest.

Each check compares raggedfsdp against an independent reference and records its numbers and a
pass flag (``ok``) in the result file (``--out``), re-written after every check:

* ``bf16_grad_parity``: gradients after one backward with ``param_dtype=bf16, reduce_dtype=fp32``
  vs the single-device bf16 model, next to torch's ``fully_shard`` on the same model (a 2x gradient
  error gives rel. error 1.0; the bound is 2e-2 and at most 2x torch's error);
* ``cpu_built_module``: a module built on the CPU, sharded over the CUDA mesh and fed CPU inputs
  (both backends move params, buffers and root inputs to the GPU): grads vs the single-GPU model;
* ``offload_accumulation``: ``CPUOffloadPolicy(pin_memory=True)``, two backwards before
  ``zero_grad``: accumulated grads vs the single-device model (rel. error < 1e-4), grads on the CPU;
* ``meta_init``: meta-device model, ``fully_shard``, ``to_empty(device)``, seeded init == the same
  init of a plain model (max abs diff 0);
* ``sync_count``: a ``torch.profiler`` count of synchronizing CUDA runtime calls (``_common.SYNC_CALLS``)
  inside forward, backward and ``optimizer.step()`` of a warmed-up step, for both backends, with the
  two positive controls of ``_common.sync_controls`` (``x.item()``, ``Event.synchronize()``) that must
  register; and ``torch.cuda.set_sync_debug_mode("error")`` per phase as a second opinion;
* ``sync_sites_moe``: the synchronizing calls of a 128-expert MoE forward + backward (both backends),
  each named by its enclosing CPU op and thread (reported; ``ok`` if raggedfsdp has no more than torch).

``--dry-run`` runs the same code on CPU (gloo, world size 1, tiny shapes; the sync count is then 0 by
construction and the controls are not applicable).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Result,
    device_for,
    init_pg,
    profile,
    section,
    shard,
    shutdown_pg,
    sync,
    sync_calls_in,
    sync_controls,
    trace_events,
    write_stdout_json,
)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def loss_of(model, x):
    return model(x).float().pow(2).mean()


def full(t):
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device.type != t.device_mesh.device_type:  # CPU offload: the shard lives on the host
        t = DTensor.from_local(
            t.to_local().to(t.device_mesh.device_type),
            t.device_mesh,
            t.placements,
            shape=t.shape,
            stride=t.stride(),
        )
    return t.full_tensor()


def grads(model):
    return {n: full(p.grad).float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(a, b):
    if a.keys() != b.keys():
        raise AssertionError(f"gradient names differ: {sorted(a)} vs {sorted(b)}")
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    return num / max(sum(float(b[k].norm() ** 2) for k in b) ** 0.5, 1e-30)


def bf16_parity(dev, mesh, d, n):
    torch.manual_seed(0)
    base = Net(d, n)
    x = torch.randn(16, d, generator=torch.Generator().manual_seed(3)).to(dev)
    ref = copy.deepcopy(base).to(dev).to(torch.bfloat16)
    loss_of(ref, x.to(torch.bfloat16)).backward()
    ref_g = grads(ref)
    out = {}
    for b in ("ragged", "torch"):
        m = shard(copy.deepcopy(base).to(dev), b, mesh, torch.bfloat16, torch.float32)
        loss_of(m, x).backward()
        out[b] = rel_err(grads(m), ref_g)
    out["ok"] = out["ragged"] < 2e-2 and out["ragged"] <= max(2 * out["torch"], 1e-2)
    return out


def cpu_built_module(dev, mesh, d, n):
    """A module built on the CPU, sharded over the GPU mesh, fed CPU inputs (both backends move them)."""
    torch.manual_seed(0)
    base = Net(d, n)
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(base).to(dev)
    loss_of(ref, x.to(dev)).backward()
    ref_g = grads(ref)
    out = {}
    for b in ("ragged", "torch"):
        m = shard(copy.deepcopy(base), b, mesh)
        loss_of(m, x).backward()
        out[b] = {
            "rel_err": rel_err(grads(m), ref_g),
            "devices": sorted({p.device.type for p in m.parameters()}),
        }
    out["ok"] = out["ragged"]["rel_err"] < 1e-5 and out["ragged"]["devices"] == [dev.type]
    return out


def offload_accumulation(dev, mesh, d, n):
    import raggedfsdp

    torch.manual_seed(0)
    base = Net(d, n)
    ref = copy.deepcopy(base).to(dev)
    model = shard(
        copy.deepcopy(base).to(dev),
        "ragged",
        mesh,
        offload_policy=raggedfsdp.CPUOffloadPolicy(pin_memory=dev.type == "cuda"),
    )
    xs = [torch.randn(8, d, generator=torch.Generator().manual_seed(s)).to(dev) for s in (1, 2)]
    for m in (ref, model):
        for x in xs:
            loss_of(m, x).backward()
    sync(dev)
    err = rel_err(grads(model), grads(ref))
    devices = sorted({p.grad.device.type for p in model.parameters()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    opt.zero_grad()
    loss = float(loss_of(model, xs[0]))
    return {
        "grad_rel_err": err,
        "grad_devices": devices,
        "loss_after_step": loss,
        "ok": err < 1e-4 and devices == ["cpu"] and math.isfinite(loss),
    }


def meta_init(dev, mesh, d, n):
    def init(m):
        torch.manual_seed(0)
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                mod.reset_parameters()

    with torch.device("meta"):
        model, ref = Net(d, n), Net(d, n)
    shard(model, "ragged", mesh)
    model.to_empty(device=dev)
    init(model)
    ref.to_empty(device=dev)
    init(ref)
    fulls = {k: full(p) for k, p in model.named_parameters()}
    diff = max(float((fulls[k] - p).abs().max()) for k, p in ref.named_parameters())
    devices = sorted({p.device.type for p in model.parameters()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of(model, torch.randn(8, d, device=dev)).backward()
    opt.step()
    finite = all(bool(torch.isfinite(full(p)).all()) for p in model.parameters())
    return {
        "max_abs_diff": diff,
        "devices": devices,
        "finite": finite,
        "ok": diff == 0.0 and devices == [dev.type] and finite,
    }


def sync_count(dev, mesh, d, n):
    from torch.profiler import record_function

    out = {"controls": sync_controls(dev)}
    for b in ("ragged", "torch"):
        torch.manual_seed(0)
        model = shard(Net(d, n).to(dev), b, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(16, d, generator=torch.Generator().manual_seed(0)).to(dev)
        for _ in range(2):  # warm-up: lazy init, optimizer state
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
        sync(dev)
        with profile(dev) as prof:
            with record_function("step::forward"):
                loss = loss_of(model, x)
            with record_function("step::backward"):
                loss.backward()
            with record_function("step::optimizer"):
                opt.step()
                opt.zero_grad()
            sync(dev)
        ev = trace_events(prof)
        r = {ph: sync_calls_in(ev, f"step::{ph}") for ph in ("forward", "backward", "optimizer")}
        r["total"] = sum(v["calls"] for v in r.values())
        if dev.type == "cuda":  # second opinion (blind to Event.synchronize)
            debug = {}
            for ph in ("forward", "backward", "optimizer"):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    if ph == "forward":
                        loss = loss_of(model, x)
                    elif ph == "backward":
                        loss.backward()
                    else:
                        opt.step()
                        opt.zero_grad()
                    debug[ph] = None
                except RuntimeError as e:
                    debug[ph] = str(e).splitlines()[0][:200]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                sync(dev)
            r["sync_debug_mode"] = debug
        out[b] = r
        del model, opt
    seen = out["controls"]["counter_sees_syncs"]
    out["ok"] = (
        (out["ragged"]["total"] == 0 and bool(seen)) if dev.type == "cuda" else out["ragged"]["total"] == 0
    )
    return out


def sync_sites_moe(dev, mesh, d, n):
    """Where each synchronizing CUDA call of a MoE step comes from, for both backends: the model's own
    ``counts.tolist()`` (one per MoE layer) in both, and anything else. The first H200 run's bench counted
    one more sync per step in raggedfsdp than in torch (``set_sync_debug_mode`` placed it on no Python
    line, so a thread without Python frames); this names the CPU op and thread. ``ok``: raggedfsdp has no
    more sync calls than torch in forward + backward."""
    from dataclasses import replace

    from torch.profiler import record_function

    from raggedfsdp.app.models.moe import MOE_FLAVORS, MoE

    experts = 128 if dev.type == "cuda" else 8
    cfg = replace(MOE_FLAVORS["moe-tiny"], n_experts=experts, n_layers=2)
    tok = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(0)).to(dev)
    out: dict = {"n_experts": experts}
    for b in ("ragged", "torch"):
        torch.manual_seed(0)
        model = shard(MoE(cfg).to(dev), b, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def fwd_bwd(m):
            logits = m(tok[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
            (loss + m.aux_loss).backward()

        for _ in range(2):
            fwd_bwd(model)
            opt.step()
            opt.zero_grad()
        sync(dev)
        with profile(dev) as prof:
            with record_function("step::fwd_bwd"):
                fwd_bwd(model)
            sync(dev)
        out[b] = sync_calls_in(trace_events(prof), "step::fwd_bwd", ops=True)
        opt.zero_grad()
        del model, opt
    out["ok"] = out["ragged"]["calls"] <= out["torch"]["calls"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = device_for(args.dry_run)
    d, n = (64, 2) if dev.type == "cpu" else (1024, 4)
    res = Result(args.out, stage="smoke", device=str(dev), dim=d, blocks=n)
    mesh = init_pg(dev)
    checks = (
        "bf16_grad_parity",
        "cpu_built_module",
        "offload_accumulation",
        "meta_init",
        "sync_count",
        "sync_sites_moe",
    )
    for name, fn in (
        ("bf16_grad_parity", bf16_parity),
        ("cpu_built_module", cpu_built_module),
        ("offload_accumulation", offload_accumulation),
        ("meta_init", meta_init),
        ("sync_count", sync_count),
        ("sync_sites_moe", sync_sites_moe),
    ):
        with section(res, name):
            res.set(name, fn(dev, mesh, d, n))
    res.set(
        "ok",
        all(isinstance(v, dict) and v.get("ok") for k, v in res.data.items() if k in checks)
        and all(k in res.data for k in checks),
    )
    shutdown_pg()
    write_stdout_json(res.data)


if __name__ == "__main__":
    main()
