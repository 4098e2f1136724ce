"""Imported at start-up by every Python process of a ``benchmarks/torch_suite.py`` run (this folder is
put first on ``PYTHONPATH``), so the spawned ranks of torch's ``MultiProcessTestCase`` get the same
patches as the parent. Does nothing unless ``RAGGEDFSDP_TORCH_SUITE`` is set:

* ``RAGGEDFSDP_TORCH_SUITE=ours``: ``raggedfsdp.patch_torch()`` (``torch.distributed.fsdp.fully_shard``, its
  re-exports under ``torch.distributed._composable.fsdp`` and ``share_comm_ctx`` are raggedfsdp's);
  ``=torch`` keeps torch's (the baseline run, same CPU setup).
* CPU ranks for GPU-only test classes: ``skip_if_lt_x_gpu(n)`` no longer skips, and
  ``torch.cuda/cpu/accelerator.device_count()`` (``current_accelerator()`` is the CPU) and common_fsdp's
  ``DEVICE_COUNT``
  report ``RAGGEDFSDP_TORCH_SUITE_RANKS`` (default 2), so ``world_size`` properties give that many gloo
  ranks (with ``RAGGEDFSDP_TORCH_SUITE_DYNAMO``, ``--dynamo``, ``torch.accelerator.is_available()``
  stays False, as dynamo needs); the DDP reference ``replicate(cpu_module, device_ids=[rank])`` drops
  ``device_ids`` (DDP refuses them for CPU modules). Tests that hard-code ``"cuda"`` still fail
  (classified "environment").
"""

import os

_impl = os.environ.get("RAGGEDFSDP_TORCH_SUITE")
if _impl:
    import functools

    import torch

    _ranks = int(os.environ.get("RAGGEDFSDP_TORCH_SUITE_RANKS", "2"))
    if not torch.cuda.is_available():
        torch.cuda.device_count = lambda: _ranks
        torch.cpu.device_count = lambda: _ranks  # torch.get_device_module("cpu").device_count()
        if hasattr(torch, "accelerator"):
            torch.accelerator.device_count = lambda: _ranks
            if torch.accelerator.current_accelerator() is None:  # module-level device_type lookups
                torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cpu")
                if os.environ.get("RAGGEDFSDP_TORCH_SUITE_DYNAMO"):  # --dynamo: the real answer, False;
                    # dynamo's tracer otherwise asks the fake CPU accelerator for its current stream
                    torch.accelerator.is_available = lambda: False
    import torch.testing._internal.common_distributed as _cd

    def _skip_if_lt_x_gpu(x, *, allow_cpu=False):
        def deco(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                return func(*args, **kwargs)

            return wrapper

        return deco

    _cd.skip_if_lt_x_gpu = _skip_if_lt_x_gpu
    import torch.distributed._composable as _comp

    _orig_replicate = _comp.replicate

    @functools.wraps(_orig_replicate)
    def _replicate(module, *args, **kwargs):  # the DDP reference: CPU modules take no device_ids
        if kwargs.get("device_ids") is not None and all(p.device.type == "cpu" for p in module.parameters()):
            kwargs["device_ids"] = None
        return _orig_replicate(module, *args, **kwargs)

    _comp.replicate = _replicate
    import torch.testing._internal.common_fsdp as _cf

    if _cf.DEVICE_TYPE == "cpu":
        _cf.DEVICE_COUNT = _ranks
    if _impl == "ours":  # the documented one-line switch (raggedfsdp/fsdp/_switch.py), never undone here
        import raggedfsdp

        raggedfsdp.patch_torch()
