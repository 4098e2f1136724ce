"""The peak-memory method (raggedfsdp.app.bench.memory.PeakMemory) against known allocations and RSS.

Known allocations: fresh tensors, a storage freed and regrown with ``untyped_storage().resize_``
(how DBuffer and FSDP2 free unsharded buffers), a kernel's internal temporary, windows split with
``reset()``. RSS: a subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps and unmaps
every block >= 64 KiB at once, so the resident set follows live bytes) compares the peak to the
VmHWM growth, reset through ``/proc/self/clear_refs``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from raggedfsdp.app.bench.memory import (
    PeakMemory,
    enable_cpu_allocator_accounting,
    live_tensor_bytes,
    measure_train_step,
    storage_bytes,
)


@pytest.fixture(autouse=True, scope="module")
def _accounting():
    enable_cpu_allocator_accounting()  # what a measuring process does first (docs/memory.md)


F32 = 4


def test_known_allocations_and_resize_cycle():
    with PeakMemory("cpu") as m:
        a = torch.empty(1000)  # +4000
        b = torch.empty(2000)  # +8000 -> 12000
        st = b.untyped_storage()
        st.resize_(0)  # -8000 -> 4000 (a TorchDispatchMode never sees this)
        c = torch.empty(500)  # +2000 -> 6000
        st.resize_(2000 * F32)  # +8000 -> 14000  (peak)
        del a  # -4000 -> 10000
        d = torch.empty(100)  # +400 -> 10400
    assert m.peak_bytes == 14000, m
    assert m.end_bytes - m.baseline_bytes == 10400, m
    assert len(m.windows) == 1
    assert storage_bytes([b, b[:3], c, d, None]) == 8000 + 2000 + 400


def test_resize_cycle_peak_is_seen_inside_a_region_that_frees_net():
    x = torch.empty(250_000)  # 1 MB, allocated before the region
    with PeakMemory() as m:
        x.untyped_storage().resize_(0)  # -1 MB
        y = torch.empty(100_000)  # +0.4 MB: still below the baseline
        x.untyped_storage().resize_(250_000 * F32)  # +1 MB: 0.4 MB above the baseline
        x.untyped_storage().resize_(0)
        del y
    assert m.peak_bytes == 400_000, m
    assert m.end_bytes - m.baseline_bytes == -1_000_000
    assert m.baseline_bytes >= 1_000_000  # the gc scan saw x


def test_kernel_temporaries_and_windows():
    a = torch.randn(64, 64)
    with PeakMemory() as m:
        s = (a @ a).sum()  # the 64x64 product is a temporary freed inside the statement
        m.reset()
        keep = torch.empty(10)
        m.reset()
        del keep
    w0, w1, w2 = m.windows
    assert w0.peak_bytes >= 64 * 64 * F32 and w0.end_bytes - w0.baseline_bytes == s.nbytes
    assert w1 == (w0.end_bytes, 40, w0.end_bytes + 40)
    assert w2.peak_bytes == 0 and w2.end_bytes == w0.end_bytes
    assert (m.baseline_bytes, m.peak_bytes, m.end_bytes) == tuple(w2)


def test_errors():
    with pytest.raises(TypeError, match="torch.device or a string"):
        PeakMemory(0)
    m = PeakMemory()
    with pytest.raises(RuntimeError, match="outside"):
        m.reset()
    with m:
        with pytest.raises(RuntimeError, match="already active"):
            m.__enter__()
        with pytest.raises(RuntimeError), PeakMemory():  # a second profiler session
            pass
    with pytest.raises(ValueError, match="warmup_steps"):
        measure_train_step(lambda: None, lambda m: None, warmup_steps=0)


def test_measure_train_step_counts_state_and_grads():
    torch.manual_seed(0)
    x = torch.randn(8, 256)

    def build():
        model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of weights
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    r = measure_train_step(build, lambda m: m(x).square().sum())
    w = 256 * 256 * F32
    assert r.state_bytes == 2 * w  # weight + momentum buffer (grads set to None)
    assert 3 * w <= r.fwd_bwd_peak_bytes <= 3 * w + 64 * 1024  # + the new grad + small activations
    assert r.optim_peak_bytes >= 3 * w  # the grad is live during the step
    assert r.end_bytes == 2 * w


def test_frees_on_other_threads_are_counted():
    """gloo frees collective scratch on its worker thread; c10's process-wide accounting sees it."""
    import threading

    assert enable_cpu_allocator_accounting(), "c10 flag not exported by this torch build"
    holder = [None]

    def drop():
        holder.clear()  # the last reference dies on this thread

    with PeakMemory() as m:
        holder[0] = torch.empty(500_000)  # +2 MB on the profiled thread
        t = threading.Thread(target=drop)
        t.start()
        t.join()
        m.reset()
        y = torch.empty(1000)  # the next window starts after the other thread's free
    (w0, w1) = m.windows
    assert w0.peak_bytes == 2_000_000 and w0.end_bytes == w0.baseline_bytes, w0
    assert w1.end_bytes - w1.baseline_bytes == 4000 and w1.peak_bytes == 4000, w1
    del y


