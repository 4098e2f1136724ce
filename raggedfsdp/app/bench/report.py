"""The human-readable table of a ``raggedfsdp bench`` result (``worker.run``'s ``--json`` object)."""

from __future__ import annotations

__all__ = ["format_report"]


def _mib(n: float) -> str:
    return f"{n / 2**20:9.2f} MiB"


def _fb(r: dict) -> str:
    return f"{r['forward_peak_bytes'] / 2**20:.1f} / {r['backward_peak_bytes'] / 2**20:.1f}"


def _quant_row(r: dict) -> str:
    """The quantized all-gather's quantize / dequantize ms per step (an accounted step) and their share
    of raggedfsdp's median step time."""
    a, b = r["raggedfsdp"], r["torch"]

    def qd(x):
        return f"{x.get('quantize_seconds', 0) * 1e3:.2f} / {x.get('dequantize_seconds', 0) * 1e3:.2f}"

    frac = (a.get("quantize_seconds", 0) + a.get("dequantize_seconds", 0)) / max(
        a["step_seconds_median"], 1e-12
    )
    return (
        f"{'quantize/dequant ms':22s}{qd(a):>16s}{qd(b):>16s}   {frac:.1%} of the raggedfsdp step "
        f"({a.get('quantize_calls', 0)} / {a.get('dequantize_calls', 0)} calls, one accounted step)"
    )


