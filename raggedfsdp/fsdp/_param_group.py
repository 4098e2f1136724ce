"""One FSDP unit (param group): planned layout, its buffers, and its state machine.

Unshard / reshard live here; the gradient side is :class:`~raggedfsdp.fsdp._grads.UnitGrads`
(``group.grads``), the in-flight reductions ``_reduce.py``, the buffer transitions
:class:`raggedfsdp.buffer.UnitBuffers`. See Note [FSDP tensors] in ``_common.py``.

State machine (``ParamState``, written only here, checked cheaply on every transition; the
``GradState`` machine is in ``_grads.py``)::

    SHARDED --unshard()--> UNSHARDING --wait_for_unshard()--> UNSHARDED --reshard()--> SHARDED

ZeRO-1 / ``reshard_after_backward=False`` keep the unsharded buffer in SHARDED state; it is reused by
the next ``unshard()`` only while the unit's *master version* is unchanged: a per-unit counter bumped by
every ``torch.optim`` step whose param groups contain one of the unit's sharded params and by every
``load_state_dict``, plus the autograd version counters of the sharded params and buffer (which see
single-tensor in-place edits by hand; torch's ``foreach``/``fused`` optimizer kernels on DTensors do
not bump them, hence the counter; nor do writes through ``p.data`` or ``p.to_local()``, checked by hand
on 2.13: after such a write outside an optimizer step call ``module.reshard()`` to drop a kept gather,
as FSDP2, which keeps no version at all, requires after any write). An optimizer step over other
parameters -- an EMA, a probe head, on one rank only -- does not touch it, so every rank of a unit's
group makes the same decision.

Notes [grad fold] and [frozen parameters] are in ``_grads.py`` (the gradient side of a unit).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from raggedfsdp._compat import disable_functorch_if_active, torch_minor
from raggedfsdp.buffer import CommHandle, UnitBuffers
from raggedfsdp.buffer.quant_gather import QuantizedGather
from raggedfsdp.buffer.streams import current_stream
from raggedfsdp.fsdp._comm import CommContext
from raggedfsdp.fsdp._common import FSDPParam, GradState, ParamState, check, contiguous_stride, labelled
from raggedfsdp.fsdp._common import ParamTensors
from raggedfsdp.fsdp._grads import UnitGrads
from raggedfsdp.fsdp._reduce import launch_reduce
from raggedfsdp.fsdp._tp import local_tensor, spmd_mesh, tp_spec_of
from raggedfsdp.fsdp._unit_checks import reshard_replacement, warn_padding
from raggedfsdp.placement import RaggedShard
from raggedfsdp.planner import plan_segments
from raggedfsdp.planner.policy import granularity_for, ragged_dims

COLLECTIVE_ALIGN_BYTES = 16  # NCCL-friendly shard alignment (paper-notes 2.2, "g_coll")


def _mark_units_stepped(optimizer, *_args, **_kwargs) -> None:
    """Global ``torch.optim`` step post-hook: bump the master version of exactly the units whose sharded
    params this optimizer holds. Local, O(params of the optimizer)."""
    refs: dict[int, object] = {}  # the weakref to its unit set on each sharded param (one object per unit),
    for pg in optimizer.param_groups:  # by id: a dead unit's weakref may not be hashable
        got = list(map(getattr, pg["params"], itertools.repeat("_raggedfsdp_unit"), itertools.repeat(None)))
        refs.update(zip(map(id, got), got))
    seen: set[int] = set()
    for ref in refs.values():
        g = ref() if ref is not None else None
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            g.mark_master_changed()


class FSDPParamGroup:
    """All parameters of one ``fully_shard`` call, laid out in one flat buffer per role.

    Args:
        params: managed parameters with their owners.
        mesh: 1-D (shard) or 2-D (replicate, shard) device mesh.
        mp_policy: ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``, ...).
        granularity_fn: ``fn(param, fqn) -> int | None`` block size in elements (``None``: row blocks,
            ``raggedfsdp.planner.granularity_for``).
    """

    def __init__(
        self,
        params: list[tuple[nn.Parameter, str, list[tuple[nn.Module, str]]]],
        mesh,
        mp_policy,
        device: torch.device,
        granularity_fn: Callable[[nn.Parameter], int | None] | None = None,
        offload: bool = False,
        pin_memory: bool = True,
        spmd_specs: list | None = None,
        all_gather_policy=None,
    ):
        self.mesh = mesh
        self.device = device  # compute device: unsharded params and grads live here
        # CPUOffloadPolicy: sharded master params and sharded grads live on the CPU (pinned when the
        # compute device is an accelerator); one H2D copy (fused with the param_dtype cast) feeds the
        # all-gather, one D2H copy takes the reduce-scatter output (torch FSDP2 semantics)
        self.offload = offload
        self.storage_device = torch.device("cpu") if offload else device
        self.pin = offload and pin_memory and device.type not in ("cpu", "meta")
        self.is_hsdp = mesh.ndim == 2
        self.shard_mesh_dim = mesh.ndim - 1
        self.shard_group = mesh.get_group(self.shard_mesh_dim)
        self.replicate_group = mesh.get_group(0) if self.is_hsdp else None
        self.shard_world = mesh.size(self.shard_mesh_dim)
        self.shard_rank = mesh.get_local_rank(self.shard_mesh_dim)
        self.replicate_world = mesh.size(0) if self.is_hsdp else 1

        dtypes = {p.dtype for p, _, _ in params}
        if len(dtypes) > 1:
            names = ", ".join(f"{fqn}:{p.dtype}" for p, fqn, _ in params)
            raise ValueError(
                f"fully_shard: parameters of one unit must share one dtype, got {sorted(map(str, dtypes))} "
                f"({names}); cast the module to one dtype first (e.g. module.float()) or call fully_shard on "
                "the submodules of each dtype separately"
            )
        self.orig_dtype = params[0][0].dtype if params else torch.float32
        self.param_dtype = mp_policy.param_dtype or self.orig_dtype
        # reduce_dtype=None: torch <= 2.14 reduces in param_dtype, 2.15 in each parameter's own dtype
        # (peers-2026-12 2.15-b)
        self.reduce_dtype = mp_policy.reduce_dtype or (
            self.orig_dtype if torch_minor() >= (2, 15) else self.param_dtype
        )
        if not self.orig_dtype.is_floating_point:
            self.param_dtype = self.reduce_dtype = self.orig_dtype
        self.mp_policy = mp_policy

        self.fsdp_params: list[FSDPParam] = []
        for pi, (p, fqn, owners) in enumerate(params):
            if p.ndim == 0:
                raise ValueError(
                    f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor with numel "
                    f"equal to 1. fully_shard: parameter {fqn!r} is 0-dimensional; like torch's fully_shard, "
                    "raggedfsdp needs at least one dim: store it with shape (1,)"
                )
            tp_spec = tp_spec_of(p, fqn, mesh)  # Note [FSDP x TP]: plan the TP-local tensor
            shape = local_tensor(p).shape
            if not local_tensor(
                p
            ).is_contiguous():  # e.g. channels_last: the flat layout is row-major (torch refuses it too)
                raise NotImplementedError(
                    "FSDP does not support non-contiguous parameters yet: "
                    f"fully_shard: parameter {fqn!r} of shape {tuple(p.shape)} is not contiguous (stride "
                    f"{tuple(local_tensor(p).stride())}, e.g. channels_last); raggedfsdp lays parameters "
                    f"out row-major, as torch's "
                    "fully_shard, so it would come back contiguous: make it contiguous first (e.g. "
                    "module.to(memory_format=torch.contiguous_format)) and use channels_last activations"
                )
            g = granularity_fn(p, fqn) if granularity_fn is not None else None
            g = granularity_for(shape, None, name=fqn)[0] if g is None else int(g)
            if shape.numel() == 0:
                g = 1
            elif all_gather_policy is not None and all_gather_policy.eligible(shape):
                g = math.lcm(g, all_gather_policy.granularity(shape))  # Note [quantized all-gather]
            if g < 1 or shape.numel() % g != 0:
                raise ValueError(
                    f"fully_shard: granularity {g} elements for parameter {fqn!r} of (TP-local) shape "
                    f"{tuple(shape)} must be >= 1 and divide its numel {shape.numel()}"
                )
            self.fsdp_params.append(
                FSDPParam(
                    fqn, owners, shape, p.dtype, p.requires_grad, g, ragged_dims(shape, g), tp_spec=tp_spec
                )
            )
            if spmd_specs is not None and spmd_specs[pi] is not None:  # dp_mesh_dims (_init.py)
                self.fsdp_params[-1].spmd_spec, self.fsdp_params[-1].dp_dims = spmd_specs[pi]
        elsizes = {
            torch.empty((), dtype=d).element_size()
            for d in {self.orig_dtype, self.param_dtype, self.reduce_dtype}
        }
        align = math.lcm(*[max(COLLECTIVE_ALIGN_BYTES // e, 1) for e in elsizes])
        # a unit that mixes frozen and trainable params (LoRA) gets its trainable ones as their own segment,
        # so their pieces -- and with them the grads and the optimizer state -- are spread over every rank
        # (Note [segmented layout] in raggedfsdp/planner/layout.py); the plan follows requires_grad now
        self.layout = plan_segments(
            [fp.shape.numel() for fp in self.fsdp_params],
            [fp.granularity for fp in self.fsdp_params],
            self.shard_world,
            [int(fp.requires_grad) for fp in self.fsdp_params],
            align=align,
            order="best",
            shapes=[tuple(fp.shape) for fp in self.fsdp_params],
        )
        warn_padding(self.layout, self.fsdp_params)
        self.quant_gather = None  # Note [quantized all-gather] in raggedfsdp/buffer/quant_gather.py
        if all_gather_policy is not None:
            self.quant_gather = QuantizedGather(
                self.layout,
                [fp.shape for fp in self.fsdp_params],
                all_gather_policy,
                names=[fp.fqn for fp in self.fsdp_params],
            )
            self.quant_gather.plan(self.param_dtype)  # checks that no rank boundary cuts a block
        self.bufs = self._make_buffers(self.storage_device if device.type != "meta" else device)
        self.trainable = [fp for fp in self.fsdp_params if fp.requires_grad]  # refreshed at each unshard
        self._index = {id(fp): i for i, fp in enumerate(self.fsdp_params)}
        self.grads = UnitGrads(self, self.fsdp_params, self._index)  # the gradient state
        self._set_grad_members_of_bufs()
        self._init_sharded(params)
        self._init_unsharded()

        for fp in self.fsdp_params:
            fp.sharded._raggedfsdp_unit = weakref.ref(self)
        self.unit_id, self.unit_name = -1, "?"  # index and FQN under the root (set at the root's lazy init)
        self.log_suffix = ""  # " (<module FQN>)" of torch's FSDP2 debug-log lines; "" for the root
        self._meta_fqns: list[str] = []  # params left on meta by a partial assign-load
        self._master_changes = 0  # per-unit counter of optimizer steps / loads that changed the master

        # runtime state (the gradient side's is on self.grads)
        self.comm = CommContext(None)  # no side streams until the root's lazy init shares its context
        self.param_state = ParamState.SHARDED
        self._unshard: CommHandle | None = None  # in-flight all-gather
        self._version_guard = None  # _unsafe_preserve_version_counter of the in-flight all-gather
        self._gathered_version = -1  # sharded-buffer version the unsharded buffer was gathered from
        self.reduce_grads = True
        self.rs_wire_dtype: torch.dtype | None = None  # FSDPModule.set_reduce_scatter_wire_dtype
        self.nonfinite_probe: list | None = None  # FSDPModule.set_nonfinite_grad_probe
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        # set_reduce_scatter_unused_params(True): every trainable param counts as used (zero .grad if no
        # rank used it), as FSDP2's post_backward reduce-scatters a zero grad for it
        self.reduce_scatter_unused_params = False
        self.all_reduce_hook = None  # FSDPModule.set_all_reduce_hook: hook(reduce_output) before the divide
        self.all_reduce_hook_stream = None
        # int reshard_after_forward (set_post_forward_mesh): a group of k consecutive ranks keeps a 1/k slice
        self.post_forward_group = None
        self.post_forward_k: int | None = None
        self.post_forward_rank = 0
        self.post_forward_buf: torch.Tensor | None = None  # the kept 1/k slice
        self._post_forward_version = -1  # master version the slice was cut at

    def _make_buffers(self, storage: torch.device) -> UnitBuffers:
        return UnitBuffers(
            self.layout,
            rank=self.shard_rank,
            shapes=[fp.shape for fp in self.fsdp_params],
            orig_dtype=self.orig_dtype,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            device=self.device,
            storage_device=storage,
            pin=self.pin,
        )

    @property
    def is_unsharded(self) -> bool:
        return self.param_state is ParamState.UNSHARDED

    @property
    def any_trainable(self) -> bool:
        return self.tensors.any_requires_grad()

    def refresh_requires_grad(self) -> None:
        """Copy each sharded param's current ``requires_grad`` onto its unsharded param (as FSDP2 does at
        each unshard), so freezing or unfreezing after ``fully_shard`` is honoured. Local."""
        if self.tensors.requires_grad_unchanged():
            return  # the per-step case: no per-parameter branches
        changed = False
        for fp in self.fsdp_params:
            rg = fp.sharded.requires_grad
            if rg == fp.requires_grad and fp.unsharded.requires_grad != rg and self.is_unsharded:
                # the unsharded param is the one registered on the module (a root kept unsharded after
                # a forward): a change the user made on it wins, and the sharded param follows
                rg = fp.unsharded.requires_grad
                fp.sharded.requires_grad_(rg)
            if rg != fp.requires_grad or fp.unsharded.requires_grad != rg:
                fp.unsharded.requires_grad_(rg)
                fp.requires_grad = rg
                changed = True
                if rg and not fp.hooked:
                    self.grads.hook(fp)
        if changed:
            self.trainable = [fp for fp in self.fsdp_params if fp.requires_grad]
            self.tensors.recorded = [fp.requires_grad for fp in self.fsdp_params]

    def compute_stream(self):
        return current_stream(self.device)

    # ---- init ----------------------------------------------------------------------------
    def _placements(self, fp: FSDPParam, i: int):
        units = (1,) + (0,) * (self.shard_world - 1) if fp.shape.numel() == 0 else self.layout.local_units(i)
        ragged = RaggedShard(fp.dims, units)
        fsdp = (Replicate(), ragged) if self.is_hsdp else (ragged,)
        return fsdp + (tuple(fp.tp_spec.placements) if fp.tp_spec is not None else ())

    def _init_sharded(self, params) -> None:
        on_meta = self.device.type == "meta"
        with torch.no_grad():
            for i, (fp, (p, _, _)) in enumerate(zip(self.fsdp_params, params)):
                local = self.bufs.sharded.local_view(i)
                if not on_meta and p.device.type != "meta":
                    a, b = self.layout.piece(i, self.shard_rank)
                    local.copy_(local_tensor(p).detach().reshape(-1)[a:b])
                mesh = self.mesh if fp.tp_spec is None else spmd_mesh(self.mesh, fp.tp_spec.mesh)
                gshape = fp.global_shape
                fp.spec = DTensorSpec(
                    mesh,
                    self._placements(fp, i),
                    tensor_meta=TensorMeta(gshape, contiguous_stride(gshape), fp.dtype),
                )
                fp.sharded = nn.Parameter(
                    DTensor(local, fp.spec, requires_grad=fp.requires_grad), requires_grad=fp.requires_grad
                )
                fp.set_on_owners(fp.sharded)
            if not on_meta:
                self._zero_sharded_padding()

    def _zero_sharded_padding(self) -> None:
        # padding lies only between tensors; keep it zero so reductions over the flat shard are exact
        mask = torch.ones(self.layout.shard_size, dtype=torch.bool)
        for i in range(len(self.fsdp_params)):
            a, b = self.layout.piece(i, self.shard_rank)
            off = self.layout.shard_offset(i, self.shard_rank)
            mask[off : off + (b - a)] = False
        if mask.any():
            self.bufs.sharded.data[mask.to(self.bufs.sharded.data.device)] = 0

    def _init_unsharded(self) -> None:
        # views must be created while the storage exists; they stay valid across free/alloc
        grads = self.bufs.param_layout_grads  # the all-trainable path's views (Note [frozen parameters])
        self.bufs.params.alloc()
        grads.alloc()
        for i, fp in enumerate(self.fsdp_params):
            fp.unsharded = nn.Parameter(
                fp.wrap_unsharded(self.bufs.params.tensor_view(i)), requires_grad=fp.requires_grad
            )
            fp.grad_view = fp.wrap_unsharded(
                grads.tensor_view(i)
            )  # for every param: requires_grad may change
            fp.hooked = False
            if fp.requires_grad:
                self.grads.hook(fp)
        self.bufs.params.free()
        grads.free()
        self.tensors = ParamTensors(self.fsdp_params)  # the hot path's lists (sharded params set just before)

    def reset_sharded_storage(self) -> None:
        """Re-point sharded params at a fresh sharded DBuffer after ``module._apply`` (``to``, ``to_empty``,
        ``double()``, ``half()``) or after ``load_state_dict(assign=True)`` replaced them (torch FSDP2:
        ``FSDPParam.reset_sharded_param``). The registered DTensors' local tensors are the source: their
        values are copied into the new buffer, which takes their device and dtype (a dtype change also
        changes ``param_dtype`` / ``reduce_dtype`` where ``mp_policy`` leaves them unset; the layout is
        kept). Raises ``ValueError`` if the unit's params no longer share one dtype or device. Local."""
        locals_ = [fp.sharded._local_tensor for fp in self.fsdp_params]
        real = [t for t in locals_ if t.device.type != "meta"]
        dtypes = {t.dtype for t in locals_}
        devices = {t.device for t in real}
        if len(dtypes) > 1 or len(devices) > 1:
            names = ", ".join(f"{fp.fqn}:{t.dtype}@{t.device}" for fp, t in zip(self.fsdp_params, locals_))
            raise ValueError(
                f"raggedfsdp: the parameters of FSDP unit {self.unit_name!r} must share one dtype and device "
                f"(one flat buffer), got {names}; convert the whole fully_shard'ed module (module.to(...)) "
                "or load a state dict of one dtype"
            )
        device = next(iter(devices)) if devices else (locals_[0].device if locals_ else self.device)
        if dtypes and (dt := next(iter(dtypes))) != self.orig_dtype:
            self._set_orig_dtype(dt)
        if self.offload and device.type != "meta":
            storage = torch.device("cpu")
            if self.device.type == "meta":
                self.device = device if device.type != "cpu" else torch.device(self.mesh.device_type)
        else:
            storage = device
            self.device = device
        self.storage_device = storage
        new = self._make_buffers(storage)
        with torch.no_grad():
            if self.device.type != "meta":
                new.sharded.data.zero_()
            for i, (fp, old) in enumerate(zip(self.fsdp_params, locals_)):
                local = new.sharded.local_view(i)
                if self.device.type != "meta" and old.device.type != "meta":
                    local.copy_(old.reshape(-1))
                fp.sharded._local_tensor = local
                fp.spec = fp.sharded._spec
        # still on meta after a partial load (strict=False): forward names them (torch: lazy-init check)
        self._meta_fqns = [fp.fqn for fp, t in zip(self.fsdp_params, locals_) if t.device.type == "meta"]
        self.bufs = new
        self._set_grad_members_of_bufs()
        self._gathered_version = -1
        self._init_unsharded()

    def _set_grad_members_of_bufs(self) -> None:
        fps = self.grads.grad_fps
        if len(fps) < len(self.fsdp_params) and fps:
            self.bufs.set_grad_members(tuple(self._index[id(fp)] for fp in fps))

    def _set_orig_dtype(self, dtype: torch.dtype) -> None:
        """``module.to(dtype)`` after ``fully_shard``: the master copy changes dtype (as in FSDP2, where the
        sharded params simply are the converted tensors); unset ``param_dtype`` / ``reduce_dtype`` follow."""
        mp = self.mp_policy
        self.orig_dtype = dtype
        self.param_dtype = mp.param_dtype or dtype
        self.reduce_dtype = mp.reduce_dtype or (dtype if torch_minor() >= (2, 15) else self.param_dtype)
        if not dtype.is_floating_point:
            self.param_dtype = self.reduce_dtype = dtype
        for fp in self.fsdp_params:
            fp.dtype = dtype

    def set_root_fqns(self, module_names: dict[int, str]) -> None:
        """At the root's lazy init: name each param by its FQN under the root (``0.in_proj.weight``), as
        torch's ``_init_fqns`` does, so later errors name what ``root.named_parameters()`` shows. Local."""
        for fp in self.fsdp_params:
            mod, attr = fp.owners[0]
            base = module_names.get(id(mod))
            if base is not None:
                fp.fqn = f"{base}.{attr}" if base else attr

    def adopt_registered_params(self) -> None:
        """Parameters registered in place of the sharded params (``load_state_dict(..., assign=True)``, or
        ``module.p = nn.Parameter(...)`` between ``fully_shard`` and the first forward): make them the
        unit's sharded params, backed by its flat buffer (their values copied in; from the meta device, the
        buffer is allocated on theirs). Torch FSDP2 does the same in a load post-hook and at lazy init
        (``FSDPParam.reset_sharded_param``). A replacement with the parameter's shape that is a plain
        tensor, or a DTensor with other placements on a 1-D mesh, is resharded to the parameter's
        placement (a DTensor's ``full_tensor()``: collective over its mesh, so every rank must call).
        Raises ``ValueError`` for any other replacement (another shape or mesh). Local otherwise."""
        changed = False
        for fp in self.fsdp_params:
            mod, name = fp.owners[0]
            new = mod._parameters.get(name)
            if new is None or new is fp.sharded:
                continue
            if (
                not isinstance(new, DTensor)
                or new.shape != fp.sharded.shape
                or new.device_mesh != fp.spec.mesh
                or tuple(new.placements) != tuple(fp.spec.placements)
            ):
                new = reshard_replacement(new, fp)
            for attr in ("_raggedfsdp_owner", "_raggedfsdp_unit"):
                if hasattr(fp.sharded, attr):
                    setattr(new, attr, getattr(fp.sharded, attr))
            fp.sharded = new
            fp.set_on_owners(new)  # every owner of a tied parameter
            changed = True
        if changed:
            self.tensors = ParamTensors(self.fsdp_params)  # current even if the reset below raises
            self.reset_sharded_storage()

    # ---- unshard / reshard ---------------------------------------------------------------
    def mark_master_changed(self) -> None:
        """The sharded master changed (optimizer step, load): a kept gather is stale. Local."""
        self._master_changes += 1

    def _master_version(self) -> int:
        return self._master_changes + self.bufs.sharded.data._version + self.tensors.sharded_version()

    def _gather_is_current(self) -> bool:
        return self.bufs.params.is_allocated and self._gathered_version == self._master_version()

    @disable_functorch_if_active
    def unshard(self, async_op: bool = False) -> None:
        """All-gather the unit's params into the unsharded buffer (from the all-gather stream on CUDA).
        Collective over the shard group; idempotent while a gather is in flight or current.

        A buffer kept by ``reshard_after_backward=False`` / ZeRO-1 is reused without communication while
        the sharded buffer is unmodified (see the module docstring)."""
        if self.param_state is not ParamState.SHARDED or self._gather_is_current():
            return
        if self.bufs.sharded.data.device.type == "meta" or self._meta_fqns:
            names = self._meta_fqns or [fp.fqn for fp in self.fsdp_params]
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following "
                f"were still on meta device: {names}\n"
                f"raggedfsdp: parameters {names} are still on the meta device; after fully_shard call "
                "module.to_empty(device=...) and initialize them (e.g. reset_parameters()) before forward"
            )
        check(self._unshard is None, "double unshard: an all-gather is already in flight")
        self.comm.agreement.note(self, "all-gather", self.layout.total_size)  # Note [unit agreement]
        version = self._master_version()
        # The in-place all-gather must not bump the version counter that autograd's saved aliases of the
        # unsharded params share. gloo bumps it at launch and again when the work completes (possibly on a
        # background thread before wait() is called), so record the version now and restore it after wait.
        self._version_guard = torch.autograd._unsafe_preserve_version_counter(self.bufs.params.data)
        with labelled(f"raggedfsdp::unshard ({self.unit_name})"):
            if self.post_forward_buf is not None and version == self._post_forward_version:
                buf, self.post_forward_buf = self.post_forward_buf, None
                self._unshard = self.bufs.gather_params(
                    None, stream=self.comm.ag_stream, source=buf, source_group=self.post_forward_group
                )
            elif self.quant_gather is not None:
                self.post_forward_buf = None
                self._unshard = self.quant_gather.gather(
                    self.bufs, self.shard_group, stream=self.comm.ag_stream, version=version
                )
            else:
                self.post_forward_buf = None
                self._unshard = self.bufs.gather_params(self.shard_group, stream=self.comm.ag_stream)
        self._unshard.context = self.comm.agreement.context(self)
        self.comm.add_gather(self)
        self._gathered_version = version
        self.param_state = ParamState.UNSHARDING

    @disable_functorch_if_active
    def wait_for_unshard(self) -> None:
        """Wait for the all-gather and register the unsharded params on their modules. Local."""
        if self.param_state is ParamState.UNSHARDED:
            self.refresh_requires_grad()  # kept unsharded since the last forward: honour changes since
            return
        if self.param_state is ParamState.SHARDED:
            self.unshard()
        if self._unshard is not None:
            self._unshard.wait(self.compute_stream())
            self._version_guard.__exit__(None, None, None)
            self._unshard, self._version_guard = None, None
        self.refresh_requires_grad()
        self.tensors.register("unsharded")
        self.param_state = ParamState.UNSHARDED

    # ---- int reshard_after_forward: keep a 1/k slice, re-gather within k ranks ----------------
    def set_post_forward_mesh(self, mesh2d) -> None:
        """``mesh2d`` is the shard mesh viewed as ``(m/k, k)``; dim 1 groups k consecutive ranks."""
        self.post_forward_group = mesh2d.get_group(1)
        self.post_forward_k = mesh2d.size(1)
        self.post_forward_rank = mesh2d.get_local_rank(1)

    @disable_functorch_if_active
    def reshard_post_forward(self) -> None:
        """Free the unsharded params after forward; with an int ``k`` keep this rank's 1/k slice. Local."""
        k = self.post_forward_k
        if k is None or self.param_state is not ParamState.UNSHARDED:
            self.reshard()
            return
        chunk = self.layout.total_size // k
        self._post_forward_version = self._master_version()
        with torch.no_grad():
            self.post_forward_buf = self.bufs.params.data.narrow(
                0, self.post_forward_rank * chunk, chunk
            ).clone()
        self.reshard()

    def drop_post_forward_slice(self) -> None:
        """Forget the kept 1/k slice (a forward under no_grad: no backward will re-gather from it). Local."""
        self.post_forward_buf = None

    def owes_post_backward(self, ran_post_backward: bool) -> bool:
        """At the root's final callback: does this unit still owe its post-backward? Its grads are open
        (the root's inputs needed no grad, or grads began again after the hook), it is unsharded without
        having run post-backward, or it holds grads of earlier micro-batches that this synced backward
        must reduce although it did not run. Local."""
        return (
            self.grads.grad_state is GradState.ACCUMULATING
            or (not ran_post_backward and self.param_state is not ParamState.SHARDED)
            or self.grads.holds_unreduced(self.reduce_grads, self.all_reduce_grads)
        )

    def post_backward(self) -> None:
        """The unit's post-backward, in FSDP2's order (``FSDPParamGroup.post_backward`` in
        ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``): (1) complete the oldest in-flight
        reduce-scatters down to K - 1 (Note [bounded gradient memory] in ``_reduce.py``), (2) reshard,
        (3) fold the gradients autograd kept into the flat grad buffer (Note [grad fold] in ``_grads.py``),
        (4) reduce-scatter it (or hold it: no-sync). (1), (2) and the wait of a prefetched all-gather
        (``CommContext.wait_gathers``) come before the fold allocates, so at
        most K reduce-scatter inputs, one unit's params and one unit's per-parameter grads (the
        prefetched unit's params aside) are alive at any time of backward. Collective."""
        grads, trainable = self.grads, self.any_trainable
        if self.reduce_grads and trainable and grads.grad_state is not GradState.REDUCING:
            self.comm.reduces.make_room()
        self.reshard(free=self.reshard_after_backward)  # before the fold allocates
        self.comm.wait_gathers()  # ... and the backend scratch of a prefetched all-gather is gone
        any_grad = grads.fold() if trainable else False
        cast = self.reduce_dtype != self.param_dtype
        if grads.after_fold(any_grad, self.reduce_grads, self.all_reduce_grads, cast):
            launch_reduce(self, self.comm.reduces)

    @disable_functorch_if_active
    def reshard(self, free: bool = True) -> None:
        """Register the sharded DTensor params; ``free`` releases the unsharded storage. Local (waits an
        in-flight all-gather first)."""
        if self.param_state is ParamState.UNSHARDING:
            self.wait_for_unshard()
        if self.param_state is ParamState.UNSHARDED:
            # a change made on the registered unsharded params carries over; one made on the sharded
            # params meanwhile is taken at the next unshard (as for any change between steps)
            if not self.tensors.unsharded_requires_grad_unchanged():
                self.refresh_requires_grad()
            self.tensors.register("sharded")
            self.param_state = ParamState.SHARDED
        if free and self.bufs.params.is_allocated:
            check(self._unshard is None, "free of the unsharded params while their all-gather is pending")
            self.bufs.free_params()
            self._gathered_version = -1

    def reset(self) -> None:
        """reset_iter_state for this unit (after the root queue was reset): wait the all-gather, reshard,
        free every unsharded grad buffer and clear every per-iteration flag. Local."""
        if self._unshard is not None:
            self._unshard.wait(self.compute_stream())
            self._version_guard.__exit__(None, None, None)
            self._unshard, self._version_guard = None, None
            self.param_state = ParamState.UNSHARDED
        self.reshard()
        self.grads.reset()
        self.post_forward_buf = None
