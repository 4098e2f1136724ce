"""Per-parameter book-keeping and the unit's explicit states (with cheap invariant checks).

Note [FSDP tensors]
    For each managed parameter ``p`` of global shape ``shape``:

    * sharded param   -- ``nn.Parameter(DTensor)`` with placement ``RaggedShard(dims, local_units)``
      (HSDP: ``(Replicate(), RaggedShard(...))``); its local tensor is a 1-D view into the unit's
      sharded DBuffer. This is what ``module.parameters()`` and the optimizer see outside forward
      and backward.
    * unsharded param -- a plain ``nn.Parameter`` of ``shape`` in ``param_dtype`` whose data is a view
      into the unsharded DBuffer; registered on the module while it is unsharded (forward/backward).
    * unsharded grad  -- autograd's own tensor (``.grad`` of the unsharded param, as in FSDP2) until the
      unit's post-backward folds it into the flat grad DBuffer, the reduce-scatter input, with one
      multi-tensor copy and drops it (Note [grad fold] in ``_grads.py``). Only a no-sync window holding
      ``param_dtype`` grads pre-sets ``.grad`` to views of that buffer, so micro-batches add in place.
    * sharded grad    -- a RaggedShard DTensor view into the sharded grad DBuffer, set as the sharded
      param's ``.grad`` when backward ends (lazily, once every rank's used-parameter flags are known).

    For a parameter that already was a DTensor on another dim of the same root mesh (tensor / expert
    parallel, Note [FSDP x TP] in ``_tp.py``) ``shape`` is its TP-local shape (what is planned and
    gathered), the sharded param is one DTensor on the concatenated (dp..., tp...) mesh with
    placements ``(RaggedShard, *tp_placements)`` (HSDP: ``(Replicate(), RaggedShard, *tp)``) and the
    unsharded param is the TP-local DTensor (``wrap_unsharded``), as FSDP2 builds them.

    Freeing unsharded storage resizes it to 0 bytes (torch FSDP2's trick, see
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``): the tensor objects and the aliases
    autograd saved stay valid, and the in-place all-gather refills them without bumping their version
    counters (``_unsafe_preserve_version_counter``).

    Who writes what: :class:`~raggedfsdp.fsdp._param_group.FSDPParamGroup` is the only writer of a
    unit's ``ParamState`` and gather fields, :class:`~raggedfsdp.fsdp._grads.UnitGrads` (composed into
    it as ``group.grads``) the only writer of its ``GradState`` and gradient fields; the reduce records
    of ``_reduce.py`` change them only through their transition methods
    (``tests/unit/test_fsdp_one_writer.py`` keeps it so).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import itertools
import operator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp._compat import subclass_torch_function_off
from raggedfsdp.buffer.streams import debug_enabled


class ParamState(enum.Enum):
    """Where a unit's parameters are (FSDP2: ``ShardedState``)."""

    SHARDED = "sharded"  # sharded DTensors registered; the unsharded buffer freed or kept (ZeRO-1)
    UNSHARDING = "unsharding"  # all-gather in flight into the allocated unsharded buffer
    UNSHARDED = "unsharded"  # unsharded params registered on the modules


class GradState(enum.Enum):
    """What a unit's unsharded gradient buffers hold."""

    NONE = "none"  # no unsharded grad storage
    ACCUMULATING = "accumulating"  # pre-backward ran; grads go into buffer views (allocated at the first)
    HELD = "held"  # no-sync: accumulated grads kept for the next synced backward
    REDUCING = "reducing"  # a reduce-scatter reads them (a PendingReduce in the root's queue)


class TrainingState(enum.Enum):
    """Where one FSDP state (one ``fully_shard``'ed module) is in the backward of an iteration (FSDP2:
    ``TrainingState`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``; forward needs no value
    here because a recomputed forward, activation checkpointing, runs inside backward)."""

    IDLE = "idle"  # no backward hook ran since the iteration began
    PRE_BACKWARD = "pre_backward"  # its pre-backward ran (unsharded, grads open), post-backward not yet
    POST_BACKWARD = "post_backward"  # its post-backward ran (reduce launched); a later pre-backward reopens


