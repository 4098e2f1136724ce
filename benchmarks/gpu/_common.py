"""Shared pieces of the benchmarks/gpu stages: process groups, models, profiler-trace parsing, JSON out.

Only torch and raggedfsdp are imported (the GPU image has no pytest, numpy or transformers). Every
stage script writes its result file after each sub-measurement (:class:`Result`), so a stage killed
by its deadline still returns what it measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

# Synchronizing CUDA runtime / driver calls (the host waits for the GPU). ``cudaMemcpy`` (not
# ``...Async``) is synchronous w.r.t. the host for pageable memory; ``.item()`` shows up as
# ``cudaMemcpyAsync`` + ``cudaStreamSynchronize``; ``Event.synchronize()`` as ``cudaEventSynchronize``
# (which ``torch.cuda.set_sync_debug_mode`` does not see).
SYNC_CALLS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaMemcpy2D",
        "cudaMemset",
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cuEventSynchronize",
        "cuMemcpyDtoH_v2",
        "cuMemcpyHtoD_v2",
    }
)


class Result:
    """A dict that is re-written to ``path`` (JSON) on every ``set``: a killed stage keeps its partial
    output."""

    def __init__(self, path: str | None, **init):
        self.path = path
        self.data: dict = dict(init)
        self.t0 = time.monotonic()
        self.flush()

    def set(self, key, value) -> None:
        self.data[key] = value
        self.flush()

    def error(self, key, exc: BaseException) -> None:
        self.set(
            key,
            {
                "error": f"{type(exc).__name__}: {exc}"[:800],
                "traceback": traceback.format_exc().splitlines()[-8:],
            },
        )

    def flush(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.t0, 1)
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)


@contextlib.contextmanager
def section(res: Result, key: str):
    """Run a sub-measurement; an exception is recorded under ``key`` and the stage goes on. Its wall
    seconds go to ``section_s[key]`` (where a stage's time goes, on the GPU and in the dry run)."""
    t0 = time.monotonic()
    try:
        yield
    except Exception as e:  # noqa: BLE001 - recorded, the next sub-measurement still runs
        res.error(key, e)
    finally:
        res.data.setdefault("section_s", {})[key] = round(time.monotonic() - t0, 2)


def device_for(dry_run: bool) -> torch.device:
    if dry_run or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def init_pg(dev: torch.device, fake_world: int = 0):
    """World-size-1 process group (NCCL on CUDA, gloo on CPU) or, with ``fake_world``, torch's fake
    process group as rank 0 of ``fake_world`` (collectives are no-ops; every buffer has its real size).
    Returns the 1-D ``DeviceMesh``."""
    from torch.distributed.device_mesh import init_device_mesh

    if fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
        ws = fake_world
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo", store=store, rank=0, world_size=1, **kw
        )
        ws = 1
    return init_device_mesh(dev.type, (ws,))


