"""One FSDP unit (param group): planned layout, DBuffers, unshard / reshard / reduce-scatter.

Note [FSDP tensors]
    For each managed parameter ``p`` of global shape ``shape``:

    * sharded param   -- ``nn.Parameter(DTensor)`` with placement ``RaggedShard(dims, local_units)``
      (HSDP: ``(Replicate(), RaggedShard(...))``); its local tensor is a 1-D view into the unit's
      sharded DBuffer. This is what ``module.parameters()`` and the optimizer see outside forward
      and backward.
    * unsharded param -- a plain ``nn.Parameter`` of ``shape`` in ``param_dtype`` whose data is a view
      into the unsharded DBuffer; registered on the module while it is unsharded (forward/backward).
    * unsharded grad  -- a view into the unsharded grad DBuffer, pre-set as the unsharded param's
      ``.grad`` so autograd's AccumulateGrad adds into it in place.
    * sharded grad    -- a RaggedShard DTensor view into the sharded grad DBuffer, set as the sharded
      param's ``.grad`` after the reduce-scatter.

    Freeing unsharded storage resizes it to 0 bytes (torch FSDP2's trick, see
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``): the tensor objects and the aliases
    autograd saved stay valid, and the in-place all-gather refills them without bumping their version
    counters (``_unsafe_preserve_version_counter``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim.optimizer import register_optimizer_step_post_hook

from raggedfsdp._torch_patches import torch_minor
from raggedfsdp.buffer import DBuffer
from raggedfsdp.buffer.dbuffer import _all_gather_single
from raggedfsdp.placement import RaggedShard
from raggedfsdp.planner import plan_layout
from raggedfsdp.planner.policy import granularity_for, ragged_dims

COLLECTIVE_ALIGN_BYTES = 16  # NCCL-friendly shard alignment (paper-notes 2.2, "g_coll")

# Epoch of the sharded masters: bumped after every torch.optim step (global public hook) and every
# load_state_dict, so a gather kept across steps (ZeRO-1) is known to be stale. In-place edits by hand
# are not seen: call ``module.reshard()`` after them.
_EPOCH = [0]


def _master_epoch() -> int:
    return _EPOCH[0]


def bump_master_epoch(*_args, **_kwargs) -> None:
    _EPOCH[0] += 1


register_optimizer_step_post_hook(bump_master_epoch)


@dataclass
class FSDPParam:
    """Book-keeping for one managed parameter (see Note [FSDP tensors])."""

    fqn: str  # relative to the fully_shard'ed module
    owners: list[tuple[nn.Module, str]]  # every (module, attr) that holds this parameter
    shape: torch.Size  # global
    dtype: torch.dtype  # original
    requires_grad: bool
    granularity: int  # elements per block (never cut by a rank boundary)
    dims: tuple[int, ...]  # RaggedShard dims
    sharded: nn.Parameter = None  # type: ignore[assignment]  # DTensor param
    unsharded: nn.Parameter | None = None  # view into the unsharded DBuffer
    grad_view: torch.Tensor | None = None  # view into the unsharded grad DBuffer
    sharded_grad: DTensor | None = None  # DTensor view into the sharded grad DBuffer
    spec: DTensorSpec | None = None
    extra: dict = field(default_factory=dict)

    def set_on_owners(self, value: nn.Parameter) -> None:
        for module, name in self.owners:
            module._parameters[name] = value


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
        # reduce_dtype=None: torch <= 2.14 reduces in param_dtype, 2.15 in each parameter's own dtype (peers-2026-12 2.15-b)
        self.reduce_dtype = mp_policy.reduce_dtype or (self.orig_dtype if torch_minor() >= (2, 15) else self.param_dtype)
        if not self.orig_dtype.is_floating_point:
            self.param_dtype = self.reduce_dtype = self.orig_dtype
        self.mp_policy = mp_policy

        self.fsdp_params: list[FSDPParam] = []
        for p, fqn, owners in params:
            if p.ndim == 0:
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is 0-dimensional; like torch's fully_shard, raggedfsdp needs "
                    "at least one dim: store it with shape (1,)"
                )
            g = granularity_fn(p, fqn) if granularity_fn is not None else None
            g = granularity_for(p.shape, None, name=fqn)[0] if g is None else int(g)
            if p.numel() == 0:
                g = 1
            if g < 1 or p.numel() % g != 0:
                raise ValueError(
                    f"fully_shard: granularity {g} elements for parameter {fqn!r} of shape {tuple(p.shape)} must "
                    f"be >= 1 and divide its numel {p.numel()}"
                )
            self.fsdp_params.append(
                FSDPParam(fqn, owners, p.shape, p.dtype, p.requires_grad, g, ragged_dims(p.shape, g))
            )
        elsizes = {torch.empty((), dtype=d).element_size() for d in {self.orig_dtype, self.param_dtype, self.reduce_dtype}}
        align = math.lcm(*[max(COLLECTIVE_ALIGN_BYTES // e, 1) for e in elsizes])
        self.layout = plan_layout(
            [fp.shape.numel() for fp in self.fsdp_params],
            [fp.granularity for fp in self.fsdp_params],
            self.shard_world,
            align=align,
            order="best",
            shapes=[tuple(fp.shape) for fp in self.fsdp_params],
        )
        shapes = [fp.shape for fp in self.fsdp_params]
        self.sharded_buf = DBuffer(
            self.layout, sharded=True, rank=self.shard_rank, dtype=self.orig_dtype,
            device=self.storage_device if device.type != "meta" else device, shapes=shapes, pin_memory=self.pin,
        )
        self.unsharded_buf = DBuffer(
            self.layout, sharded=False, rank=self.shard_rank, dtype=self.param_dtype, device=device,
            shapes=shapes, allocate=False,
        )
        self.grad_buf = DBuffer(
            self.layout, sharded=False, rank=self.shard_rank, dtype=self.param_dtype, device=device,
            shapes=shapes, allocate=False,
        )
        self.sharded_grad_buf: DBuffer | None = None
        self.any_trainable = any(fp.requires_grad for fp in self.fsdp_params)
        self._init_sharded(params)
        self._init_unsharded()

        # runtime state
        self.is_unsharded = False
        self._gathered_version = -1
        self.pending_unshard = None  # async all-gather work
        self.grads_pending = False  # unsharded grads hold data not yet reduce-scattered
        self.pending_reduce = None  # (work, post-processing closure)
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self._partial_reduce: torch.Tensor | None = None  # HSDP: shard-reduced grads awaiting all-reduce
        self._partial_flags: list[int] | None = None
        self.post_forward_buf: torch.Tensor | None = None  # int reshard_after_forward: kept 1/k slice

    # ---- init ----------------------------------------------------------------------------
    def _placements(self, fp: FSDPParam, i: int):
        ragged = RaggedShard(fp.dims, self._units(fp, i))
        return (Replicate(), ragged) if self.is_hsdp else (ragged,)

    def _units(self, fp: FSDPParam, i: int) -> tuple[int, ...]:
        if fp.shape.numel() == 0:
            return (1,) + (0,) * (self.shard_world - 1)
        # local_units in RaggedShard units: rows-of-the-prefix per block = g / prod(shape[k:])
        return self.layout.local_units(i)

    def _init_sharded(self, params) -> None:
        on_meta = self.device.type == "meta"
        with torch.no_grad():
            for i, (fp, (p, _, _)) in enumerate(zip(self.fsdp_params, params)):
                local = self.sharded_buf.local_view(i)
                if not on_meta and p.device.type != "meta":
                    a, b = self.layout.piece(i, self.shard_rank)
                    local.copy_(p.detach().reshape(-1)[a:b])
                fp.spec = DTensorSpec(
                    self.mesh,
                    self._placements(fp, i),
                    tensor_meta=TensorMeta(fp.shape, _contiguous_stride(fp.shape), fp.dtype),
                )
                fp.sharded = nn.Parameter(
                    DTensor(local, fp.spec, requires_grad=fp.requires_grad), requires_grad=fp.requires_grad
                )
                fp.set_on_owners(fp.sharded)
            if not on_meta:
                self._zero_sharded_padding()

    def _zero_sharded_padding(self) -> None:
        # padding lies only between tensors; keep it zero so reductions over the flat shard are exact
        S = self.layout.shard_size
        mask = torch.ones(S, dtype=torch.bool)
        for i in range(len(self.fsdp_params)):
            a, b = self.layout.piece(i, self.shard_rank)
            off = self.layout.shard_offset(i, self.shard_rank)
            mask[off : off + (b - a)] = False
        if mask.any():
            self.sharded_buf.data[mask.to(self.sharded_buf.data.device)] = 0

    def _init_unsharded(self) -> None:
        # views must be created while the storage exists; they stay valid across free/alloc
        self.unsharded_buf.alloc()
        self.grad_buf.alloc()
        for i, fp in enumerate(self.fsdp_params):
            view = self.unsharded_buf.tensor_view(i)
            fp.unsharded = nn.Parameter(view, requires_grad=fp.requires_grad)
            if fp.requires_grad:
                fp.grad_view = self.grad_buf.tensor_view(i)
                fp.unsharded.register_post_accumulate_grad_hook(lambda _p, fp=fp: fp.extra.__setitem__("got", True))
        self.unsharded_buf.free()
        self.grad_buf.free()

    def reset_sharded_storage(self) -> None:
        """Re-point sharded params at a fresh sharded DBuffer after ``module._apply`` (``to``, ``to_empty``)."""
        first = self.fsdp_params[0].sharded if self.fsdp_params else None
        device = first._local_tensor.device if first is not None else self.device
        if self.offload and device.type != "meta":
            storage = torch.device("cpu")
            if self.device.type == "meta":
                self.device = device if device.type != "cpu" else torch.device(self.mesh.device_type)
        else:
            storage = device
            self.device = device
        self.storage_device = storage
        shapes = [fp.shape for fp in self.fsdp_params]
        new = DBuffer(self.layout, sharded=True, rank=self.shard_rank, dtype=self.orig_dtype, device=storage,
                      shapes=shapes, pin_memory=self.pin)
        device = self.device
        with torch.no_grad():
            if device.type != "meta":
                new.data.zero_()
            for i, fp in enumerate(self.fsdp_params):
                local = new.local_view(i)
                old = fp.sharded._local_tensor
                if device.type != "meta" and old.device.type != "meta":
                    local.copy_(old.reshape(-1))
                fp.sharded._local_tensor = local
        self.sharded_buf = new
        self.unsharded_buf = DBuffer(self.layout, sharded=False, rank=self.shard_rank, dtype=self.param_dtype,
                                     device=device, shapes=shapes, allocate=False)
        self.grad_buf = DBuffer(self.layout, sharded=False, rank=self.shard_rank, dtype=self.param_dtype,
                                device=device, shapes=shapes, allocate=False)
        self.sharded_grad_buf = None
        self._gathered_version = -1
        self._init_unsharded()

    # ---- unshard / reshard ---------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """All-gather the unit's params into the unsharded DBuffer. Collective over the shard group.

        If the buffer still holds a gather of the current sharded master (kept by
        ``reshard_after_backward=False`` / ZeRO-1), no communication happens. Any ``torch.optim``
        step or ``load_state_dict`` since the gather invalidates it (see :func:`_master_epoch`).
        """
        if self.pending_unshard is not None:
            return
        if self.sharded_buf.data.device.type == "meta":
            names = [fp.fqn for fp in self.fsdp_params]
            raise RuntimeError(
                f"raggedfsdp: parameters {names} are still on the meta device; after fully_shard call "
                "module.to_empty(device=...) and initialize them (e.g. reset_parameters()) before forward"
            )
        if self.unsharded_buf.is_allocated and _master_epoch() == self._gathered_version:
            self.pending_unshard = True
            return
        self.unsharded_buf.alloc()
        # The in-place all-gather must not bump the version counter that autograd's saved aliases of the
        # unsharded params share. gloo bumps it at launch and again when the work completes (possibly on a
        # background thread before wait() is called), so record the version now and restore it after wait.
        self._version_guard = torch.autograd._unsafe_preserve_version_counter(self.unsharded_buf.data)
        if self.post_forward_buf is not None and _master_epoch() == self._post_forward_epoch:
            work = self._unshard_from_post_forward(async_op)
        else:
            self.post_forward_buf = None
            with torch.no_grad():
                work = self.unsharded_buf.all_gather_from(self.sharded_buf.data, self.shard_group,
                                                          async_op=async_op)
        self._gathered_version = _master_epoch()
        if work is None:
            self._version_guard.__exit__(None, None, None)
        self.pending_unshard = work if work is not None else True

    def wait_for_unshard(self) -> None:
        """Wait for the all-gather and register the unsharded params on their modules. Local."""
        if self.pending_unshard is None:
            if self.is_unsharded and _master_epoch() == self._gathered_version:
                return
            self.unshard()
        work = self.pending_unshard
        if work is not True and work is not None:
            work.wait()
            self._version_guard.__exit__(None, None, None)
        self.pending_unshard = None
        for fp in self.fsdp_params:
            fp.set_on_owners(fp.unsharded)
        self.is_unsharded = True

    # ---- int reshard_after_forward: keep a 1/k slice, re-gather within k ranks ----------------
    def set_post_forward_mesh(self, mesh2d) -> None:
        """``mesh2d`` is the shard mesh viewed as ``(m/k, k)``; dim 1 groups k consecutive ranks."""
        self.post_forward_group = mesh2d.get_group(1)
        self.post_forward_k = mesh2d.size(1)
        self.post_forward_rank = mesh2d.get_local_rank(1)

    def reshard_after_forward(self) -> None:
        """Free the unsharded params after forward; with an int ``k`` keep this rank's 1/k slice. Local."""
        k = getattr(self, "post_forward_k", None)
        if k is None or not self.is_unsharded:
            self.reshard()
            return
        chunk = self.layout.total_size // k
        self._post_forward_epoch = _master_epoch()
        with torch.no_grad():
            self.post_forward_buf = self.unsharded_buf.data.narrow(0, self.post_forward_rank * chunk, chunk).clone()
        self.reshard()

    def _unshard_from_post_forward(self, async_op: bool):
        buf, self.post_forward_buf = self.post_forward_buf, None
        with torch.no_grad():
            return _all_gather_single(self.unsharded_buf.data, buf, group=self.post_forward_group,
                                               async_op=async_op)

    def reshard(self, free: bool = True) -> None:
        """Register the sharded DTensor params; ``free`` releases the unsharded storage. Local."""
        if self.pending_unshard is not None:
            self.wait_for_unshard()
        if self.is_unsharded:
            for fp in self.fsdp_params:
                fp.set_on_owners(fp.sharded)
            self.is_unsharded = False
        if free and self.unsharded_buf.is_allocated:
            self.unsharded_buf.free()
            self._gathered_version = -1

    # ---- backward ------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Allocate (zeroed) the unsharded grad DBuffer and pre-set ``.grad`` views. Local."""
        if not self.any_trainable:
            return
        # a module used twice in forward runs backward twice: the first reduce-scatter still reads the
        # grad buffer, so complete it (it frees the buffer) before accumulating the next pass
        self.finish_reduce()
        if self.grad_buf.alloc(zero=False):
            if not self.grads_pending:
                self.grad_buf.zero_()
        for fp in self.fsdp_params:
            if fp.requires_grad and fp.unsharded.grad is not fp.grad_view:
                if fp.unsharded.grad is not None:  # e.g. user set it; fold it in
                    fp.grad_view.add_(fp.unsharded.grad)
                fp.unsharded.grad = fp.grad_view

    def _collect_stray_grads(self) -> bool:
        """Fold grads autograd did not accumulate into our views (it steals when ``.grad`` is None)."""
        any_grad = self.grads_pending
        for fp in self.fsdp_params:
            if not fp.requires_grad:
                continue
            g = fp.unsharded.grad
            if g is None:
                continue
            if g is not fp.grad_view:
                if not self.grad_buf.is_allocated:
                    self.grad_buf.alloc()
                    self.grad_buf.zero_()
                fp.grad_view.add_(g)
                fp.unsharded.grad = fp.grad_view
                fp.extra["got"] = True
            any_grad = True
        return any_grad

    def post_backward(self) -> None:
        """Reduce-scatter (and HSDP all-reduce) the unit's grads if sync is on; reshard. Collective."""
        any_grad = self._collect_stray_grads() if self.any_trainable else False
        self.reshard(free=self.reshard_after_backward)
        if not any_grad:
            self._drop_unsharded_grads()
            return
        self.grads_pending = True
        if not self.reduce_grads:
            return  # no_sync: keep accumulating unsharded grads
        self.finish_reduce()  # at most one reduce-scatter in flight
        self._launch_reduce()

    def _drop_unsharded_grads(self) -> None:
        for fp in self.fsdp_params:
            if fp.unsharded is not None:
                fp.unsharded.grad = None
        if not self.grads_pending:
            self.grad_buf.free()

    def _divide_factor(self) -> float:
        return self.gradient_divide_factor or float(self.shard_world * self.replicate_world)

    def _launch_reduce(self) -> None:
        ws = self.shard_world * self.replicate_world
        factor = self._divide_factor()
        rs_buf = self.grad_buf
        if self.reduce_dtype != self.param_dtype:
            rs_buf = DBuffer(self.layout, sharded=False, rank=self.shard_rank, dtype=self.reduce_dtype,
                             device=self.device, shapes=self.sharded_buf.shapes)
            rs_buf.data.copy_(self.grad_buf.data)  # one fused cast of the whole unit
            self.grad_buf.free()
        for fp in self.fsdp_params:
            if fp.unsharded is not None:
                fp.unsharded.grad = None
        # AVG in the collective when it equals the requested division (no extra kernel); else SUM + one scale
        use_avg = factor == float(ws) and not self.is_hsdp and ws > 1
        op = dist.ReduceOp.AVG if use_avg else dist.ReduceOp.SUM
        fresh = self._sharded_grads_fresh()
        direct = (
            fresh and use_avg and rs_buf.data.dtype == self.orig_dtype and self.shard_world > 1
            and self.storage_device == self.device
        )
        if direct:
            out = self._sharded_grad_buffer().data
        else:
            out = rs_buf.rank_slice()
        work = rs_buf.reduce_scatter_(out, self.shard_group, op=op, async_op=True)
        # Which params received a gradient on ANY data-parallel rank (single-process semantics: a param
        # used by part of the global batch, e.g. an MoE expert, has a grad; one used by none has None).
        trainable = [fp for fp in self.fsdp_params if fp.requires_grad]
        local_flags = [int(fp.extra.pop("got", False)) for fp in trainable]
        if self._partial_flags is not None:  # microbatches whose replicate all-reduce was deferred
            local_flags = [a | b for a, b in zip(local_flags, self._partial_flags)]
            self._partial_flags = None
        # if every param got a grad here, the OR over ranks is known without reading it back (no host sync)
        all_local = all(local_flags)
        flags = torch.tensor(local_flags, dtype=torch.int32,
                             device=self.device)
        flag_works = []
        if ws > 1 and len(flags):
            flag_works.append(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.shard_group, async_op=True))

        def finish():
            if work is not None:
                work.wait()
            for w in flag_works:
                w.wait()
            if self.is_hsdp and self.replicate_world > 1 and len(flags):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.replicate_group)
            if self.is_hsdp and self.replicate_world > 1:
                if not self.all_reduce_grads:
                    # set_requires_all_reduce(False): keep the shard-reduced sum, all-reduce it later
                    if self._partial_reduce is None:
                        self._partial_reduce = out.clone()
                    else:
                        self._partial_reduce.add_(out)
                    self._partial_flags = local_flags
                    rs_buf.free()
                    self.grad_buf.free()
                    return
                if self._partial_reduce is not None:
                    out.add_(self._partial_reduce)
                    self._partial_reduce = None
                dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.replicate_group)
            if not use_avg and factor != 1.0:
                out.div_(factor)
            if not direct:
                sg = self._sharded_grad_buffer().data
                if fresh:
                    sg.copy_(out)
                else:
                    sg.add_(out)
            rs_buf.free()
            self.grad_buf.free()
            used = {id(fp) for fp, f in zip(trainable, [1] * len(trainable) if all_local else flags.tolist()) if f}
            self._attach_sharded_grads(fresh, used)

        self.pending_reduce = finish
        self.grads_pending = False

    def finish_reduce(self) -> None:
        """Wait for the in-flight reduce-scatter and install the sharded grads. Local (waits on a collective)."""
        if self.pending_reduce is not None:
            fn, self.pending_reduce = self.pending_reduce, None
            fn()

    def _sharded_grad_buffer(self) -> DBuffer:
        if self.sharded_grad_buf is None:
            self.sharded_grad_buf = DBuffer(
                self.layout, sharded=True, rank=self.shard_rank, dtype=self.orig_dtype, device=self.storage_device,
                pin_memory=self.pin,
                shapes=self.sharded_buf.shapes,
            )
            self.sharded_grad_buf.zero_()
        return self.sharded_grad_buf

    def _sharded_grads_fresh(self) -> bool:
        """True if no trainable sharded param holds a grad (optimizer did ``zero_grad(set_to_none=True)``).

        Grads the user replaced with other tensors are copied into the buffer first; slices of params
        without a grad are zeroed so that accumulation adds onto zero for them.
        """
        fresh = True
        for i, fp in enumerate(self.fsdp_params):
            if not fp.requires_grad:
                continue
            if fp.sharded.grad is None:
                continue
            fresh = False
            if fp.sharded_grad is None or fp.sharded.grad is not fp.sharded_grad:
                self._adopt_foreign_grad(fp)
        if not fresh:
            buf = self._sharded_grad_buffer()
            for i, fp in enumerate(self.fsdp_params):
                if fp.requires_grad and fp.sharded.grad is None:
                    buf.local_view(i).zero_()
        return fresh

    def _adopt_foreign_grad(self, fp: FSDPParam) -> None:
        # the user replaced .grad with another tensor: move its values into our buffer view
        buf = self._sharded_grad_buffer()
        i = self.fsdp_params.index(fp)
        g = fp.sharded.grad
        local = g._local_tensor if isinstance(g, DTensor) else g
        buf.local_view(i).copy_(local.reshape(-1))
        fp.sharded_grad = DTensor(buf.local_view(i), fp.spec, requires_grad=False)
        fp.sharded.grad = fp.sharded_grad

    def _attach_sharded_grads(self, fresh: bool, used: set[int]) -> None:
        buf = self._sharded_grad_buffer()
        for i, fp in enumerate(self.fsdp_params):
            if not fp.requires_grad or (id(fp) not in used and fp.sharded.grad is None):
                continue
            if fp.sharded_grad is None or fp.sharded_grad._local_tensor.data_ptr() != buf.local_view(i).data_ptr():
                fp.sharded_grad = DTensor(buf.local_view(i), fp.spec, requires_grad=False)
            fp.sharded.grad = fp.sharded_grad


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