AGREEMENT_CHECKS = ("auto", "immediate", "deferred")


@dataclass
class RuntimeOptions:
    """Knobs of the FSDP runtime, one object per root (on its ``CommContext``); set them with
    :func:`raggedfsdp.fsdp.set_runtime_options` (every rank the same values).

    * ``early_free``: complete finished reduce-scatters at the gradient hooks (up to 8 per unit) and
      free their inputs early (Note [early free] in ``_reduce.py``); ``False`` is the slow-network
      worst case.
    * ``agreement_check``: when the unit-agreement result is read (Note [unit agreement] in
      ``_agreement.py``): ``"auto"`` (deferred on CUDA when no flag is needed), ``"immediate"``, or
      ``"deferred"`` (always defer; the CPU tests of the late error use it).
    * ``debug``: check every collective's unit before it runs; ``None`` follows the buffer layer's
      switch (env ``RAGGEDFSDP_DEBUG``, ``raggedfsdp.buffer.set_debug``), which also drives the
      buffers' lifetime checks (Note [stream invariant]).
    """

    early_free: bool = True
    agreement_check: str = "auto"
    debug: bool | None = None

    def debug_on(self) -> bool:
        return debug_enabled() if self.debug is None else self.debug


class CollectiveMismatchError(RuntimeError):
    """The ranks of a mesh ran different FSDP units (or in a different order) since the last check, so
    collectives of different units paired up (Note [unit agreement] in ``_agreement.py``)."""


class FSDPValueError(ValueError, AssertionError):
    """A ``ValueError`` for a misuse that torch's ``fully_shard`` refuses with ``AssertionError`` (a 2-D
    mesh without dim names, ``fully_shard`` twice on one module): ``except`` clauses and tests written
    for either library catch it."""


class FSDPTypeError(TypeError, ValueError):
    """A ``TypeError`` for an argument of the wrong type that torch's ``fully_shard`` refuses with
    ``ValueError`` (``reshard_after_forward="yes"``, a bad ``shard_placement_fn`` result)."""


class FSDPDeepcopyError(RuntimeError, AssertionError):
    """``copy.deepcopy`` of a sharded module (torch raises ``AssertionError``)."""


class InvariantError(RuntimeError):
    """A broken internal invariant of the FSDP runtime (a bug, never a user error)."""


def state_of(module: nn.Module):
    """The raggedfsdp ``FSDPState`` that ``fully_shard`` put on ``module`` itself, else ``None``. Read from
    the instance ``__dict__``, not with ``getattr``: a wrapper that forwards attribute lookups to its
    inner module (``CheckpointWrapper.__getattr__``, accelerate / the HF Trainer's activation
    checkpointing) must not look sharded because its inner module is. Local."""
    return module.__dict__.get("_raggedfsdp_state")


