"""``patch_torch()``: point the names frameworks import torch's ``fully_shard`` by at raggedfsdp's.

torchtitan, accelerate and the HF Trainer call ``torch.distributed.fsdp.fully_shard`` (accelerate and
the Trainer import it inside their functions; older code imports it from
``torch.distributed._composable.fsdp``). ``raggedfsdp.patch_torch()`` sets every such name to
``raggedfsdp.fully_shard`` (and ``share_comm_ctx`` to raggedfsdp's), so such a framework shards with
raggedfsdp without a code change, as long as it looks the name up after the patch (an import inside
a function does; a module-level ``from torch.distributed.fsdp import fully_shard`` executed before the
patch keeps torch's function: patch first, then import the framework).

What is replaced (module, attribute), all restored by ``handle.undo()`` / ``unpatch_torch()``:

* ``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard``,
  ``torch.distributed.fsdp._fully_shard._fully_shard``, ``torch.distributed._composable.fsdp`` and
  ``torch.distributed._composable.fsdp.fully_shard``: ``fully_shard``;
* the first three: ``share_comm_ctx`` (torch's reads torch's own state and fails on our modules).

Not replaced: ``FSDPModule`` and ``UnshardHandle``. raggedfsdp's classes subclass torch's, so
``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (accelerate's and transformers' checks) is already
true for a raggedfsdp module and stays true for a torch one; replacing the class would make it false
for modules torch sharded and for torch's own ``FSDPModule.__new__`` bookkeeping.
``register_fsdp_forward_method`` and ``disable_fsdp_module_new_init`` are torch's and work on
raggedfsdp's modules unchanged.

torch's own ``fully_shard`` keeps working while patched: its body calls the module global
``fully_shard.state(module)``, which now reaches raggedfsdp's ``fully_shard.state``, and that falls back
to torch's state for a module raggedfsdp did not shard (``_fully_shard.py: _state_of``).
"""

from __future__ import annotations

import importlib
import threading

_NAMES = {
    "torch.distributed.fsdp": ("fully_shard", "share_comm_ctx"),
    "torch.distributed.fsdp._fully_shard": ("fully_shard", "share_comm_ctx"),
    "torch.distributed.fsdp._fully_shard._fully_shard": ("fully_shard", "share_comm_ctx"),
    "torch.distributed._composable.fsdp": ("fully_shard",),
    "torch.distributed._composable.fsdp.fully_shard": ("fully_shard",),
}
_LOCK = threading.Lock()
_ORIGINALS: dict[tuple[str, str], object] = {}  # the values before the outermost active patch
_ACTIVE: list[TorchPatch] = []


def _ours() -> dict[str, object]:
    from raggedfsdp.fsdp._fully_shard import fully_shard
    from raggedfsdp.fsdp._module import share_comm_ctx

    return {"fully_shard": fully_shard, "share_comm_ctx": share_comm_ctx}


class TorchPatch:
    """The handle :func:`patch_torch` returns: ``undo()`` ends this patch (idempotent); also a context
    manager (``with raggedfsdp.patch_torch(): ...`` undoes on exit). Patches nest in any order: torch's
    names are restored when the last active patch is undone."""

    def __init__(self) -> None:
        self.active = True

    def undo(self) -> None:
        """End this patch; when no other patch is active, put torch's own values back. Local."""
        with _LOCK:
            if not self.active:
                return
            self.active = False
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _restore()

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"TorchPatch({'active' if self.active else 'undone'})"


def _restore() -> None:
    for (mod_name, attr), value in _ORIGINALS.items():
        setattr(importlib.import_module(mod_name), attr, value)


def patch_torch() -> TorchPatch:
    """Point torch's ``fully_shard`` (and ``share_comm_ctx``) names at raggedfsdp's (the list in this
    module's docstring) and return a :class:`TorchPatch` handle (``undo()``, or use it as a context
    manager); :func:`unpatch_torch` restores torch's everywhere. Process-local, not collective: call it
    on every rank, before the framework looks the names up. Idea: the module-attribute swap that
    ``unittest.mock.patch`` performs, made reversible by a handle."""
    ours = _ours()
    with _LOCK:
        for mod_name, attrs in _NAMES.items():
            mod = importlib.import_module(mod_name)
            for attr in attrs:
                if not _ACTIVE:  # torch's values now (a name someone else replaced is restored to that)
                    _ORIGINALS[(mod_name, attr)] = getattr(mod, attr)
                setattr(mod, attr, ours[attr])
        handle = TorchPatch()
        _ACTIVE.append(handle)
        return handle


def unpatch_torch() -> None:
    """Restore torch's own ``fully_shard`` / ``share_comm_ctx`` under every name :func:`patch_torch`
    replaced and end every active patch. Local; a no-op when not patched."""
    with _LOCK:
        if not _ACTIVE:
            return
        for h in _ACTIVE:
            h.active = False
        _ACTIVE.clear()
        _restore()


def torch_is_patched() -> bool:
    """Whether ``torch.distributed.fsdp.fully_shard`` is raggedfsdp's now."""
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp.fully_shard is _ours()["fully_shard"]
