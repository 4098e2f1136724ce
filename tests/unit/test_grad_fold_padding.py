"""The grad fold writes a fresh unsharded grad buffer without zero-filling all of it first: it copies
every tensor's gradient and zeroes only the padding between them (``UnitBuffers.fold_grads``). The
reference here is the plain construction: a zero buffer with each gradient copied at its offset."""

from __future__ import annotations

import torch

from raggedfsdp.buffer import UnitBuffers
from raggedfsdp.buffer.dbuffer import DBuffer
from raggedfsdp.planner import plan_layout


def _stale_alloc(monkeypatch):
    """A freshly allocated buffer holds NaN (stale bytes, as a re-used allocation may)."""
    orig = DBuffer.alloc

    def alloc(self, zero=False):
        fresh = orig(self, zero)
        if fresh and not zero:
            self.data.fill_(float("nan"))
        return fresh

    monkeypatch.setattr(DBuffer, "alloc", alloc)


def _bufs(numels, ws, align):
    layout = plan_layout(numels, [1] * len(numels), ws, align=align)
    shapes = [torch.Size([n]) for n in numels]
    b = UnitBuffers(
        layout,
        rank=0,
        shapes=shapes,
        orig_dtype=torch.float32,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        device=torch.device("cpu"),
        storage_device=torch.device("cpu"),
    )
    return layout, b


def test_fold_of_every_tensor_zeroes_exactly_the_padding(monkeypatch):
    _stale_alloc(monkeypatch)
    numels = [7, 13, 1, 30, 5]
    layout, b = _bufs(numels, ws=3, align=8)
    assert layout.total_size > sum(numels)  # there is padding to get right
    grads = [(i, torch.randn(n, generator=torch.Generator().manual_seed(i))) for i, n in enumerate(numels)]
    ref = torch.zeros(layout.total_size)
    for i, g in grads:
        ref[layout.offsets[i] : layout.offsets[i] + g.numel()] = g
    for _ in range(2):  # the second fold reuses the cached views on re-allocated storage
        b.fold_grads(grads)
        assert torch.equal(b.grads.data, ref)
        b.grads.free()


def test_fold_of_some_tensors_zeroes_the_rest(monkeypatch):
    _stale_alloc(monkeypatch)
    numels = [7, 13, 1, 30]
    layout, b = _bufs(numels, ws=2, align=4)
    g = torch.ones(13)
    b.fold_grads([(1, g)])
    ref = torch.zeros(layout.total_size)
    ref[layout.offsets[1] : layout.offsets[1] + 13] = 1
    assert torch.equal(b.grads.data, ref)


def test_per_step_buffers_share_the_units_shapes():
    """A DBuffer made every step (the sharded grads after their hand-off, the reduce-scatter output) shares
    the unit's list of ``torch.Size`` objects instead of making one per tensor: those outlived the step
    into the GC's oldest generation (785 a step on the 128-expert MoE bench). A list of other sequences is
    still converted."""
    numels = [7, 13, 1]
    layout, b = _bufs(numels, ws=2, align=4)
    assert all(type(s) is torch.Size for s in b.shapes)
    for buf in (b.sharded_grad_buffer(), b.sharded_output(torch.float32), b.params, b.grads):
        assert buf.shapes is b.shapes
    own = DBuffer(
        layout,
        sharded=True,
        rank=0,
        dtype=torch.float32,
        device=torch.device("cpu"),
        shapes=[(7,), [13], (1,)],
    )
    assert own.shapes == [torch.Size([7]), torch.Size([13]), torch.Size([1])]
    assert all(type(s) is torch.Size for s in own.shapes)