def labelled(name: str):
    """``torch.profiler.record_function(name)`` while a profiler runs, else a no-op: names the FSDP
    work that allocates each buffer in traces and in ``PeakMemory(breakdown=...)`` (as FSDP2's
    ``FSDP::all_gather (unit)`` labels do), at no cost outside profiling."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def check(cond: bool, msg: str) -> None:
    """Cheap always-on invariant check."""
    if not cond:
        raise InvariantError(f"raggedfsdp internal invariant violated: {msg}")


@dataclass
class FSDPParam:
    """Book-keeping for one managed parameter (see Note [FSDP tensors])."""

    fqn: str  # relative to the fully_shard'ed module
    owners: list[tuple[nn.Module, str]]  # every (module, attr) that holds this parameter
    shape: torch.Size  # planned shape: global, or a TP DTensor's local shape (Note [FSDP x TP])
    dtype: torch.dtype  # original
    requires_grad: bool
    granularity: int  # elements per block (never cut by a rank boundary)
    dims: tuple[int, ...]  # RaggedShard dims
    sharded: nn.Parameter = None  # type: ignore[assignment]  # DTensor param
    unsharded: nn.Parameter | None = None  # view into the unsharded DBuffer
    grad_view: torch.Tensor | None = None  # view into the unsharded grad DBuffer
    sharded_grad: DTensor | None = None  # DTensor view into the sharded grad DBuffer
    sharded_grad_base: torch.Tensor | None = None  # the buffer ``sharded_grad`` was checked against
    spec: DTensorSpec | None = None
    got_grad: bool = False  # autograd accumulated into the unsharded grad since the last reduce
    hooked: bool = False  # the unsharded param's gradient pre-hook is registered (Note [grad hooks])
    tp_spec: DTensorSpec | None = None  # the param's own DTensor spec (TP/EP mesh) before fully_shard
    # dp_mesh_dims (Note [dp_mesh_dims] in _init.py): the param's spec on the full SPMD mesh (Replicate on
    # the DP dims), which the unsharded param keeps, and the indices of the DP dims in it
    spmd_spec: DTensorSpec | None = None
    dp_dims: frozenset[int] = frozenset()

    @property
    def global_shape(self) -> torch.Size:
        """The logical (global) shape of the parameter (``shape`` unless it is a TP DTensor)."""
        return self.tp_spec.shape if self.tp_spec is not None else self.shape

    def wrap_unsharded(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a view of the planned shape) as the tensor the module computes with: plain, or for a TP
        parameter the TP-local DTensor on its TP mesh with the param's TP placements (FSDP2's
        ``init_unsharded_param``), so TP's own hooks and redistributes keep working. Local."""
        own = self.spmd_spec if self.spmd_spec is not None else self.tp_spec
        if own is None:
            return t
        meta = own.tensor_meta
        spec = DTensorSpec(own.mesh, own.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, t.dtype))
        return DTensor(t, spec, requires_grad=False)

    def local_grad(self, g: torch.Tensor) -> torch.Tensor:
        """The plain gradient of the planned shape from autograd's ``g`` (for a TP parameter a DTensor,
        redistributed to the param's TP placements first if autograd left it e.g. ``Partial``, as FSDP2's
        post-backward does). Collective over the TP mesh only in that redistribute case."""
        if not isinstance(g, DTensor):
            return g
        if self.spmd_spec is not None:  # as FSDP2's _get_grad_inner_tensor: only the non-DP dims are
            # redistributed; a Partial on a DP dim is left to the reduce-scatter / all-reduce
            own = tuple(self.spmd_spec.placements)
            want = tuple(g.placements[i] if i in self.dp_dims else own[i] for i in range(len(own)))
            if want != tuple(g.placements):
                g = g.redistribute(self.spmd_spec.mesh, want)
        elif self.tp_spec is not None and tuple(g.placements) != tuple(self.tp_spec.placements):
            g = g.redistribute(self.tp_spec.mesh, self.tp_spec.placements)
        return g._local_tensor

    def set_on_owners(self, value: nn.Parameter) -> None:
        for module, name in self.owners:
            module._parameters[name] = value


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


# C-level getters for the per-step hot path (an MoE layer holds hundreds of params):
# ``map(getter, tensors)`` runs the loop in C, with no Python frame or bytecode per parameter
REQUIRES_GRAD = operator.attrgetter("requires_grad")
GRAD = operator.attrgetter("grad")
VERSION = operator.attrgetter("_version")
POST_ACCUMULATE_GRAD_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


@functools.cache
def _subclass_tf_off():
    return subclass_torch_function_off()  # at first use: importing raggedfsdp reads no torch internal


def attr_scan():
    """A context for the per-step scans of the sharded ``DTensor`` params' ``requires_grad`` / ``grad`` /
    ``_version``: it turns subclass ``__torch_function__`` off (``_compat.subclass_torch_function_off``),
    so each read skips DTensor's ``__torch_function__`` lookup (2.7x cheaper; the values are the same:
    DTensor's ``__torch_function__`` is torch's disabled one). Only attribute reads and writes of our own
    tensors go inside, never a tensor op. Local."""
    return _subclass_tf_off()()


