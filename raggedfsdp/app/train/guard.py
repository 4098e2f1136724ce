"""The step guard: one fused all-reduce per step that yields the global gradient norm, the mean loss,
which ranks saw a non-finite loss or gradient, and which ranks were asked to stop (a signal).

Why fused: the global gradient norm needs an all-reduce anyway (of each rank's sum of squares of its
local gradient shards, FSDP's shards being disjoint), so the per-rank flags ride along in the same
``(3 + 6 W,)`` float64 vector at no extra collective, and so do the parameters' sum of squares and
per-rank flags (a NaN written into a shard is found at the next step, named by rank and tensor).
With the raggedfsdp backend the gradient flag is taken on each rank's own gradients before the
reduce-scatter (``FSDPModule.set_nonfinite_grad_probe``), so one rank's NaN is not blamed on every
rank. Reading the result is one host sync per step
(``Tensor.tolist``), which the decision "step or not" needs before ``optimizer.step``; the metrics of
the step come from the same vector, so logging needs no further collective.

Policies (``training.on_nonfinite``):

- ``stop`` (default): every rank raises :class:`NonFiniteError` in the same step, before the
  optimizer step, naming the step, the rank(s) and their batch ids; the parameters and optimizer
  state are still those of the previous (finite) step and nothing is saved.
- ``skip``: every rank skips the update (gradients dropped, no optimizer step), the step counts in
  the ``skipped_steps`` metric, and more than ``training.max_consecutive_skips`` non-finite steps in
  a row raise :class:`NonFiniteError`.

Divergence (``training.divergence_ratio`` R > 0): a mean loss above R times the first loss of the
run (a fresh model's loss is about ln(vocab)) raises :class:`DivergenceError` on every rank.

Source of the idea: Megatron-LM's ``check_for_nan_in_grad`` / skipped-iteration counter and its
``found_inf`` flag all-reduced with the grad norm; torch's ``clip_grad_norm_(error_if_nonfinite)``.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "DivergenceError", "FaultError", "NonFiniteError", "StepGuard", "StepStats", "check_params", "check_saveable",
    "nonfinite_detail", "nonfinite_names", "nonfinite_ranks",
]  # fmt: skip


class FaultError(RuntimeError):
    """A fault the trainer detected and explains in its message (printed as one line, no traceback).

    ``culprits``: the ranks at fault (others delay their exit a little so that the launcher's
    root cause is a culprit); empty: every rank alike."""

    def __init__(self, message: str, culprits: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.culprits = tuple(culprits)


class ResourceError(FaultError):
    """The machine ran out of something (memory) at a step: one line naming rank, step and batch."""


_OOM_TEXT = ("out of memory", "can't allocate memory", "Cannot allocate memory")


def out_of_memory(e: BaseException, step: int, rank: int, device, batch_ids: dict[int, str]) -> BaseException:
    """``ResourceError`` for an out-of-memory ``e`` (``torch.OutOfMemoryError``, ``MemoryError``, CPU
    allocator failures); any other exception is returned as it is (the caller re-raises it)."""
    if not (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or any(t in str(e) for t in _OOM_TEXT)):
        return e
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    batch = f" (batch {batch_ids[rank]})" if rank in batch_ids else ""
    return ResourceError(
        f"out of memory on rank {rank} ({device}) at step {step}{batch}: {type(e).__name__}: {text}; "
        "use smaller micro-batches (--training.grad_accum N, or a smaller --batch-size / --seq-len); "
        "`raggedfsdp estimate-memory` shows the peak per rank",
        (rank,),
    )


def gather_signals(signum: int, device) -> dict[int, int]:
    """Collective: ``{rank: signum}`` of the ranks that got a signal (an empty dict: none did)."""
    mine = torch.tensor([int(signum)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {r: int(t) for r, t in enumerate(every) if int(t)}


class NonFiniteError(FaultError):
    """A NaN/Inf loss or gradient (policy ``stop``, or too many skipped steps)."""


class DivergenceError(FaultError):
    """The loss rose far above its starting value (``training.divergence_ratio``)."""


@dataclass
class StepStats:
    """The fused reduction's result, identical on every rank."""

    loss: float  # mean over ranks of the per-rank loss (sum over micro-steps of mean/accum)
    grad_norm: float  # global L2 norm of the gradients, before clipping
    bad_loss_ranks: list[int] = field(default_factory=list)
    bad_grad_ranks: list[int] = field(default_factory=list)
    signals: dict[int, int] = field(default_factory=dict)  # rank -> signal number
    param_norm: float = float("nan")  # global L2 norm of the parameters entering the step (nan: not computed)
    bad_param_ranks: list[int] = field(default_factory=list)  # ranks whose parameter shards hold NaN/Inf
    data: list[tuple[float, float]] = field(default_factory=list)  # per rank: (own batch, next rank's batch)

    @property
    def finite(self) -> bool:
        bad = self.bad_loss_ranks or self.bad_grad_ranks or self.bad_param_ranks
        return not bad and math.isfinite(self.grad_norm)