def format_report(r: dict) -> str:
    """A human-readable table of a bench result (the ``--json`` object)."""
    a, b = r["raggedfsdp"], r["torch"]
    lines = [
        f"model {r['model']}/{r['flavor']} experts={r['experts']} wrap={r['wrap']} ep={r.get('ep', 1)} "
        f"tp={r.get('tp', 1)} params={r['num_params']:,} | {r['nproc']} ranks on {r['device']} "
        f"({r['threads_per_rank']} threads each), torch {r['torch_version']} | batch/rank "
        f"{r['batch_per_rank']} x seq {r['seq']}, param {r['param_dtype']} reduce {r['reduce_dtype']}, "
        f"{r['steps']} alternated steps after {r['warmup']} warm-up",
        f"{'':22s}{'raggedfsdp':>16s}{'torch':>16s}   ratio",
        f"{'step time median':22s}{a['step_seconds_median'] * 1e3:13.1f} "
        f"ms{b['step_seconds_median'] * 1e3:13.1f} ms   throughput x{r['throughput_ratio']:.3f}",
        f"{'CPU time / step / rank':22s}{a['cpu_seconds_median'] * 1e3:13.1f} "
        f"ms{b['cpu_seconds_median'] * 1e3:13.1f} ms   x{r['cpu_time_ratio']:.3f}",
        f"{'peak memory (max rank)':22s}{_mib(a['peak_memory_bytes']):>16s}"
        f"{_mib(b['peak_memory_bytes']):>16s}"
        f"   x{r['peak_memory_ratio']:.3f}",
        f"{'  peak fwd / bwd (MiB)':22s}{_fb(a):>16s}{_fb(b):>16s}   (bwd: above the end of forward)",
        f"{'copy bytes / step':22s}{a['copy_bytes']:16,d}{b['copy_bytes']:16,d}",
        f"{'collectives / step':22s}{a['collectives']:16d}{b['collectives']:16d}",
        f"{'collective bytes/step':22s}{a['collective_bytes']:16,d}{b['collective_bytes']:16,d}",
        (
            f"{'  of it all-to-all':22s}{a.get('all_to_all_bytes', 0):16,d}"
            f"{b.get('all_to_all_bytes', 0):16,d}"
            "   (EP token dispatch + combine, fwd + bwd)"
        ),
        f"{'all-gather wire B/step':22s}{a.get('all_gather_wire_bytes', 0):16,d}"
        f"{b.get('all_gather_wire_bytes', 0):16,d}   x{r.get('all_gather_wire_bytes_ratio', 0):.3f} "
        f"(raggedfsdp {r.get('all_gather_dtype', 'none')} / torch {r['param_dtype']})",
        f"{'reduce-scatter wire B':22s}{a.get('reduce_scatter_wire_bytes', 0):16,d}"
        f"{b.get('reduce_scatter_wire_bytes', 0):16,d}   x{r.get('reduce_scatter_wire_bytes_ratio', 0):.3f} "
        f"(raggedfsdp wire {r.get('reduce_scatter_wire_dtype', 'none')} / torch {r['reduce_dtype']})",
        _quant_row(r),
        f"{'padding bytes':22s}{a['padding_bytes']:16,d}{b['padding_bytes']:16,d}",
        f"{'host syncs / step':22s}{a['host_syncs']:16d}{b['host_syncs']:16d}",
        f"{'implicit redistrib.':22s}{a.get('implicit_redistributions', 0):16d}"
        f"{b.get('implicit_redistributions', 0):16d}   (/ step, max over ranks: hidden collectives)",
        f"{'final loss':22s}{a['final_loss']:16.6f}{b['final_loss']:16.6f}   |diff| "
        f"{r['final_loss_abs_diff']:.2e}",
    ]
    if "local_floor" in r:
        f = r["local_floor"]["step_seconds_median"]
        o = r["overhead_seconds"]
        lines += [
            f"{'floor: no FSDP, no comm':22s}{f * 1e3:13.1f} ms   best possible throughput ratio "
            f"x{r['throughput_ceiling']:.3f}",
            f"{'FSDP overhead / step':22s}{o['raggedfsdp'] * 1e3:13.1f} ms{o['torch'] * 1e3:13.1f} ms"
            f"   torch / raggedfsdp x{r['overhead_ratio']:.3f}",
            f"{'  of it: collectives':22s}{a['comm_only_seconds'] * 1e3:13.1f} "
            f"ms{b['comm_only_seconds'] * 1e3:13.1f} ms   (the step's collectives replayed alone)",
            f"{'  the rest':22s}{r['non_comm_overhead_seconds']['raggedfsdp'] * 1e3:13.1f} ms"
            f"{r['non_comm_overhead_seconds']['torch'] * 1e3:13.1f} ms   (hooks, copies, grad traffic, "
            f"exposed waits)",
            f"{'  the rest, CPU time':22s}{r['non_comm_overhead_cpu_seconds']['raggedfsdp'] * 1e3:13.1f} ms"
            f"{r['non_comm_overhead_cpu_seconds']['torch'] * 1e3:13.1f} ms   raggedfsdp / torch "
            f"x{r['non_comm_overhead_cpu_ratio']:.3f} (CPU step - CPU floor - CPU of the replay)",
        ]
        if "non_comm_overhead_main_thread_cpu_seconds" in r:
            m = r["non_comm_overhead_main_thread_cpu_seconds"]
            lines.append(
                f"{'  the rest, main thread':22s}{m['raggedfsdp'] * 1e3:13.1f} ms{m['torch'] * 1e3:13.1f} ms"
                f"   raggedfsdp / torch x{r['non_comm_overhead_main_thread_cpu_ratio']:.3f} "
                "(training thread's CPU - the floor's, paired per step)"
            )
        if "non_comm_overhead_main_thread_split" in r:
            sp = r["non_comm_overhead_main_thread_split"]
            lines += [
                f"{'    in fwd+bwd':22s}{sp['raggedfsdp']['fwd_bwd'] * 1e3:13.1f} ms"
                f"{sp['torch']['fwd_bwd'] * 1e3:13.1f} ms   raggedfsdp / torch "
                f"x{r['non_comm_overhead_main_thread_fwd_bwd_ratio']:.3f} (the FSDP runtime; on CUDA "
                "without the backward, which autograd runs on its device thread)",
                f"{'    in optimizer.step':22s}{sp['raggedfsdp']['optimizer'] * 1e3:13.1f} ms"
                f"{sp['torch']['optimizer'] * 1e3:13.1f} ms   (the same torch.optim on DTensor params: "
                "dispatch above the floor's plain tensors)",
            ]
        shown = [
            *o.values(),
            *r["non_comm_overhead_seconds"].values(),
            *r["non_comm_overhead_cpu_seconds"].values(),
            *r.get("non_comm_overhead_main_thread_cpu_seconds", {}).values(),
            *(v for s in r.get("non_comm_overhead_main_thread_split", {}).values() for v in s.values()),
        ]
        if any(v < 0 for v in shown):
            lines.append(
                "(a negative difference is below this run's noise: the floor, the replay and the step "
                "are timed in separate steps; more --steps narrow it)"
            )
    return "\n".join(lines)
