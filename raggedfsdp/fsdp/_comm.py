"""State shared by every FSDP unit under one root: streams, the reduce queue, unit agreement, the
forward order and the runtime options (FSDP2: ``FSDPCommContext`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``)."""

from __future__ import annotations

import torch

from raggedfsdp.buffer.streams import new_stream
from raggedfsdp.fsdp._agreement import Agreement
from raggedfsdp.fsdp._common import RuntimeOptions
from raggedfsdp.fsdp._reduce import ReduceQueue


class CommContext:
    """Shared by all units of one root (each unit has its own until the root's lazy init merges them).

    * ``ag_stream`` / ``rs_stream`` / ``ar_stream``: CUDA streams the all-gathers, reduce-scatters and
      HSDP all-reduces are issued from (``None`` on CPU); high priority like FSDP2's.
    * ``reduces``: the bounded FIFO of in-flight reductions (Note [bounded gradient memory]).
    * ``agreement``: what this rank issued since the last check, and the deferred checks (Note [unit
      agreement] in ``_agreement.py``); every all-gather, reduce-scatter and all-reduce notes itself.
    * ``gathers``: the units whose all-gather was issued and not yet waited (a prefetch);
      :meth:`wait_gathers` waits them before a post-backward allocates its grad buffer.
    * ``post_optim_event``: ``FSDPModule.set_post_optim_event``'s event, waited once by the root.
    * ``options``: the :class:`~raggedfsdp.fsdp._common.RuntimeOptions` of the root (shared with
      ``reduces`` and ``agreement``).
    * ``pre_forward_order`` / ``prev_pre_forward_order``: units in the order their forward started, this
      and the previous iteration; the implicit forward prefetch follows the previous one.
    """

    def __init__(self, device: torch.device | None = None, options: RuntimeOptions | None = None):
        self.device = device
        self.options = options if options is not None else RuntimeOptions()
        self.ag_stream = None
        self.agreement = Agreement(self.options)
        self.reduces = ReduceQueue(agreement=self.agreement, options=self.options)
        self.gathers: list = []
        self.pre_forward_order: list = []
        self.prev_pre_forward_order: list = []
        self.post_optim_event = None  # FSDPModule.set_post_optim_event: waited at the next root pre-forward
        # CUDA streams; None on CPU, unless a test's stream model makes tokens (Note [fake streams])
        self.ag_stream = new_stream(device, priority=-1)
        self.reduces.rs_stream = new_stream(device, priority=-1)
        self.reduces.ar_stream = new_stream(device)

    def reset(self) -> None:
        """reset_iter_state: drop every reduction and the agreement state. Local (waits issued work)."""
        self.reduces.reset()
        self.agreement.reset()
        self.gathers = []
        self.pre_forward_order = []

    def add_gather(self, group) -> None:
        """``group`` issued an all-gather (dropping units whose gather was waited since: the list stays
        as short as the gathers in flight, also in forward-only loops). Local."""
        self.gathers = [g for g in self.gathers if g._unshard is not None]
        self.gathers.append(group)

    def wait_gathers(self) -> None:
        """Order the compute stream after every all-gather in flight (a prefetched unit's), so that its
        backend scratch is gone before a post-backward allocates the flat grad buffer. The next unit's
        pre-backward would wait it next anyway, and the reduce-scatter that follows runs after it on
        the same communicator, so nothing that could overlap is delayed but the fold's copy. On gloo
        the host blocks until it is done and drops the work, which owns a full-size scratch output
        (``aten::empty < gloo:all_gather``) until then: without this wait it was alive at the gloo
        backward peak (``benchmarks/README.md``, "Settled reduce-scatter"). Local; the unit still
        registers its params in ``wait_for_unshard`` (``CommHandle.wait`` is idempotent)."""
        for g in self.gathers:
            if g._unshard is not None:
                g._unshard.wait(g.compute_stream())
        self.gathers = []

    def start_forward(self) -> None:
        """Root pre-forward: the finished iteration's order becomes the prefetch schedule."""
        if self.pre_forward_order:
            self.prev_pre_forward_order = self.pre_forward_order
        self.pre_forward_order = []

    def next_to_prefetch(self, state):
        """The unit that followed ``state`` in the previous iteration's forward, if this iteration has
        matched that order so far (so every rank, running the same program, picks the same one)."""
        j = len(self.pre_forward_order)
        prev = self.prev_pre_forward_order
        self.pre_forward_order.append(state)
        if j + 1 < len(prev) and prev[j] is state and prev[j + 1] is not state:
            return prev[j + 1]
        return None
