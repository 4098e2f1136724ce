"""Cluster descriptions for :mod:`raggedfsdp.app.sizing.steptime`: one accelerator kind and its interconnect.

Presets name their sources (vendor datasheets; achievable NCCL bus bandwidths from nccl-tests); the
``cpu`` preset is a placeholder that ``raggedfsdp estimate-time --calibrate`` fits to the local box.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CLUSTERS", "Cluster"]


@dataclass(frozen=True)
class Cluster:
    """One accelerator kind and its interconnect. All per device; bandwidths are achievable bus
    bandwidths (bytes/s, what NCCL's ``busbw`` reports), not link maxima."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s per device (datasheet)."""
    hbm_bw: float
    """Memory bandwidth per device, bytes/s."""
    hbm_bytes: float
    """Device memory, bytes."""
    intra_bw: float
    """Collective bus bandwidth within a node, bytes/s per device."""
    inter_bw: float
    """Collective bus bandwidth across nodes, bytes/s per device (its NIC share)."""
    intra_lat: float = 5e-6
    """Per ring step inside a node, seconds."""
    inter_lat: float = 15e-6
    """Per ring step across nodes, seconds."""
    devices_per_node: int = 8
    mfu: float = 0.5
    """Achieved fraction of ``peak_flops`` on the model's matmuls (calibrated, or a typical value)."""
    host_s_per_unit: float = 60e-6
    """CPU time per FSDP unit per phase (hooks, launches), seconds."""
    host_s_per_tensor: float = 0.0
    """CPU time per parameter tensor per phase (forward, backward, optimizer step: per-tensor DTensor
    dispatch, autograd nodes, foreach kernels' per-tensor work), seconds. 0 in the GPU presets (at
    their sizes it hides under the device's work); fitted by calibrate() on a CPU host, where it is
    what makes a many-small-tensor MoE slower than its FLOPs say."""
    shared_host: bool = False
    """One CPU host (the ``cpu`` preset): every rank runs on this one machine and its
    ``devices_per_node`` *cores* are the devices (all groups use the intra-node constants). Ranks
    beyond the cores time-share them: the elapsed step is the per-rank work (``StepTime.work_s``, what
    a rank's CPU clock counts) x ranks / cores, and other jobs on the machine slow it further."""
    overlap: bool = True
    """Whether communication overlaps compute (False on CPU: gloo and compute share the cores)."""
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        Cluster(
            "h100",
            peak_flops=989e12,
            hbm_bw=3.35e12,
            hbm_bytes=80e9,
            intra_bw=360e9,
            inter_bw=45e9,
            source="NVIDIA H100 SXM datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB); NVLink 4 "
            "450 GB/s per direction, ~360 GB/s NCCL busbw; 8x 400 Gb/s ConnectX-7 = 50 GB/s per GPU, "
            "~45 GB/s busbw (nccl-tests on DGX H100)",
        ),
        Cluster(
            "h200",
            peak_flops=989e12,
            hbm_bw=4.8e12,
            hbm_bytes=141e9,
            intra_bw=360e9,
            inter_bw=45e9,
            source="NVIDIA H200 SXM datasheet (989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, 141 GB); same "
            "NVLink 4 and NICs as DGX H100",
        ),
        Cluster(
            "b200",
            peak_flops=2.25e15,
            hbm_bw=8e12,
            hbm_bytes=180e9,
            intra_bw=720e9,
            inter_bw=45e9,
            source="NVIDIA HGX B200 datasheet (2.25 PFLOP/s dense bf16, 8 TB/s HBM3e, 180 GB); NVLink 5 "
            "900 GB/s per direction, ~720 GB/s busbw; 400 Gb/s NIC per GPU",
        ),
        Cluster(
            "cpu",
            peak_flops=50e9,
            hbm_bw=10e9,
            hbm_bytes=24e9,
            intra_bw=1e9,
            inter_bw=0.1e9,
            intra_lat=50e-6,
            inter_lat=200e-6,
            devices_per_node=2,
            mfu=1.0,
            host_s_per_unit=200e-6,
            host_s_per_tensor=50e-6,
            overlap=False,
            shared_host=True,
            source="placeholder for one CPU box with gloo, one thread per rank, devices_per_node = its cores "
            "(set it to os.cpu_count(); --calibrate does), predicting a rank's CPU seconds per step (work_s) "
            "and the elapsed step (x ranks / cores beyond the cores); fit it with calibrate() "
            "(raggedfsdp estimate-time --calibrate)",
        ),
    )
}
