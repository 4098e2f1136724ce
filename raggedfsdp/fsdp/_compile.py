"""torch.compile: raggedfsdp's FSDP hooks run eagerly and are never traced (as FSDP2's are).

The hooks unshard/reshard (all-gathers into flat buffers whose storage is resized), register
autograd hooks and keep per-iteration state: none of it belongs in a graph. Traced, inductor fails
on the storage resize (``LoweringException: AssertionError: TODO: dynamic shapes`` at
``inductor.resize_storage_bytes_``). torch's FSDP2 wraps the same hooks in
``torch._dynamo.disable(func, recursive=True, reason="skipping FSDP hooks")`` at every call
(``torch/distributed/fsdp/_fully_shard/_fsdp_common.py: _dynamo_disable``). :func:`dynamo_disable`
does the same through the public ``torch.compiler.disable``, but only while dynamo traces (where
``torch.compiler.is_compiling()`` is True): in eager runs the hook is called directly, so a job
that never compiles neither imports ``torch._dynamo`` nor pays the wrapper.

Under dynamo, a call to a wrapped hook is a graph break: whole-model ``torch.compile(model)``
gives one graph per block body (hooks run between them). A hook that dynamo meets as a new frame
(``nn.Module._call_impl`` is in dynamo's skip list, so every hook call is one) must not be traced
at all under ``fullgraph=True`` (a graph break there is an error): :func:`eager_hook` registers
the hook itself as ``torch.compiler.disable``'d when ``torch._dynamo`` is already imported, which
``torch.compile(block, fullgraph=True)`` / ``block.compile(fullgraph=True)`` before ``fully_shard``
guarantee. (Compiling a block in place with ``fullgraph=True`` only AFTER ``fully_shard`` in a
process that had not imported dynamo yet raises dynamo's "Attempted to call function marked as
skipped": compile blocks before ``fully_shard``, or the whole model after it.)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable)
REASON = "raggedfsdp FSDP hooks run eagerly (unshard/reshard, autograd hooks)"


def dynamo_disable(fn: _F) -> _F:
    """``fn``, skipped by dynamo (``torch.compiler.disable(fn, recursive=True)``) while compiling."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn, recursive=True, reason=REASON)(*args, **kwargs)
        return fn(*args, **kwargs)

    wrapper.__raggedfsdp_dynamo_disable__ = True
    return wrapper  # type: ignore[return-value]


def eager_hook(hook: _F) -> _F:
    """``hook`` as registered on a module: ``torch.compiler.disable(hook)`` when dynamo is loaded, else as is.

    Checking ``sys.modules`` keeps eager-only jobs from importing ``torch._dynamo`` (seconds).
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(hook, recursive=True, reason=REASON)
    return hook
