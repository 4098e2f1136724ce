"""GPU checks of raggedfsdp's fully_shard on CUDA + NCCL (issue 8 item 5); skipped without CUDA.

World size = number of visible GPUs (1 works). Each check compares against an independent
reference (a single-GPU model, torch's own fully_shard on the same model) and records what it
measured (``_nccl.record``) for ``benchmarks/gpu/run.sh``'s JSON summary:

* no host sync in a step: ``torch.cuda.set_sync_debug_mode("error")`` around forward, backward and
  ``optimizer.step()`` after a warm-up step;
* peak memory vs torch's fully_shard: the CUDA caching allocator's peak (``PeakMemory``) of one step;
* CPU offload: two backwards before ``zero_grad`` accumulate like the single-GPU model;
* bf16 parity: gradients after one backward (``param_dtype=bf16``, ``reduce_dtype=fp32``) vs the
  single-GPU bf16 model, tight enough that a 2x gradient error fails;
* meta-device init on CUDA equals single-device init with the same seed;
* (>= 2 GPUs) NCCL all-gather kernels overlap compute kernels in forward (profiler timeline).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _memory import MemNet, builder, loss_fn
from _nccl import record, run_nccl, world_size

MiB = 2**20


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (ws,))


def _shard(model, fs, mesh, **kw):
    for b in model.blocks:
        fs(b, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


def _full(t):
    """Full tensor of a (possibly CPU-offloaded) DTensor, gathered over its CUDA mesh; plain tensors as is."""
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


def _full_grads(model):
    return {n: _full(p.grad).float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _rel_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    den = sum(float(b[k].norm() ** 2) for k in b) ** 0.5
    return num / max(den, 1e-30)


# ---- CUDA PeakMemory against a known allocation (single process) ---------------------------------
def test_cuda_peak_memory_method_counts_a_known_allocation():
    from raggedfsdp.app.bench.memory import PeakMemory

    with PeakMemory("cuda") as m:
        x = torch.empty(4 * MiB // 4, device="cuda")  # 4 MiB (a multiple of the 512 B block)
        x.untyped_storage().resize_(0)
        y = torch.empty(2 * MiB // 4, device="cuda")
        del y
    assert m.peak_bytes == 4 * MiB and m.end_bytes == m.baseline_bytes, m


# ---- host syncs -----------------------------------------------------------------------------------
def _sync_case(rank, ws):
    from _memory import backends

    mesh = _mesh(ws)
    out = {}
    for name, (fs, _) in backends().items():
        torch.manual_seed(0)
        model = _shard(MemNet(1024, 4).cuda(), fs, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(16, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
        loss_fn(x)(model).backward()  # warm-up: lazy init, optimizer state
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        errors = {}
        loss = None
        for phase in ("forward", "backward", "optimizer.step"):
            torch.cuda.set_sync_debug_mode("error")
            try:
                if phase == "forward":
                    loss = loss_fn(x)(model)
                elif phase == "backward":
                    loss.backward()
                else:
                    opt.step()
                errors[phase] = None
            except RuntimeError as e:
                errors[phase] = str(e).splitlines()[0][:300]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        out[name] = errors
    return out


def test_no_host_sync_in_forward_backward_optimizer_step():
    res = run_nccl(_sync_case)
    record("sync_debug", res[0])
    bad = {f"rank {r}: {ph}": e for r, o in enumerate(res) for ph, e in o["ragged"].items() if e}
    assert not bad, (
        f"host syncs in the raggedfsdp step: {bad} (torch fully_shard on the same step: {res[0]['torch']})"
    )


# ---- peak memory vs torch -------------------------------------------------------------------------
def _peak_case(rank, ws, d, n, batch):
    from raggedfsdp.app.bench.memory import measure_train_step

    mesh = _mesh(ws)
    torch.manual_seed(0)
    init = {k: v.cuda() for k, v in MemNet(d, n).state_dict().items()}
    x = torch.randn(batch, d, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    unit = 2 * (d * d + d)
    n_params = sum(v.numel() for v in init.values())
    out = {}
    # The first measurement in a process also holds what CUDA libraries allocate once and keep (cuBLAS /
    # cuBLASLt workspaces, 64 MiB on the first H200 run, where this test failed at 1.056x for exactly
    # that: raggedfsdp was measured first). A discarded first measurement takes it.
    measure_train_step(builder("ragged", init, mesh, None, d=d, n=n), loss_fn(x), "cuda")
    for dt_name, dt in (("fp32", None), ("bf16", torch.bfloat16)):
        psize, gsize = (2, 6) if dt else (4, 4)
        r = {
            b: measure_train_step(builder(b, init, mesh, dt, d=d, n=n), loss_fn(x), "cuda")._asdict()
            for b in ("ragged", "torch")
        }
        # sharded state + current/prefetched units + the root's params and grads + (K+1) grad units + one
        # weight-gradient
        # temporary (as tests/dist/test_fsdp_memory.py, K = 1)
        r["bound_without_activations"] = (
            int(1.01 * 4 * n_params * 4 / ws)
            + 2 * unit * psize
            + (d * d + d) * (psize + gsize)
            + 2 * unit * gsize
            + d * d * psize
        )
        r["ratio_fwd_bwd"] = r["ragged"]["fwd_bwd_peak_bytes"] / r["torch"]["fwd_bwd_peak_bytes"]
        r["ratio_optim"] = r["ragged"]["optim_peak_bytes"] / r["torch"]["optim_peak_bytes"]
        out[dt_name] = r
    return out


def test_peak_memory_at_most_torch_fully_shard():
    res = run_nccl(_peak_case, 2048, 8, 32)
    record(
        "peak_memory",
        {"world_size": world_size(), "model": "8 x 2 Linear(2048,2048) + root Linear", "rank0": res[0]},
    )
    bad = []
    # 64 KiB of slack: the CUDA allocator rounds every block to 512 B and raggedfsdp keeps a few small
    # bookkeeping tensors (the second H200 run: bf16 optimizer-step peak +8 KiB of 1.36 GiB, 1.000006x);
    # a unit here is 16 MiB, so any unit-sized regression still fails
    slack = 64 * 1024
    for r, o in enumerate(res):
        for dt, v in o.items():
            rg, tc = v["ragged"], v["torch"]
            if rg["fwd_bwd_peak_bytes"] > tc["fwd_bwd_peak_bytes"] + slack:
                bad.append(f"rank {r} {dt}: fwd+bwd peak {v['ratio_fwd_bwd']:.6f}x torch's")
            if rg["optim_peak_bytes"] > tc["optim_peak_bytes"] + slack:
                bad.append(f"rank {r} {dt}: optimizer-step peak {v['ratio_optim']:.6f}x torch's")
            # activations here are < 1 MiB (batch 32 x 2048), so the bound gets 4 MiB of slack for them
            if v["ragged"]["fwd_bwd_peak_bytes"] > v["bound_without_activations"] + 4 * MiB:
                bad.append(
                    f"rank {r} {dt}: fwd+bwd peak {v['ragged']['fwd_bwd_peak_bytes'] / MiB:.1f} MiB > bound "
                    f"{v['bound_without_activations'] / MiB + 4:.1f} MiB"
                )
    assert not bad, bad


# ---- CPU offload: two backwards before zero_grad ----------------------------------------------------
def _offload_case(rank, ws):
    import raggedfsdp

    mesh = _mesh(ws)
    torch.manual_seed(0)
    base = MemNet(512, 3)
    ref = copy.deepcopy(base).cuda()
    model = _shard(
        copy.deepcopy(base),
        raggedfsdp.fully_shard,
        mesh,
        offload_policy=raggedfsdp.CPUOffloadPolicy(pin_memory=True),
    )
    x1 = torch.randn(
        8, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )  # same on all ranks
    x2 = torch.randn(8, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    for m in (ref, model):
        loss_fn(x1)(m).backward()
        loss_fn(x2)(m).backward()  # accumulates into the (offloaded) sharded grads
    torch.cuda.synchronize()
    err = _rel_err(_full_grads(model), _full_grads(ref))
    devices = sorted(
        {p.grad.device.type for p in model.parameters()} | {p.device.type for p in model.parameters()}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # runs on the CPU shards
    opt.zero_grad()
    loss = float(loss_fn(x1)(model))
    return {"grad_rel_err": err, "devices": devices, "loss_after_step": loss}


def test_cpu_offload_two_backwards_before_zero_grad():
    res = run_nccl(_offload_case)
    record("cpu_offload", res[0])
    for r, o in enumerate(res):
        assert o["devices"] == ["cpu"], (r, o)
        assert o["grad_rel_err"] < 1e-4, (r, o)


# ---- bf16 gradient parity ---------------------------------------------------------------------------
def _bf16_case(rank, ws):
    from _memory import backends

    mesh = _mesh(ws)
    torch.manual_seed(0)
    base = MemNet(512, 4)
    x = torch.randn(
        16, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(3)
    )  # same on all ranks
    ref = copy.deepcopy(base).cuda().to(torch.bfloat16)
    loss_fn(x.to(torch.bfloat16))(ref).backward()
    ref_g = _full_grads(ref)
    out = {}
    for name, (fs, mp_cls) in backends().items():
        model = _shard(
            copy.deepcopy(base).cuda(),
            fs,
            mesh,
            mp_policy=mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        loss_fn(x)(model).backward()
        out[name] = _rel_err(_full_grads(model), ref_g)
    return out


def test_bf16_gradients_match_single_gpu():
    res = run_nccl(_bf16_case)
    record("bf16_grad_parity", {"rel_err_vs_single_gpu_bf16": res[0]})
    for r, o in enumerate(res):
        # bf16 round-off of the same computation: ~1e-3; a 2x gradient error would be 1.0
        assert o["ragged"] < 2e-2, (r, o)
        assert o["ragged"] <= max(2 * o["torch"], 1e-2), (r, o)


# ---- meta-device init on CUDA -------------------------------------------------------------------------
def _meta_case(rank, ws):

    import raggedfsdp

    mesh = _mesh(ws)

    def init_params(m):
        torch.manual_seed(0)
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.reset_parameters()

    with torch.device("meta"):
        model = MemNet(384, 3)
        ref = MemNet(384, 3)
    _shard(model, raggedfsdp.fully_shard, mesh)
    model.to_empty(device="cuda")
    init_params(model)
    ref.to_empty(device="cuda")
    init_params(ref)
    full = {n: _full(p) for n, p in model.named_parameters()}
    max_diff = max(float((full[n] - p).abs().max()) for n, p in ref.named_parameters())
    devices = sorted({p.device.type for p in model.parameters()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 384, device="cuda")
    loss_fn(x)(model).backward()
    opt.step()
    return {
        "max_abs_diff_vs_single_device_init": max_diff,
        "devices": devices,
        "finite": bool(all(torch.isfinite(_full(p)).all() for p in model.parameters())),
    }


def test_meta_device_init_on_cuda_matches_single_device_init():
    res = run_nccl(_meta_case)
    record("meta_init", res[0])
    for r, o in enumerate(res):
        assert o["devices"] == ["cuda"] and o["finite"], (r, o)
        assert o["max_abs_diff_vs_single_device_init"] == 0.0, (r, o)


# ---- forward all-gather / compute overlap (>= 2 GPUs) -------------------------------------------------
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "matmul", "sm90_", "sm100_", "ampere_")


def _intervals(prof):
    """(all-gather kernel, matmul kernel, other kernel) time intervals in microseconds."""
    ag, gemm, other = [], [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (e.time_range.start, e.time_range.end)
        name = e.name.lower()
        if "nccl" in name:
            if "allgather" in name.replace("_", ""):
                ag.append(iv)
        elif any(k in name for k in _GEMM):
            gemm.append(iv)
        elif "memcpy" not in name and "memset" not in name:
            other.append(iv)
    return ag, gemm, other


def _overlap_case(rank, ws):
    from torch.profiler import ProfilerActivity, profile

    import raggedfsdp

    mesh = _mesh(ws)
    torch.manual_seed(0)
    model = _shard(
        MemNet(4096, 6).cuda(),
        raggedfsdp.fully_shard,
        mesh,
        mp_policy=raggedfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    )
    x = torch.randn(8192, 4096, device="cuda")
    with torch.no_grad():
        model(x)  # warm-up: lazy init, recorded forward order (implicit prefetch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(x)
            torch.cuda.synchronize()
    ag, gemm, other = _intervals(prof)
    compute = gemm or other  # matmul kernels when their names are recognised, else every compute kernel
    overlapped = 0.0
    for a0, a1 in ag:
        cover = [(max(a0, c0), min(a1, c1)) for c0, c1 in compute if c0 < a1 and a0 < c1]
        overlapped += sum(e - s for s, e in cover) if cover else 0.0
    total = sum(a1 - a0 for a0, a1 in ag)
    n_overlapping = sum(any(c0 < a1 and a0 < c1 for c0, c1 in compute) for a0, a1 in ag)
    return {
        "allgather_kernels": len(ag),
        "overlapping_compute": n_overlapping,
        "compute_kind": "gemm" if gemm else "any",
        "allgather_us": total,
        "overlapped_us_upper_bound": overlapped,
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the overlap check needs >= 2 GPUs")
def test_forward_allgathers_overlap_compute():
    res = run_nccl(_overlap_case)
    record("forward_overlap", res[0])
    for r, o in enumerate(res):
        assert o["allgather_kernels"] >= 6, (r, o)
        # all units but the first can be prefetched while the previous unit computes
        assert o["overlapping_compute"] >= o["allgather_kernels"] // 2, (r, o)
