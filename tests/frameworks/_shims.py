"""CPU shims for the framework tests (tests/frameworks), applied identically to the torch run and the
raggedfsdp run of the same script. Each one makes a framework take on gloo CPU ranks the path it takes
on GPUs; none touches sharding.

* :func:`accelerate_fsdp_on_cpu`: accelerate (1.16) keeps ``distributed_type=MULTI_CPU`` and drops the
  FSDP plugin on CPU ranks (``AcceleratorState.__init__`` takes its FSDP branch only for ``MULTI_GPU``,
  ``MULTI_XPU``, ...); the shim sets ``DistributedType.FSDP`` and the plugin it was given after each
  ``AcceleratorState()`` (each one re-copies ``PartialState``'s type), so ``Accelerator.prepare`` and
  the HF Trainer call ``fully_shard`` as they do on GPUs.
* :func:`torchtitan_on_cpu`: torchtitan (0.3.0) falls back to ``device_type = "cuda"`` without an
  accelerator (``torchtitan.tools.utils``), so its meshes are built on ``"cpu"`` instead; the MoE token
  dispatcher imports Triton kernels at module level (``minimal_async_ep.kernels``; not used without EP
  > 1), so that module is replaced by a stub whose functions raise; ``torchtitan.trainer`` (imported
  by ``Decoder.Config.update_from_config`` only for an ``isinstance(config, Trainer.Config)`` check)
  pulls ``datasets`` / ``tensorboard``, so it is replaced by a stub whose ``Trainer.Config`` nothing is
  an instance of (the documented non-trainer caller path of ``update_from_config``).
"""

from __future__ import annotations

import inspect
import sys
import types


def accelerate_fsdp_on_cpu() -> None:
    """Let accelerate's FSDP plugin apply on gloo CPU ranks (see the module docstring). Idempotent."""
    from accelerate import state as acc_state
    from accelerate.utils import DistributedType

    orig = acc_state.AcceleratorState.__init__
    if getattr(orig, "_cpu_fsdp_shim", False):
        return
    sig = inspect.signature(orig)

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        # every AcceleratorState() re-copies PartialState's MULTI_CPU: keep FSDP while a plugin is set
        plugin = sig.bind(self, *args, **kwargs).arguments.get("fsdp_plugin") or getattr(
            self, "fsdp_plugin", None
        )
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    __init__._cpu_fsdp_shim = True
    acc_state.AcceleratorState.__init__ = __init__


def _stub_module(name: str, **attrs) -> None:
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def torchtitan_on_cpu() -> None:
    """torchtitan on CPU ranks (see the module docstring); call before importing torchtitan's models."""

    def _no_triton(*args, **kwargs):
        raise RuntimeError("torchtitan's Triton EP kernels are stubbed out in this CPU test")

    def _kernels_getattr(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _no_triton

    _stub_module("torchtitan.distributed.minimal_async_ep.kernels", __getattr__=_kernels_getattr)

    class Trainer:  # torchtitan.trainer.Trainer stand-in: nothing passed in is a Trainer.Config
        class Config:
            pass

    _stub_module("torchtitan.trainer", Trainer=Trainer)
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    parallel_dims.device_type = "cpu"