def shutdown_pg() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(model, backend: str, mesh, param_dtype=None, reduce_dtype=None, **kw):
    """``fully_shard`` of ``backend`` ("ragged" or "torch") on each of ``model.layers`` (or ``.blocks``),
    then the root."""
    if backend == "ragged":
        import raggedfsdp

        fs, mp_cls = raggedfsdp.fully_shard, raggedfsdp.MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fs, mp_cls = fully_shard, MixedPrecisionPolicy
    mp = mp_cls(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = getattr(model, "layers", None) or model.blocks
    for b in blocks:
        fs(b, mesh=mesh, mp_policy=mp, **kw)
    fs(model, mesh=mesh, mp_policy=mp, **kw)
    return model


# ---- profiler traces -----------------------------------------------------------------------------
def trace_events(prof) -> list[dict]:
    """The Kineto trace of a finished ``torch.profiler.profile`` as a list of chrome-trace events."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            data = json.load(f)
    return data.get("traceEvents", data) if isinstance(data, dict) else data


def _span(e) -> tuple[float, float]:
    ts = float(e.get("ts", 0.0))
    return ts, ts + float(e.get("dur", 0.0))


def sync_calls_in(events: list[dict], annotation: str, *, ops: bool = False) -> dict:
    """Synchronizing runtime calls (``SYNC_CALLS``) issued, on any host thread, inside the time span of
    each ``record_function(annotation)`` range: ``{"calls": n, "by_name": {...}, "ranges": k}``; with
    ``ops``, also ``"by_op"``: for each call, the innermost CPU op on the same host thread whose span holds
    it, and that op's parent (``"aten::copy_ < aten::_to_copy"``), counted; ``"thread"``: ``"main"`` /
    ``"other"`` (the thread that ran the annotation or another one, e.g. autograd's device thread)."""
    ranges = [
        _span(e)
        for e in events
        if e.get("ph") == "X"
        and e.get("name") == annotation
        and e.get("cat") in ("user_annotation", "cpu_op", None)
    ]
    by: dict[str, int] = {}
    hits: list[dict] = []
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in SYNC_CALLS:
            continue
        s, _ = _span(e)
        if any(a <= s <= b for a, b in ranges):
            by[e["name"]] = by.get(e["name"], 0) + 1
            hits.append(e)
    out = {"calls": sum(by.values()), "by_name": by, "ranges": len(ranges)}
    if ops:
        main_tids = {e.get("tid") for e in events if e.get("ph") == "X" and e.get("name") == annotation}
        cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        by_op: dict[str, int] = {}
        for h in hits:
            s, _ = _span(h)
            enc = sorted(
                (c for c in cpu if c.get("tid") == h.get("tid") and _span(c)[0] <= s <= _span(c)[1]),
                key=lambda c: float(c.get("dur", 0.0)),
            )
            where = " < ".join(c["name"] for c in enc[:2]) or "(no CPU op)"
            key = f"{h['name']} in {where} [{'main' if h.get('tid') in main_tids else 'other'} thread]"
            by_op[key] = by_op.get(key, 0) + 1
        out["by_op"] = by_op
    return out


def _union(intervals):
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _overlap(s, e, union) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in union)


def stream_overlap(events: list[dict]) -> dict:
    """Side-stream GPU work vs the compute stream in one trace.

    The compute stream is the stream with the most kernel time. For every other stream, its kernels,
    memcpys and memsets (the FSDP side streams' copies and casts) are intersected with the union of
    the compute stream's kernel intervals: ``overlap_fraction`` = overlapped time / side-stream time
    (1.0: all side-stream work hidden behind compute; ``None`` when there is no side-stream work)."""
    gpu = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        and isinstance(e.get("args"), dict)
        and "stream" in e["args"]
    ]
    per: dict = {}
    for e in gpu:
        per.setdefault(e["args"]["stream"], []).append(e)
    if not per:
        return {"streams": 0, "side_us": 0.0, "overlap_fraction": None}
    busy = {s: sum(float(e.get("dur", 0.0)) for e in es if e.get("cat") == "kernel") for s, es in per.items()}
    compute = max(busy, key=busy.get)
    union = _union([_span(e) for e in per[compute] if e.get("cat") == "kernel"])
    side_us = over_us = 0.0
    side: dict = {}
    for s, es in per.items():
        if s == compute:
            continue
        t = sum(float(e.get("dur", 0.0)) for e in es)
        o = sum(_overlap(*_span(e), union) for e in es)
        side[str(s)] = {"events": len(es), "us": round(t, 1), "overlapped_us": round(o, 1)}
        side_us += t
        over_us += o
    return {
        "streams": len(per),
        "compute_stream": compute,
        "compute_kernel_us": round(busy[compute], 1),
        "side_us": round(side_us, 1),
        "side": side,
        "overlap_fraction": round(over_us / side_us, 4) if side_us else None,
    }


def profile(dev: torch.device):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as _profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    return _profile(activities=acts)


def sync_controls(dev: torch.device) -> dict:
    """Two positive controls of the sync counter: ``x.item()`` and ``torch.cuda.Event().synchronize()``
    must each register >= 1 synchronizing call (else the counter is blind and a 0 means nothing)."""
    from torch.profiler import record_function

    with profile(dev) as prof:
        x = torch.ones(1, device=dev)
        with record_function("ctl::item"):
            float(x.item())
        with record_function("ctl::event_synchronize"):
            if dev.type == "cuda":
                ev = torch.cuda.Event()
                ev.record()
                ev.synchronize()
    ev_ = trace_events(prof)
    out = {
        "item": sync_calls_in(ev_, "ctl::item"),
        "event_synchronize": sync_calls_in(ev_, "ctl::event_synchronize"),
    }
    out["counter_sees_syncs"] = all(v["calls"] >= 1 for v in out.values()) if dev.type == "cuda" else None
    return out


def write_stdout_json(data: dict) -> None:
    print(json.dumps(data, default=str), flush=True)


def run_bench_json(cmd: list[str], limit: float, summarize, cwd: str) -> dict:
    """Run a ``raggedfsdp bench ... --json`` command line ``cmd`` (``[python, -m, module, ...]``) for at
    most ``limit`` seconds in its own session (on a timeout the whole group -- the CLI, torchrun and
    the ranks -- is killed, so no orphaned rank keeps the GPU busy during the next case) and return
    ``{"rc", "wall_s", "cmd"}`` plus ``summarize(<the last JSON line>)``, or ``"error"`` and ``"tail"``
    (the last lines of its output) when it timed out, failed or printed no JSON."""
    shown = " ".join(cmd[3:])
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        return {"error": f"timeout after {limit:.0f} s", "tail": stderr.splitlines()[-10:], "cmd": shown}
    r: dict = {"rc": p.returncode, "wall_s": round(time.monotonic() - t0, 1), "cmd": shown}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        r["error"] = f"rc {p.returncode}"
        r["tail"] = (stdout + stderr).splitlines()[-20:]
        return r
    r.update(summarize(json.loads(lines[-1])))
    return r