def test_gc_scan_sees_python_held_tensors():
    before = live_tensor_bytes()
    t = torch.empty(1_000_000)
    assert live_tensor_bytes() - before >= 4_000_000
    del t


_RSS_SCRIPT = textwrap.dedent(
    """
    import torch
    from raggedfsdp.app.bench.memory import PeakMemory, enable_cpu_allocator_accounting
    enable_cpu_allocator_accounting()  # before `keep` is allocated: its resize_(0) free must be reported
    torch.set_num_threads(1)

    def rss_hwm():
        f = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(f["VmRSS"].split()[0]) * 1024, int(f["VmHWM"].split()[0]) * 1024

    keep = torch.ones(4_000_000)
    # warm lazy allocations outside torch's allocator (BLAS / oneDNN scratch of these shapes, the profiler)
    with PeakMemory():
        torch.nn.Linear(1024, 1024)(torch.randn(512, 1024)).square().sum().backward()
    with PeakMemory() as m:
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
        rss0, _ = rss_hwm()
        lin = torch.nn.Linear(1024, 1024)
        lin(torch.randn(512, 1024)).square().sum().backward()
        keep.untyped_storage().resize_(0)
        y = torch.ones(6_000_000)
        keep.untyped_storage().resize_(4_000_000 * 4)
        keep.fill_(2.0)  # touch the regrown pages
        del y
        _, hwm = rss_hwm()
    print(m.peak_bytes, hwm - rss0)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
def test_peak_matches_rss_high_water_mark():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    peak, rss_growth = int(out[-2]), int(out[-1])
    print(f"PeakMemory peak {peak / 2**20:.2f} MiB, RSS high-water growth {rss_growth / 2**20:.2f} MiB")
    # the peak: lin's weight + bias and their grads (kept), y (24 MB), keep freed then regrown (net 0)
    assert peak == 2 * (1024 * 1024 + 1024) * 4 + 24_000_000
    # RSS adds page rounding, small-block malloc arenas and the profiler's own buffers
    assert abs(rss_growth - peak) <= 0.05 * peak + 2 * 2**20, (peak, rss_growth)


def test_breakdown_names_the_blocks_live_at_the_peak():
    a = torch.randn(256, 256)
    with PeakMemory(breakdown=3) as m:
        keep = torch.empty(100_000)  # 400 KB, live at the peak
        tmp = a @ a  # 256 KiB, live at the peak
        del tmp
        m.reset()
        small = torch.empty(10)
    (n0, op0), (n1, op1) = m.window_owners[0][:2]
    assert (n0, n1) == (400_000, 256 * 256 * 4) and "empty" in op0 and "mm" in op1, m.window_owners
    assert m.peak_owners == [(40, m.peak_owners[0][1])]
    del keep, small