def all_none(values) -> bool:
    """True if every item of ``values`` is ``None``, by identity, the loop in C (``list.count(None)``
    would call ``Tensor.__eq__`` on every tensor: a dispatch each, DTensor's sharding propagation). Local."""
    return not any(map(operator.is_not, values, itertools.repeat(None)))


def assign_each(objs, attr: str, values) -> None:
    """``setattr(o, attr, v)`` for each ``o`` of ``objs`` and ``v`` of ``values`` (an iterable, e.g.
    ``itertools.repeat(None)``), the loop in C. A write of ``attr`` for the one-writer rule
    (``tests/unit/test_fsdp_one_writer.py`` counts it as one). Local."""
    collections.deque(map(setattr, objs, itertools.repeat(attr), values), maxlen=0)


class ParamTensors:
    """A unit's param tensors as flat lists, for the hooks' per-step work as C-level loops.

    ``sharded`` / ``unsharded``: each :class:`FSDPParam`'s tensors in unit order; ``recorded``: their
    recorded ``requires_grad``. Built by ``FSDPParamGroup._init_unsharded`` -- the one place (after
    ``_init_sharded``, and again after ``reset_sharded_storage`` / ``adopt_registered_params``) where a
    unit's sharded or unsharded params are (re)created -- and only read elsewhere. Owner slots hold each
    owning module's ``_parameters`` dict (one per tied owner), as FSDP2's ``unsafe_setattr_param``
    writes it. Local.
    """

    def __init__(self, fps: list[FSDPParam]):
        self.sharded = [fp.sharded for fp in fps]
        self.unsharded = [fp.unsharded for fp in fps]
        self.recorded = [fp.requires_grad for fp in fps]
        slots = [(module._parameters, name, i) for i, fp in enumerate(fps) for module, name in fp.owners]
        self._dicts = [d for d, _, _ in slots]
        self._names = [n for _, n, _ in slots]
        self._on_owners = {
            "sharded": [self.sharded[i] for _, _, i in slots],
            "unsharded": [self.unsharded[i] for _, _, i in slots],
        }

    def register(self, which: str) -> None:
        """Put the ``which`` (``"sharded"`` / ``"unsharded"``) tensors on every owning module
        (``FSDPParam.set_on_owners`` for all, one C-level loop). Local."""
        collections.deque(map(operator.setitem, self._dicts, self._names, self._on_owners[which]), maxlen=0)

    def requires_grad_unchanged(self) -> bool:
        """True if no sharded or unsharded param's ``requires_grad`` differs from the recorded one (the
        per-step case of ``FSDPParamGroup.refresh_requires_grad``). Local."""
        rec = self.recorded
        with attr_scan():
            return rec == list(map(REQUIRES_GRAD, self.sharded)) and rec == list(
                map(REQUIRES_GRAD, self.unsharded)
            )

    def unsharded_requires_grad_unchanged(self) -> bool:
        """True if no unsharded param's ``requires_grad`` differs from the recorded one (plain tensors: a
        third of the DTensor scan's cost). Local."""
        return self.recorded == list(map(REQUIRES_GRAD, self.unsharded))

    def any_requires_grad(self) -> bool:
        """True if some sharded param requires grad now (short-circuits). Local."""
        with attr_scan():
            return any(map(REQUIRES_GRAD, self.sharded))

    def sharded_version(self) -> int:
        """Sum of the sharded params' version counters (in-place writes to the master). Local."""
        with attr_scan():
            return sum(map(VERSION, self.sharded))

    def clear_unsharded_grads(self) -> None:
        """``.grad = None`` on every unsharded param that holds one. Local."""
        if not all_none(map(GRAD, self.unsharded)):
            assign_each(self.unsharded, "grad", itertools.repeat(None))
