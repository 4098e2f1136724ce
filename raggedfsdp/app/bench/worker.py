"""Per-rank body of ``raggedfsdp bench`` (run under torchrun by ``raggedfsdp bench --nproc N``).

Both systems hold the same model (same init), see the same tokens and use the same AdamW in one
process: ``raggedfsdp.fully_shard`` ("raggedfsdp") and ``torch.distributed.fsdp.fully_shard``
("torch"), with the same FSDP units (the model's ``--wrap`` policy) and mixed-precision policy.
Phases (collective: every rank runs every phase):

1. warm-up steps of both (not timed);
2. ``--steps`` timed repetitions, the order inside a repetition alternating (raggedfsdp first on even
   repetitions, torch first on odd) so slow drift of a shared machine cancels; a barrier (and a CUDA
   sync) before each timed step; a step's time is that of the slowest rank; also the CPU time
   (``time.process_time``, all threads of the rank's process) per step, mean over ranks, which a
   loaded machine disturbs much less than wall time (``cpu_time_ratio``; on CUDA it is host time only);
   with ``--floor`` (default) a third, "local" system joins the rotation: the same model *without*
   FSDP and without any communication (each rank trains its own replica on its own batch), whose
   step time is the floor no FSDP can beat. It turns the throughput ratio into an explanation:
   ``throughput_ceiling`` = torch step / floor step is the best ratio any FSDP could reach on this
   machine, and ``overhead_ratio`` = (torch - floor) / (raggedfsdp - floor) is how much of FSDP2's
   own cost (communication, copies, hooks) raggedfsdp removes; each system's forward + backward
   collectives are also replayed alone (``comm_only_seconds``, the same sizes, blocking, no compute),
   so ``non_comm_overhead_seconds`` = step - floor - comm is what hooks, copies, gradient traffic and
   exposed waits cost (``non_comm_overhead_cpu_seconds``: the same split in process CPU time); and
   ``non_comm_overhead_main_thread_cpu_seconds`` is the training thread's own CPU time
   (``time.thread_time``) above the floor's, paired per repetition: the FSDP runtime's hooks, copies and
   launches, without the collectives (gloo and NCCL run them on their own threads; a blocked wait takes
   no CPU), so no replay is subtracted and far less noise enters;
   ``non_comm_overhead_main_thread_split`` cuts that at ``optimizer.step()``: ``optimizer`` is the same
   ``torch.optim.AdamW`` in both systems, above the floor's only by DTensor dispatch on the sharded
   params (torch 2.11 on an H200: most of the split), ``fwd_bwd`` the rest of the training thread's
   work (``non_comm_overhead_main_thread_fwd_bwd_ratio``): the whole FSDP runtime on CPU, but on CUDA
   autograd runs the backward (and both FSDPs' post-backward hooks) on its own device thread, which
   no main-thread figure sees -- there ``fwd_bwd`` is the forward and pre-backward part only;
3. one counted forward + backward of each (the optimizer step, the same code for both, excluded): copy bytes
around collectives (``raggedfsdp.app.bench.copy_accounting``),
   collectives, host syncs (``raggedfsdp.app.bench.measure.StepCounter``); then one more forward +
   backward of each under ``raggedfsdp.buffer.quant_time.account_quant_time``: ``quantize_seconds`` /
   ``dequantize_seconds`` (and ``_calls``) of the quantized all-gather (``--all-gather-dtype``; 0 for
   torch and for ``none``), CUDA-event times synced at its end, so the timed steps stay unsynced;
4. one step of each under ``PeakMemory`` (the project's shared peak-memory method): a rank's peak is
   its persistent state (sharded params + optimizer state) plus the step's peak above its start;
   then one more step split into phases: forward peak (above the step's start) and backward peak
   (above the end of forward), max over ranks;
5. optionally (``--profile DIR``) more steps of each under ``cProfile`` (CPU-time clock) on rank 0
(``DIR/<system>.pstats``)
   and one under ``torch.profiler`` (``DIR/<system>.ops.txt``, ops by self CPU time).
The loss printed for each system is the mean over ranks of the last step's LM loss; they must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

SYSTEMS = {"raggedfsdp": "ragged", "torch": "torch"}


def _forward_backward(model, tok) -> torch.Tensor:
    logits = model(tok[:, :-1])  # (b, T, V)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
    aux = getattr(model, "aux_loss", None)  # MoE load-balancing loss (in the graph)
    (loss + aux if aux is not None else loss).backward()
    return loss.detach()


def _step(model, opt, tok) -> torch.Tensor:
    loss = _forward_backward(model, tok)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(args, spec, backend, mesh, device, world=None):
    from raggedfsdp.app.models import apply_compile, apply_ep, apply_fsdp, apply_tp, make_mp_policy

    model = spec.build(args).to(device)
    if getattr(args, "compile", False):  # per block, before fully_shard, the same for every system
        apply_compile(model)
    mp = make_mp_policy(backend, param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype)
    kw = {}  # --all-gather-dtype: raggedfsdp only (torch's fully_shard gathers in param_dtype)
    agd = getattr(args, "all_gather_dtype", "none")
    if backend == "ragged" and agd != "none":
        kw["all_gather_dtype"] = agd
    if world is not None and "tp" in world.mesh_dim_names:  # --tp: the same TP plan, FSDP over "dp"
        apply_tp(model, world["tp"])
        spec.wraps[args.wrap](model, mesh, backend, mp, **kw)
    elif world is not None:  # --ep: (dp, ep) mesh, experts over "ep", their FSDP over "dp", the rest over all
        apply_ep(model, world["ep"])
        apply_fsdp(model, mesh, backend=backend, mp_policy=mp, experts_mesh=world["dp"], **kw)
    else:
        spec.wraps[args.wrap](model, mesh, backend, mp, **kw)
    if backend == "ragged" and getattr(args, "reduce_scatter_wire_dtype", "none") != "none":
        # gradients as bf16 pieces, summed in reduce_dtype
        model.set_reduce_scatter_wire_dtype(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=args.foreach)
    return model, opt


def _progress(args, rank, msg) -> None:
    if rank == 0 and not args.quiet:
        print(f"raggedfsdp bench: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict | None:
    """Run the benchmark on this rank (process group already initialised); rank 0 returns the result."""
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp  # noqa: F401  (installs the RaggedShard patches)
    from raggedfsdp.app.bench.measure import (
        StepCounter,
        host_all_gather,
        host_all_reduce,
        padding_bytes,
        peak_memory,
        replay_collectives,
        state_bytes,
    )
    from raggedfsdp.app.bench.copy_accounting import CopyCounter
    from raggedfsdp.app.bench.memory import enable_cpu_allocator_accounting
    from raggedfsdp.app.bench.registry import get_bench_model
    from raggedfsdp.buffer.quant_time import account_quant_time
    from raggedfsdp.buffer.wire import count_wire_bytes
    from raggedfsdp.placement import implicit_redistribution_count

    # c10's process-wide CPU accounting, before any model is built: a block allocated earlier is
    # unknown to c10, so its free would never be reported (docs/memory.md)
    enable_cpu_allocator_accounting()

    rank, ws = dist.get_rank(), dist.get_world_size()
    device = _device(args)
    spec = get_bench_model(args.model)
    args.flavor = args.flavor or spec.default_flavor
    args.wrap = args.wrap or next(iter(spec.wraps))
    ep = getattr(args, "ep", 1)
    world = None
    if ep > 1:
        world = init_device_mesh(device.type, (ws // ep, ep), mesh_dim_names=("dp", "ep"))
        mesh = world["dp", "ep"]._flatten("dp_ep")
    elif getattr(args, "tp", 1) > 1:
        world = init_device_mesh(device.type, (ws // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        mesh = world["dp"]
    else:
        mesh = init_device_mesh(device.type, (ws,))
    systems = {name: _build(args, spec, backend, mesh, device, world) for name, backend in SYSTEMS.items()}
    timed = dict(systems)
    if args.floor:  # the same model, no FSDP, no communication: the floor of the step time
        floor_model = spec.build(args).to(device)
        if args.param_dtype == "bf16":
            floor_model = floor_model.to(torch.bfloat16)  # compute in the all-gathered dtype, like the others
        if getattr(args, "compile", False):
            from raggedfsdp.app.models import apply_compile

            apply_compile(floor_model)
        timed["local"] = (
            floor_model,
            torch.optim.AdamW(floor_model.parameters(), lr=args.lr, foreach=args.foreach),
        )
    gen = torch.Generator().manual_seed(
        args.seed + 1 + rank // getattr(args, "tp", 1)
    )  # a tp group: one batch
    batches = [
        torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
        for _ in range(args.warmup + args.steps + 2 + args.profile_steps)
    ]
    tnames = list(timed)  # raggedfsdp, torch (, local)
    times = {n: [] for n in tnames}
    cpu = {n: [] for n in tnames}  # CPU seconds of this process per step (all its threads)
    tcpu = {n: [] for n in tnames}  # CPU seconds of the training thread alone (time.thread_time)
    tcpu_opt = {n: [] for n in tnames}  # ... of it in optimizer.step() + zero_grad (the same code for all)
    losses = {n: [] for n in tnames}
    from raggedfsdp.app.train.faults import FaultPlan

    faults = FaultPlan.from_env(rank)  # test-only (RAGGEDFSDP_FAULT=raise@step0:rank1): step i = repetition i
    for i in range(args.warmup + args.steps):
        if faults:
            faults.inject_step(i, rank)
        tok = batches[i].to(device)
        order = tnames if i % 2 == 0 else tnames[::-1]
        for n in order:
            model, opt = timed[n]
            _sync(device)
            dist.barrier()
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            loss = _forward_backward(model, tok)  # = _step, with the optimizer's thread time apart
            h1 = time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=True)
            h2 = time.thread_time()
            _sync(device)
            dt, dc, dh = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - h0
            losses[n].append(loss)
            if i >= args.warmup:
                times[n].append(dt)
                cpu[n].append(dc)
                tcpu[n].append(dh)
                tcpu_opt[n].append(h2 - h1)
        if i >= args.warmup:
            j = i - args.warmup + 1
            _progress(
                args,
                rank,
                f"step {j}/{args.steps}  raggedfsdp {times['raggedfsdp'][-1] * 1e3:.1f} ms  "
                f"torch {times['torch'][-1] * 1e3:.1f} ms (rank 0)",
            )
        else:
            _progress(args, rank, f"warm-up {i + 1}/{args.warmup}")
    # slowest rank per step
    # (small host numbers are reduced on the process group's device: NCCL has no CPU backend)
    t = host_all_reduce(
        torch.tensor([times[n] for n in tnames], dtype=torch.float64), device, dist.ReduceOp.MAX
    )
    c = host_all_reduce(torch.tensor([cpu[n] for n in tnames], dtype=torch.float64), device)
    c /= ws  # mean over ranks
    h = host_all_reduce(torch.tensor([tcpu[n] for n in tnames], dtype=torch.float64), device)
    h /= ws
    h_opt = host_all_reduce(torch.tensor([tcpu_opt[n] for n in tnames], dtype=torch.float64), device)
    h_opt /= ws
    timed.pop("local", None)  # frees the floor replica before the memory phase
    names = list(systems)
    final = host_all_reduce(torch.stack([losses[n][-1].float() for n in names]).cpu(), device)
    final /= ws

    counts, traces = {}, {}
    k = args.warmup + args.steps
    for n in names:
        model, opt = systems[n]
        syncs = _CudaSyncCounter(device)
        tok = batches[k].to(device)
        # --compile: dynamo cannot run under these dispatch modes, so this counted step runs eagerly
        eager = torch.compiler.set_stance("force_eager") if getattr(args, "compile", False) else nullcontext()
        # forward + backward (+ reduce-scatters); count_wire_bytes: the bytes each collective sends
        implicit_redistribution_count(reset=True)
        with eager, CopyCounter() as cc, StepCounter() as sc, syncs, count_wire_bytes() as wire:
            _forward_backward(model, tok)
        opt.step()  # the optimizer step is the same code for both systems: not counted
        opt.zero_grad(set_to_none=True)
        # a RaggedShard operand DTensor's dispatch moved for an op (a hidden collective) in this whole step
        # (forward, backward, optimizer), this rank; torch's Shard(0) params never count
        implicit = implicit_redistribution_count(reset=True)
        # the gradient reduction's bytes: the reduce-scatter's, or with --reduce-scatter-wire-dtype bf16
        # (raggedfsdp) the all-to-all of bf16 pieces that replaces it (--ep is refused with it: options.py)
        rs_wire = wire.reduce_scatter
        if n == "raggedfsdp" and getattr(args, "reduce_scatter_wire_dtype", "none") != "none":
            rs_wire += wire.all_to_all
        counts[n] = dict(
            all_gather_wire_bytes=wire.all_gather,
            reduce_scatter_wire_bytes=rs_wire,
            all_to_all_bytes=sum(b for op, b in sc.bytes.items() if "alltoall" in op),
            copy_bytes=cc.total_bytes,
            copy_bytes_by_op=dict(cc.bytes),
            backend_copy_bytes=cc.backend_bytes,
            collectives=sc.collectives,
            collective_bytes=sc.collective_bytes,
            collectives_by_op=dict(sc.calls),
            # on CUDA the runtime's own count (a model's .tolist() is also a dispatched D2H copy: counting
            # both counted it twice); elsewhere the ops that would sync on a GPU
            host_syncs=syncs.count if device.type == "cuda" else sc.host_syncs,
            host_sync_ops=dict(sc.sync_ops),
            host_sync_sites=syncs.sites,
            implicit_redistributions=implicit,
        )
        traces[n] = sc.trace
    # the most any rank counted (every rank calls: a collective)
    most = host_all_reduce(
        torch.tensor([counts[n]["implicit_redistributions"] for n in names], dtype=torch.float64),
        device,
        dist.ReduceOp.MAX,
    )
    for a, n in enumerate(names):
        counts[n]["implicit_redistributions"] = int(most[a])
    for n in names:  # a separate step: the quantize / dequantize seconds (synced on CUDA) and calls
        model, opt = systems[n]
        tok = batches[k].to(device)
        _sync(device)
        dist.barrier()
        with account_quant_time() as qt:
            _forward_backward(model, tok)
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts[n].update(qt.as_dict())  # torch's fully_shard never quantizes: 0
    if args.floor:  # the collectives alone, the systems alternated like the steps
        replays = {n: [] for n in names}
        replay_cpu = {n: [] for n in names}
        for i in range(max(args.steps, 3)):
            for n in names if i % 2 == 0 else names[::-1]:
                wall, cpu_s = replay_collectives(traces[n], device, reps=1)
                replays[n].append(wall)
                replay_cpu[n].append(cpu_s)
        rc = host_all_reduce(torch.tensor([replay_cpu[n] for n in names], dtype=torch.float64), device)
        rc /= ws  # mean over ranks, as the steps' CPU time
        for a, n in enumerate(names):
            counts[n]["comm_only_seconds"] = statistics.median(replays[n])
            counts[n]["comm_only_cpu_seconds"] = statistics.median(rc[a].tolist())
    _progress(args, rank, "counted copies and collectives; measuring peak memory")
    mem = []
    for n in names:
        model, opt = systems[n]
        base = state_bytes(model, opt)
        tok = batches[k + 1].to(device)
        dist.barrier()
        with peak_memory(device) as pm:
            _step(model, opt, tok)
        # the same step split in phases (PeakMemory does not nest): where the peak is
        with peak_memory(device) as pf:
            logits = model(tok[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tok[:, 1:].flatten())
            aux = getattr(model, "aux_loss", None)
            loss = loss + aux if aux is not None else loss
        with peak_memory(device) as pb:
            loss.backward()
        del logits, loss, aux
        opt.step()
        opt.zero_grad(set_to_none=True)
        mem.append([base, base + pm.peak_bytes, pf.peak_bytes, pb.peak_bytes])
    gathered = host_all_gather(torch.tensor(mem, dtype=torch.float64), device)
    if args.profile:
        _profile(args, systems, batches[k + 2 :], device, rank)

    if rank != 0:
        return None
    out: dict = {}
    for a, n in enumerate(names):
        st = t[a].tolist()
        med = statistics.median(st)
        model, _ = systems[n]
        per_rank = [int(g[a, 1]) for g in gathered]
        out[n] = dict(
            step_seconds_median=med,
            step_seconds=st,
            cpu_seconds_median=statistics.median(c[a].tolist()),
            main_thread_cpu_seconds_median=statistics.median(h[a].tolist()),
            main_thread_cpu_seconds=h[a].tolist(),
            main_thread_optimizer_cpu_seconds=h_opt[a].tolist(),
            tokens_per_second=ws * args.batch * args.seq / med,
            peak_memory_bytes=max(per_rank),
            peak_memory_bytes_per_rank=per_rank,
            state_bytes_per_rank=[int(g[a, 0]) for g in gathered],
            forward_peak_bytes=max(int(g[a, 2]) for g in gathered),  # above the step's start
            backward_peak_bytes=max(int(g[a, 3]) for g in gathered),  # above the end of forward
            padding_bytes=padding_bytes(model, SYSTEMS[n], ws),
            final_loss=float(final[a]),
            **counts[n],
        )
    r, tt = out["raggedfsdp"], out["torch"]
    floor = {}
    if args.floor:
        fl = statistics.median(t[2].tolist())
        fl_cpu = statistics.median(c[2].tolist())
        over_r, over_t = r["step_seconds_median"] - fl, tt["step_seconds_median"] - fl
        floor = dict(
            local_floor=dict(
                step_seconds_median=fl,
                cpu_seconds_median=fl_cpu,
                main_thread_cpu_seconds=h[2].tolist(),
                step_seconds=t[2].tolist(),
            ),
            throughput_ceiling=tt["step_seconds_median"] / fl,
            overhead_seconds=dict(raggedfsdp=over_r, torch=over_t),
            overhead_ratio=over_t / over_r if over_r > 0 else float("inf"),
            # step - floor - the same collectives run alone: hooks, copies, gradient traffic, exposed waits
            non_comm_overhead_seconds={
                n: out[n]["step_seconds_median"] - fl - out[n]["comm_only_seconds"] for n in names
            },
            # the same split in CPU time (all threads of a rank's process, mean over ranks): what a
            # loaded machine, waits on peers and the scheduler's choices disturb much less than wall time
            non_comm_overhead_cpu_seconds={
                n: out[n]["cpu_seconds_median"] - fl_cpu - out[n]["comm_only_cpu_seconds"] for n in names
            },
        )
        nr, nt = (
            floor["non_comm_overhead_cpu_seconds"]["raggedfsdp"],
            floor["non_comm_overhead_cpu_seconds"]["torch"],
        )
        floor["non_comm_overhead_cpu_ratio"] = nr / nt if nt > 0 else float("inf")
        # the training thread's CPU above the floor's, paired per repetition (the same batch, back to back):
        # what the FSDP runtime itself costs the thread that runs the step -- hooks, copies, launches; gloo
        # runs collectives on its own threads and a blocked wait takes no CPU, so no replay is subtracted
        main = {
            n: statistics.median([x - y for x, y in zip(h[a].tolist(), h[2].tolist())])
            for a, n in enumerate(names)
        }
        floor["non_comm_overhead_main_thread_cpu_seconds"] = main
        floor["non_comm_overhead_main_thread_cpu_ratio"] = (
            main["raggedfsdp"] / main["torch"] if main["torch"] > 0 else float("inf")
        )
        # the same, split at optimizer.step(): "optimizer" is torch.optim.AdamW on DTensor params (the same
        # code in both systems; above the floor's plain-tensor step only by DTensor dispatch), "fwd_bwd" is
        # the rest of the thread's step -- the FSDP runtime's hooks, copies, launches and .grad DTensors
        # (on CUDA without the backward: autograd runs it on its device thread)
        split = {}
        for a, n in enumerate(names):
            fb, fb0 = (h[a] - h_opt[a]).tolist(), (h[2] - h_opt[2]).tolist()
            split[n] = dict(
                fwd_bwd=statistics.median([x - y for x, y in zip(fb, fb0)]),
                optimizer=statistics.median([x - y for x, y in zip(h_opt[a].tolist(), h_opt[2].tolist())]),
            )
        floor["non_comm_overhead_main_thread_split"] = split
        fr, ft = split["raggedfsdp"]["fwd_bwd"], split["torch"]["fwd_bwd"]
        floor["non_comm_overhead_main_thread_fwd_bwd_ratio"] = fr / ft if ft > 0 else float("inf")
        floor["local_floor"]["main_thread_optimizer_cpu_seconds"] = h_opt[2].tolist()
    return dict(
        **floor,
        model=args.model,
        flavor=args.flavor,
        wrap=args.wrap,
        ep=ep,
        tp=getattr(args, "tp", 1),
        compile=bool(getattr(args, "compile", False)),
        experts=getattr(getattr(systems["torch"][0], "cfg", None), "experts", None),
        nproc=ws,
        steps=args.steps,
        warmup=args.warmup,
        batch_per_rank=args.batch,
        seq=args.seq,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        device=str(device),
        torch_version=torch.__version__,
        threads_per_rank=torch.get_num_threads(),
        num_params=sum(p.numel() for p in systems["torch"][0].parameters()),
        throughput_ratio=tt["step_seconds_median"] / r["step_seconds_median"],
        cpu_time_ratio=tt["cpu_seconds_median"] / r["cpu_seconds_median"],
        peak_memory_ratio=r["peak_memory_bytes"] / max(tt["peak_memory_bytes"], 1),
        copy_bytes_ratio=r["copy_bytes"] / max(tt["copy_bytes"], 1),
        all_gather_dtype=getattr(args, "all_gather_dtype", "none"),
        reduce_scatter_wire_dtype=getattr(args, "reduce_scatter_wire_dtype", "none"),
        all_gather_wire_bytes_ratio=r["all_gather_wire_bytes"] / max(tt["all_gather_wire_bytes"], 1),
        reduce_scatter_wire_bytes_ratio=r["reduce_scatter_wire_bytes"]
        / max(tt["reduce_scatter_wire_bytes"], 1),
        collectives_ratio=r["collectives"] / max(tt["collectives"], 1),
        # the quantized all-gather's local work (accounted step) over raggedfsdp's median (timed) step
        quantize_dequantize_step_fraction=(r["quantize_seconds"] + r["dequantize_seconds"])
        / r["step_seconds_median"],
        final_loss_abs_diff=abs(r["final_loss"] - tt["final_loss"]),
        raggedfsdp=r,
        torch=tt,
    )


class _CudaSyncCounter:
    """On CUDA: the number of syncs ``torch.cuda.set_sync_debug_mode("warn")`` reports, and the Python
    lines (``file:line``, relative to the working directory) that caused them; 0 / {} elsewhere."""

    def __init__(self, device):
        self.device, self.count, self.sites = device, 0, {}

    def __enter__(self):
        if self.device.type == "cuda":
            import warnings

            self._w = warnings.catch_warnings(record=True)
            self._log = self._w.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self._w.__exit__(*exc)
            hits = [w for w in self._log if "synchroniz" in str(w.message)]
            self.count = len(hits)
            for w in hits:
                site = f"{os.path.relpath(w.filename)}:{w.lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1
        return False


def _profile(args, systems, batches, device, rank) -> None:
    import cProfile

    os.makedirs(args.profile, exist_ok=True)
    for n, (model, opt) in systems.items():
        prof = cProfile.Profile(time.process_time)  # CPU time: waits on peers / a loaded machine drop out
        for tok in batches[: args.profile_steps]:
            dist.barrier()
            if rank == 0:
                prof.enable()
            _step(model, opt, tok.to(device))
            _sync(device)
            if rank == 0:
                prof.disable()
        from torch.profiler import ProfilerActivity, profile

        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            _step(model, opt, batches[0].to(device))
            _sync(device)
        if rank == 0:
            path = os.path.join(args.profile, f"{n}.pstats")
            prof.dump_stats(path)
            with open(os.path.join(args.profile, f"{n}.ops.txt"), "w") as f:
                f.write(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            _progress(
                args,
                rank,
                f"profile of {args.profile_steps} {n} steps (rank 0) -> {path}, "
                f"op table of one step -> {n}.ops.txt",
            )


def _device(args) -> torch.device:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@record
def main(argv: list[str] | None = None) -> int:
    from datetime import timedelta

    from raggedfsdp.app.bench.options import build_arg_parser

    args = build_arg_parser(argparse.ArgumentParser(prog="python -m raggedfsdp.app.bench.worker")).parse_args(
        argv
    )
    from raggedfsdp.app.launch.env import quiet_profiler_logs

    quiet_profiler_logs()  # before the first profiler session (kineto reads its level then)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if "RANK" not in os.environ:  # one process, no torchrun
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
        )
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout)
    )
    from raggedfsdp.app.launch.failures import report_rank_failure
    from raggedfsdp.teardown import shutdown_process_group

    rank, ws = dist.get_rank(), dist.get_world_size()
    ok = False
    try:
        result = run(args)
        ok = True
    except Exception as e:  # noqa: BLE001 (recorded for the launcher's one last line, exit code 1)
        return report_rank_failure(e, rank, ws, f"[rank {rank}/{ws}]")
    finally:
        shutdown_process_group(synchronize=ok)
    if result is not None:
        from raggedfsdp.app.bench.report import format_report

        print(json.dumps(result) if args.json else format_report(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
