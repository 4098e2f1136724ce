"""The FSDP runtime's stream ordering, checked on CPU with the stream model of tests/_fake_streams.py.

Under :func:`fake_streams` the all-gather, reduce-scatter and HSDP all-reduce streams are distinct
tokens with a recorded happens-before graph, and every collective issue and every buffer free is
checked against Note [stream invariant] (``raggedfsdp/buffer/streams.py``). Each case also compares
with an independent reference (single-process training on the global batch), so the runtime under
the model still computes the right thing:

* 1-D FSDP over 4 ranks: two AdamW steps with prefetch and reshard (all-gather, reduce-scatter);
  gradient accumulation over two backwards; CPU offload; ``reset_iter_state`` after an exception
  in backward and a clean step after it;
* HSDP on a 2 x 2 mesh: the all-reduce stream;
* positive controls: without the compute-stream wait before a collective (``lifecycle.wait_stream``
  made a no-op), and without the compute-stream wait of the reduce-scatter before its input is freed,
  the model raises ``BufferLifetimeError``; the second break passes unnoticed without the model (the
  gap it closes).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _spawns import SLOW  # the slow 4-rank cases share one spawn (tests/dist/_spawns.py)
from _toy_models import Boom, ToyLM, batches, full_params, lm_loss, shard_model

WS = 4


def _slice(tok, tgt, rank, ws):
    per = tok.shape[0] // ws
    return tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def _train(model, ref, steps, rank, ws):
    """``steps`` AdamW steps of ``model`` (this rank's slice) and ``ref`` (the global batch)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    for tok, tgt in batches(steps, 2 * ws):
        lm_loss(model, *_slice(tok, tgt, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(ref, tok, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = full_params(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def _accumulate(model, ref, rank, ws):
    """Two backwards before the step: the sharded grads accumulate; == the reference's summed grads."""
    bs = batches(2, 2 * ws, seed=5)
    for tok, tgt in bs:
        lm_loss(model, *_slice(tok, tgt, rank, ws)).backward()
        lm_loss(ref, tok, tgt).backward()
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(
            g.to(torch.float32),
            dict(ref.named_parameters())[n].grad,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=n: f"accumulated {n}: {m}",
        )


class BoomLM(ToyLM):
    def forward(self, tokens):
        x = self.emb(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0:
                x = Boom.apply(x)
        return self.head(self.norm(x))


def _cases(rank, ws):
    from _fake_streams import fake_streams
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp
    from raggedfsdp.buffer import BufferLifetimeError

    mesh = init_device_mesh("cpu", (ws,))
    hsdp = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    seen = {}
    with fake_streams() as fs:
        torch.manual_seed(0)
        ref = ToyLM(3)
        _train(shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh), ref, 2, rank, ws)
        torch.manual_seed(0)
        ref = ToyLM(3)
        _accumulate(shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh), ref, rank, ws)
        torch.manual_seed(0)
        ref = ToyLM(3)
        off = shard_model(
            copy.deepcopy(ref),
            raggedfsdp.fully_shard,
            mesh,
            offload_policy=raggedfsdp.CPUOffloadPolicy(pin_memory=False),
        )
        _accumulate(off, ref, rank, ws)
        torch.manual_seed(0)
        ref = ToyLM(3)
        _train(shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, hsdp), ref, 2, rank, ws)
        # reset after an exception in backward, then a clean accumulation
        torch.manual_seed(0)
        ref = BoomLM(3)
        model = shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh)
        tok, tgt = _slice(*batches(1, 2 * ws)[0], rank, ws)
        Boom.armed = True
        with pytest.raises(RuntimeError, match="injected failure"):
            lm_loss(model, tok, tgt).backward()
        Boom.armed = False
        model.reset_iter_state()
        model.zero_grad(set_to_none=True)
        _accumulate(model, ref, rank, ws)
        seen = dict(fs.issued_kinds)
        counts = dict(fs.counts)
        assert not fs.violations, fs.violations
        assert len({s for s in fs.by_key.values()}) >= 4, (
            "expected compute + all-gather/reduce-scatter/all-reduce tokens"
        )
    # the model saw every kind of collective and checked frees
    for what in ("all-gather", "reduce-scatter", "all-reduce"):
        assert seen.get(what, 0) > 0, (what, seen)
    assert counts["check_free"] > 0 and counts["wait_handle"] > 0 and counts["wait_stream"] > 0, counts

    # ---- positive controls ---------------------------------------------------------------------
    from raggedfsdp.buffer import lifecycle
    from raggedfsdp.buffer.streams import CommHandle

    def _no_compute_wait_before_collectives():
        orig = lifecycle.wait_stream
        lifecycle.wait_stream = lambda waiter, other: None
        try:
            torch.manual_seed(0)
            m = shard_model(ToyLM(2), raggedfsdp.fully_shard, mesh)
            lm_loss(m, tok, tgt).backward()
        finally:
            lifecycle.wait_stream = orig

    def _rs_not_waited_on_compute():
        # complete_reduce_scatter waits the reduce-scatter on its stream, then on the compute stream:
        # drop the second wait (as if that line were deleted)
        orig = CommHandle.wait

        def wait(self, stream=None):
            if self.what == "reduce-scatter":
                self._calls = getattr(self, "_calls", 0) + 1
                if self._calls == 2:
                    return None
            return orig(self, stream)

        CommHandle.wait = wait
        try:
            torch.manual_seed(0)
            m = shard_model(ToyLM(2), raggedfsdp.fully_shard, mesh)
            lm_loss(m, tok, tgt).backward()
        finally:
            CommHandle.wait = orig

    for control in (_no_compute_wait_before_collectives, _rs_not_waited_on_compute):
        with fake_streams() as fs:
            with pytest.raises(BufferLifetimeError, match="stream model"):
                control()
            assert fs.violations, control.__name__
    # without the model the same broken wait goes unnoticed on CPU (every stream is None there)
    from raggedfsdp.buffer import set_debug

    set_debug(True)
    try:
        _rs_not_waited_on_compute()
    finally:
        set_debug(False)


@pytest.mark.slow
def test_stream_ordering_under_the_fake_stream_model():
    """AG / RS / HSDP all-reduce / offload / accumulation / reset under the stream model, parity with
    single-process training, and two positive controls; 4 ranks."""
    SLOW.check(WS, "fake_streams")