def _local(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(local tensor, weight)``: the weight is 1 / (number of ranks holding the same piece), so
    that summing ``weight * local`` over all ranks counts every element once (a DTensor replicated
    over some mesh dims, e.g. HSDP's replicate dim, counts 1/size on each of those ranks; so does one
    whose mesh leaves out ranks that hold the same values, e.g. the tp ranks of an FSDP x TP job)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        # ranks outside the tensor's mesh hold copies too (a dp-only param under FSDP x TP: every tp rank)
        copies = dist.get_world_size() // t.device_mesh.size()
        for dim, p in enumerate(t.placements):
            if isinstance(p, Replicate):
                copies *= t.device_mesh.size(dim)
        return t.to_local(), 1.0 / copies
    return t, 1.0 / dist.get_world_size()  # a plain tensor: the same on every rank


def local_sumsq(tensors: list[torch.Tensor]) -> torch.Tensor:
    """This rank's weighted sum of squares (0-d float64) of ``tensors`` (DTensor shards or plain):
    the all-reduced sum is the global sum of squares."""
    parts = [(loc, w) for loc, w in map(_local, tensors) if loc.numel() > 0]
    if not parts:
        dev = tensors[0].device if tensors else torch.device("cpu")
        return torch.zeros((), dtype=torch.float64, device=dev)
    norms = [n.double() for n in torch._foreach_norm([loc for loc, _ in parts])]  # one foreach kernel
    # the weights as a Python scalar list: no host-to-device copy (torch.tensor(..., device=cuda) would
    # be a pageable H2D copy and a stream synchronize every step)
    sq = torch._foreach_mul(torch._foreach_mul(norms, norms), [w for _, w in parts])
    return torch.stack(sq).sum()


class StepGuard:
    """Fused per-step reduction + the non-finite / divergence / interrupt decisions (every rank)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        policy: str = "stop",
        max_consecutive_skips: int = 5,
        divergence_ratio: float = 0.0,
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.divergence_ratio = divergence_ratio
        self.skipped_steps = 0  # in this process
        self.consecutive = 0
        self.ref_loss: float | None = None

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, *, signum: int = 0,
        grad_nonfinite: torch.Tensor | None = None, params: list[torch.Tensor] | None = None,
        data: tuple[float, float] | None = None,
    ) -> StepStats:  # fmt: skip
        """Collective (every rank, once per step, after backward, before clipping).

        ``grad_nonfinite``: this rank's flag (0-d bool) taken on its own gradients *before* the
        reduce-scatter (``FSDPModule.set_nonfinite_grad_probe``); without it the flag is taken on the
        reduced shards, where one rank's NaN has reached every rank. ``params``: the parameters as
        the previous optimizer step left them; their sum of squares rides along (``param_norm``,
        and a per-rank non-finite flag: a poisoned shard is found at the next step, named by rank).
        ``data``: ``(checksum of this rank's batch, checksum of the next rank's batch as this rank
        reads it)``, exact integers below 2**53 (``StepStats.data``: every rank's pair)."""
        w = self.world_size
        vec = torch.zeros(3 + 6 * w, dtype=torch.float64, device=self.device)
        sumsq = local_sumsq(grads).to(self.device)
        loss = loss_sum.detach().double().to(self.device)
        vec[0] = sumsq
        vec[1] = loss
        f = 3
        vec[f + self.rank] = (~torch.isfinite(loss)).double()
        bad_grad = ~torch.isfinite(sumsq) if grad_nonfinite is None else grad_nonfinite.to(self.device)
        vec[f + w + self.rank] = bad_grad.double()
        vec[f + 2 * w + self.rank] = float(signum)
        if params is not None:
            psq = local_sumsq(params).to(self.device)
            vec[2] = psq
            vec[f + 3 * w + self.rank] = (~torch.isfinite(psq)).double()
        if data is not None:
            vec[f + 4 * w + self.rank], vec[f + 5 * w + self.rank] = float(data[0]), float(data[1])
        if w > 1:
            dist.all_reduce(vec)
        v = vec.tolist()  # the one host sync of the step
        flags = v[f:]
        return StepStats(
            loss=v[1] / w,
            grad_norm=math.sqrt(v[0]) if v[0] >= 0 else float("nan"),
            bad_loss_ranks=[r for r in range(w) if flags[r] != 0],
            bad_grad_ranks=[r for r in range(w) if flags[w + r] != 0],
            signals={r: int(flags[2 * w + r]) for r in range(w) if flags[2 * w + r] != 0},
            param_norm=(math.sqrt(v[2]) if v[2] >= 0 else float("nan"))
            if params is not None
            else float("nan"),
            bad_param_ranks=[r for r in range(w) if flags[3 * w + r] != 0],
            data=[(flags[4 * w + r], flags[5 * w + r]) for r in range(w)] if data is not None else [],
        )

    def check(self, step: int, stats: StepStats, batch_ids: dict[int, str], detail=None) -> bool:
        """True: apply the update; False: skip it (policy ``skip``). Raises on stop/divergence.

        ``batch_ids``: ``{rank: batch id}`` (the ranks' ids are a pure function of the step, so every
        rank knows them without communication). ``detail(what) -> str``: called on a culprit rank
        only, names its own non-finite tensors (``what``: ``"parameters"`` or ``"gradients"``)."""
        if stats.bad_param_ranks:  # the cause comes before its effects (this step's NaN loss)
            culprits = stats.bad_param_ranks
            where = ", ".join(map(str, culprits))
            mine = f": {detail('parameters')}" if detail is not None and self.rank in culprits else ""
            raise NonFiniteError(
                f"non-finite parameters on rank{'s' if len(culprits) > 1 else ''} {where} at step {step} "
                f"(as left by step {step - 1}'s optimizer step or written since){mine}; stopped before the "
                "optimizer step, nothing saved",
                tuple(culprits),
            )
        if not stats.finite:
            # A NaN loss on one rank makes every rank's gradient NaN (reduce-scatter): blame the loss.
            if stats.bad_loss_ranks:
                culprits, what = stats.bad_loss_ranks, "loss"
            elif stats.bad_grad_ranks:
                culprits, what = stats.bad_grad_ranks, "gradients"
            else:
                culprits, what = [], f"global gradient norm ({stats.grad_norm})"
            plural = "s" if len(culprits) > 1 else ""
            where = f" on rank{plural} {', '.join(map(str, culprits))}" if culprits else ""
            ids = "; ".join(batch_ids[r] for r in culprits if r in batch_ids)
            desc = f"non-finite {what}{where} at step {step}" + (f" (batch {ids})" if ids else "")
            if what == "gradients" and detail is not None and self.rank in culprits:
                desc += f" ({detail('gradients')})"
            if self.policy == "skip":
                self.skipped_steps += 1
                self.consecutive += 1
                if self.consecutive > self.max_consecutive_skips:
                    raise NonFiniteError(
                        f"{desc}: {self.consecutive} non-finite steps in a row "
                        f"(training.max_consecutive_skips={self.max_consecutive_skips}); stopped, "
                        "nothing saved from the non-finite steps",
                        tuple(culprits),
                    )
                return False
            first = batch_ids.get(culprits[0], "").split(" ")[0] if culprits else "ID"
            raise NonFiniteError(
                f"{desc}; stopped before the optimizer step, nothing saved (checkpoints on disk are "
                "finite; --training.on_nonfinite skip skips such steps; print the batch with "
                f"raggedfsdp train --reproduce-batch {first})",
                tuple(culprits),
            )
        self.consecutive = 0
        if self.ref_loss is None:
            self.ref_loss = stats.loss
        elif self.divergence_ratio > 0 and stats.loss > self.divergence_ratio * self.ref_loss:
            raise DivergenceError(
                f"loss diverged at step {step}: {stats.loss:.4g} > training.divergence_ratio="
                f"{self.divergence_ratio:g} x the run's first loss {self.ref_loss:.4g}; stopped before "
                "the optimizer step (lower --lr, raise warmup, or set --training.divergence_ratio 0)"
            )
        return True


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def all_finite(tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Collective: True when every rank's part of ``tensors`` is finite (one all-reduce)."""
    bad = torch.zeros(1, dtype=torch.float64, device=device)
    parts = [loc for loc, _ in map(_local, tensors) if loc.numel() > 0 and loc.is_floating_point()]
    if parts:
        bad[0] = (~torch.isfinite(torch.stack([p.double().sum() for p in parts]))).sum()
        # a sum is non-finite iff an element is (or it overflows float64, which no finite
        # float32/bf16 tensor of this size does)
    if dist.get_world_size() > 1:
        dist.all_reduce(bad)
    return bad.item() == 0


def nonfinite_names(named: list[tuple[str, torch.Tensor]], limit: int = 3) -> str:
    """Local: ``"tensor a, b (+N more)"`` naming this rank's shards in ``named`` that hold NaN/Inf
    (called on a failure only: one host sync per tensor)."""
    bad = [n for n, t in named if (loc := _local(t)[0]).numel() and not bool(torch.isfinite(loc).all())]
    more = f" (+{len(bad) - limit} more)" if len(bad) > limit else ""
    return ("tensor " + ", ".join(bad[:limit]) + more) if bad else "no local tensor found"


def nonfinite_ranks(tensors: list[torch.Tensor], device: torch.device) -> list[int]:
    """Collective: the ranks whose part of ``tensors`` holds a NaN/Inf (one all-reduce of W flags)."""
    w = dist.get_world_size()
    flags = torch.zeros(w, dtype=torch.float64, device=device)
    parts = [loc for loc, _ in map(_local, tensors) if loc.numel() > 0 and loc.is_floating_point()]
    if parts:  # a sum is non-finite iff an element is (float64 sums of finite float32/bf16 do not overflow)
        flags[dist.get_rank()] = (
            (~torch.isfinite(torch.stack([p.double().sum() for p in parts]))).any().double()
        )
    if w > 1:
        dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def nonfinite_detail(model, probe: list | None, what: str) -> str:
    """Local, on a failure only: this rank's non-finite ``what`` (``"parameters"`` / ``"gradients"``):
    the tensors' names, or the FSDP units whose own gradients ``probe`` flagged before the reduce-scatter."""
    if what == "parameters":
        return nonfinite_names(list(model.named_parameters()))
    units = [name for name, flag in (probe or []) if bool(flag)]
    if units:
        return f"its own gradients of FSDP unit(s) {', '.join(units)}, before the reduce-scatter"
    return nonfinite_names([(n, p.grad) for n, p in model.named_parameters() if p.grad is not None])


def check_params(step: int, model, probe: list | None, device) -> None:
    """Collective: ``NonFiniteError`` naming the rank(s) and (on those ranks) the tensors if a parameter
    shard holds NaN/Inf after ``step``'s optimizer step (the trainer calls it after its last step; every
    earlier update is checked by the next step's fused reduction)."""
    bad = nonfinite_ranks(list(model.parameters()), device)
    if bad:
        mine = f": {nonfinite_detail(model, probe, 'parameters')}" if dist.get_rank() in bad else ""
        raise NonFiniteError(
            f"non-finite parameters on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} after "
            f"step {step}'s optimizer step{mine}",
            tuple(bad),
        )


def check_saveable(step: int, model, optimizer, device) -> None:
    """Collective: ``FaultError`` naming the rank(s) and tensors if the model or optimizer state holds
    NaN/Inf (a checkpoint of it is refused; the newest one on disk is kept)."""
    named = list(model.named_parameters())
    names = {id(p): n for n, p in named}
    for p, state in optimizer.state.items():
        named += [(f"optimizer {k} of {names.get(id(p), '?')}", v) for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.ndim > 0]  # fmt: skip
    bad = nonfinite_ranks([t for _, t in named], device)
    if bad:
        rank = dist.get_rank()
        mine = f" ({nonfinite_names(named)} on rank {rank})" if rank in bad else ""
        raise FaultError(
            f"refusing to save step {step}: the model or optimizer state holds NaN/Inf on "
            f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}{mine} (the newest checkpoint "
            "is kept as it is)",
            tuple(bad),
        )
