"""The FSDP runtime's step mechanics, each against an independent reference:

* bounded gradient memory: a counter of live unsharded-gradient buffers during backward (K + 1 for
  the blocks, plus the root's own) -- the old runtime kept every unit's buffer until the end;
* forward prefetch by default: the all-gather of unit i+1 is issued before unit i's compute ends;
* used-parameter flags decided over all ranks, with a parameter used on one rank only (DDP oracle);
* ``reset_iter_state`` after an exception in backward, then a clean step equal to single-process grads;
* ZeRO-1 staleness from per-unit version counters: a rank-local optimizer step does not hang;
* the debug-mode buffer-lifetime invariant;
* bf16 *gradients* after one backward, and no-sync accumulation in ``reduce_dtype``, vs torch's
  ``fully_shard`` with the same policy (a 2x gradient error fails).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import Boom, ToyLM, batches, full_params, lm_loss, shard_model

GRAD_NAMES = ("unsharded grads", "reduce-scatter input", "reduce_dtype accumulated grads")


def _slice(tok, tgt, rank, ws):
    per = tok.shape[0] // ws
    return tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def _ddp_oracle_grads(ref, loss_fn, ws):
    """Run ``loss_fn(ref)`` on this rank's replica and average the grads over ranks (None if unused
    everywhere): what single-process training on the global batch gives."""
    ref.zero_grad(set_to_none=True)
    loss_fn(ref).backward()
    out = {}
    for n, p in ref.named_parameters():
        used = torch.tensor([0.0 if p.grad is None else 1.0])
        dist.all_reduce(used)
        if used.item() == 0:
            out[n] = None
            continue
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out[n] = g / ws
    return out


def _assert_grads(model, expected, what, rtol=1e-5, atol=1e-6):
    for n, p in model.named_parameters():
        exp = expected[n]
        if exp is None:
            assert p.grad is None, f"{what}: {n} should have no grad (unused on every rank)"
            continue
        assert p.grad is not None, f"{what}: {n} has no grad"
        torch.testing.assert_close(
            p.grad.full_tensor(), exp, rtol=rtol, atol=atol, msg=lambda m: f"{what} {n}: {m}"
        )


class _LiveGradBuffers:
    """Counts live unsharded-gradient DBuffers (by role name) through DBuffer.alloc/free."""

    def __init__(self, root_group):
        from raggedfsdp.buffer import DBuffer

        self.cls, self.live, self.peak, self.peak_non_root = DBuffer, set(), 0, 0
        self.root_group = root_group
        self._alloc, self._free, self._init = DBuffer.alloc, DBuffer.free, DBuffer.__init__
        counter = self

        def alloc(buf, zero=False):
            fresh = counter._alloc(buf, zero)
            counter._update(buf)
            return fresh

        def free(buf):
            counter._free(buf)
            counter._update(buf)

        def init(buf, *a, **k):
            counter._init(buf, *a, **k)
            counter._update(buf)

        DBuffer.alloc, DBuffer.free, DBuffer.__init__ = alloc, free, init

    def _update(self, buf):
        if buf.name not in GRAD_NAMES:
            return
        (self.live.add if buf.is_allocated else self.live.discard)(buf)
        self.peak = max(self.peak, len(self.live))
        root = {self.root_group.bufs.grads, self.root_group.bufs.acc}
        self.peak_non_root = max(self.peak_non_root, len([b for b in self.live if b not in root]))

    def close(self):
        self.cls.alloc, self.cls.free, self.cls.__init__ = self._alloc, self._free, self._init


def _bounded_memory(rank, ws, mesh):
    import raggedfsdp
    from raggedfsdp.fsdp import set_runtime_options

    n_layers = 6
    data = batches(2, 2 * ws)
    for k in (1, 2):
        torch.manual_seed(0)
        ref = ToyLM(n_layers)
        model = shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh)
        model.set_reduce_scatter_max_input_buffers(k)
        set_runtime_options(
            model, early_free=False
        )  # the bound under slow communication (early free lowers it)
        for tok, tgt in data:
            tok_l, tgt_l = _slice(tok, tgt, rank, ws)
            counter = _LiveGradBuffers(model._raggedfsdp_state.group)
            try:
                model.zero_grad(set_to_none=True)
                lm_loss(model, tok_l, tgt_l).backward()
            finally:
                counter.close()
            # flat grad buffers exist only as reduce-scatter inputs (Note [grad fold]): at most K at once,
            # the root's included (its fold runs in the final callback, after room is made)
            assert counter.peak <= k, f"K={k}: {counter.peak} grad buffers alive"
            assert counter.peak_non_root >= min(k, n_layers), "counter saw no overlap: test is vacuous"
            assert not counter.live, (
                f"grad buffers left alive after backward: {[b.name for b in counter.live]}"
            )
            assert model._raggedfsdp_state.comm.reduces.peak_inflight <= k
            expected = _ddp_oracle_grads(ref, lambda m: lm_loss(m, tok_l, tgt_l), ws)
            _assert_grads(model, expected, f"K={k}")
    # Note [early free] with real gloo collectives and what they report themselves: once an in-flight
    # reduce-scatter reports completion, the next hook frees its input, so even with K = 2 no two block
    # reduce-scatter inputs are ever alive at once; the gradients stay exact. gloo's reduce-scatter work
    # reports is_completed() only after wait(), so this holds only because the reduce-scatter is settled
    # when issued (Note [settled reduce-scatter] in raggedfsdp/fsdp/_reduce.py), as FSDP2's synchronous one
    torch.manual_seed(0)
    ref = ToyLM(n_layers)
    model = shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh)
    model.set_reduce_scatter_max_input_buffers(2)
    tok_l, tgt_l = _slice(*data[0], rank, ws)
    counter = _LiveGradBuffers(model._raggedfsdp_state.group)
    # and no all-gather (a prefetch) is still unwaited when a post-backward folds its grads into the flat
    # buffer: gloo's all-gather owns a full-size scratch until waited (CommContext.wait_gathers)
    from raggedfsdp.fsdp._grads import UnitGrads

    groups = [st.group for m in model.modules() if (st := getattr(m, "_raggedfsdp_state", None)) and st.group]
    seen, orig_fold = [], UnitGrads.fold

    def fold(self):
        seen.append([(g.unit_name, g._unshard.waited) for g in groups if g._unshard is not None])
        return orig_fold(self)

    UnitGrads.fold = fold
    try:
        lm_loss(model, tok_l, tgt_l).backward()
    finally:
        counter.close()
        UnitGrads.fold = orig_fold
    assert counter.peak_non_root == 1, (
        f"early free on gloo: {counter.peak_non_root} block reduce-scatter inputs alive at once"
    )
    assert any(seen), f"no all-gather in flight at any fold: the check is vacuous ({seen})"
    unwaited = [s for s in seen if not all(w for _, w in s)]
    assert not unwaited, f"all-gathers not waited before a fold allocates the grad buffer: {unwaited}"
    _assert_grads(model, _ddp_oracle_grads(ref, lambda m: lm_loss(m, tok_l, tgt_l), ws), "early free")
    with pytest.raises(ValueError, match="max_input_buffers=0"):
        model.set_reduce_scatter_max_input_buffers(0)


def _forward_prefetch(rank, ws, mesh):
    import raggedfsdp
    from raggedfsdp.buffer import dbuffer

    torch.manual_seed(0)
    model = shard_model(ToyLM(4), raggedfsdp.fully_shard, mesh)
    layers = list(model.layers)

    # by storage: the library hands the collective an alias of the buffer (Note [gloo release])
    def key(t):
        return t.untyped_storage()._cdata

    out_to_unit = {key(layer._raggedfsdp_state.group.bufs.params.data): i for i, layer in enumerate(layers)}
    log: list[tuple[str, int]] = []
    orig = dbuffer._all_gather_single

    def logged(out, inp, *a, **k):
        if key(out) in out_to_unit and not torch._C._current_graph_task_id() != -1:
            log.append(("all-gather", out_to_unit[key(out)]))
        return orig(out, inp, *a, **k)

    for i, layer in enumerate(layers):  # `down` is the block's last matmul: its end is the compute's end
        layer.down.register_forward_hook(lambda *_a, i=i: log.append(("compute-end", i)))
    dbuffer._all_gather_single = logged
    try:
        for step, (tok, tgt) in enumerate(batches(2, 2 * ws)):
            log.clear()
            lm_loss(model, *_slice(tok, tgt, rank, ws)).backward()
            pos = {e: j for j, e in enumerate(log)}
            for i in range(len(layers) - 1):
                issued, ended = pos[("all-gather", i + 1)], pos[("compute-end", i)]
                if step == 0:  # no recorded order yet: gathered on demand
                    assert issued > ended, log
                else:
                    assert issued < ended, (
                        f"step {step}: all-gather of unit {i + 1} after unit {i}'s compute: {log}"
                    )
    finally:
        dbuffer._all_gather_single = orig
    # an explicit empty list switches it off for that unit
    layers[0].set_modules_to_forward_prefetch([])
    st = layers[1]._raggedfsdp_state
    assert layers[0]._raggedfsdp_state.forward_prefetch == [] and st.forward_prefetch is None


class BoomLM(ToyLM):
    def forward(self, tokens):
        x = self.emb(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1:
                x = Boom.apply(x)
        return self.head(self.norm(x))


def _reset_after_exception(rank, ws, mesh):
    import raggedfsdp

    torch.manual_seed(0)
    ref = BoomLM(4)
    model = shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh)
    tok, tgt = _slice(*batches(1, 2 * ws)[0], rank, ws)
    Boom.armed = True
    with pytest.raises(RuntimeError, match="injected failure"):
        lm_loss(model, tok, tgt).backward()
    Boom.armed = False
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    for st in model._raggedfsdp_state.all_states:
        g = st.group
        assert not g.bufs.grads.is_allocated and not g.bufs.params.is_allocated, "reset left buffers alive"
    assert not model._raggedfsdp_state.comm.reduces.inflight
    lm_loss(model, tok, tgt).backward()
    expected = _ddp_oracle_grads(ref, lambda m: lm_loss(m, tok, tgt), ws)
    _assert_grads(model, expected, "clean step after reset_iter_state")


class ProbeLM(ToyLM):
    """A rank-dependent branch inside the root unit: `extra` is used on rank 0 only, `never` nowhere."""

    def __init__(self):
        super().__init__(2)
        self.extra = nn.Linear(13, 13)
        self.never = nn.Linear(13, 13)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        if dist.get_rank() == 0:
            x = x + self.extra(x)
        return self.head(self.norm(x))


def _used_flags_and_zero1(rank, ws, mesh):
    import raggedfsdp

    tok, tgt = _slice(*batches(1, 2 * ws)[0], rank, ws)
    torch.manual_seed(0)
    ref = ProbeLM()
    model = shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh)
    lm_loss(model, tok, tgt).backward()
    expected = _ddp_oracle_grads(ref, lambda m: lm_loss(m, tok, tgt), ws)
    assert expected["extra.weight"] is not None and expected["never.weight"] is None
    _assert_grads(model, expected, "rank-local use")
    # ZeRO-1: a torch.optim step on rank 0 only, of params outside FSDP, must not make rank 0 re-gather
    torch.manual_seed(0)
    ref = ToyLM(2)
    model = shard_model(copy.deepcopy(ref), raggedfsdp.fully_shard, mesh, zero_stage=1)
    probe = nn.Linear(13, 2)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    # foreach: the optimizer kernels that do not bump DTensor version counters (the CUDA default)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for tok, tgt in batches(3, 2 * ws):
        lm_loss(model, *_slice(tok, tgt, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            probe(torch.randn(2, 13)).sum().backward()
            probe_opt.step()
        lm_loss(ref, tok, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = full_params(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"zero1 {n}: {m}")


def _debug_invariant(rank, ws, mesh):
    import raggedfsdp
    from raggedfsdp.buffer import BufferLifetimeError, CommHandle, DBuffer, set_debug
    from raggedfsdp.planner import plan_layout

    set_debug(True)
    try:
        torch.manual_seed(0)
        model = shard_model(ToyLM(2), raggedfsdp.fully_shard, mesh)
        for tok, tgt in batches(2, 2 * ws):
            lm_loss(model, *_slice(tok, tgt, rank, ws)).backward()
        layout = plan_layout([8 * ws], [1], ws)
        buf = DBuffer(
            layout,
            sharded=False,
            rank=rank,
            dtype=torch.float32,
            device=torch.device("cpu"),
            shapes=[(8 * ws,)],
        )
        handle = CommHandle(dist.all_reduce(buf.data, async_op=True), [buf], None, "all-reduce")
        with pytest.raises(BufferLifetimeError, match="not waited"):
            buf.free()  # a collective still uses it
        handle.wait()
        buf.free()
    finally:
        set_debug(False)


def test_runtime_mechanics():
    """Bounded grad memory (K=1, 2), forward prefetch order, rank-local used flags, ZeRO-1 with a
    rank-local optimizer step, reset_iter_state after an exception, debug invariant; 3 ranks."""
    SPAWNS.check(3, "runtime")


def _runtime_cases(rank, ws, only=None):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    for case in (
        _bounded_memory,
        _forward_prefetch,
        _used_flags_and_zero1,
        _reset_after_exception,
        _debug_invariant,
    ):
        if only is None or case.__name__ == only:
            case(rank, ws, mesh)


def _bf16_grads(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    init = ToyLM().state_dict()
    micro = 4
    tok, tgt = _slice(*batches(1, 2 * micro * ws)[0], rank, ws)
    results = {}
    for name, fs, mp in (
        ("ragged", raggedfsdp.fully_shard, raggedfsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
        ("torch", torch_fully_shard, TorchMP(torch.bfloat16, torch.float32)),
    ):
        model = ToyLM()
        model.load_state_dict(init)
        shard_model(model, fs, mesh, mp_policy=mp)
        lm_loss(model, tok[:2], tgt[:2]).backward()  # one synced backward
        one = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        for i in range(micro):  # no-sync micro-batches, synced last
            model.set_requires_gradient_sync(i == micro - 1)
            lm_loss(model, tok[2 * i : 2 * i + 2], tgt[2 * i : 2 * i + 2]).backward()
        acc = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        results[name] = (one, acc)
    for what, a, b in (
        ("one backward", results["ragged"][0], results["torch"][0]),
        ("no-sync accumulation", results["ragged"][1], results["torch"][1]),
    ):
        for n in a:
            assert a[n].dtype == torch.float32
            # same bf16 compute and fp32 reduction: equal up to fp32 summation order
            torch.testing.assert_close(
                a[n], b[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"bf16 {what} {n}: {m}"
            )


def test_bf16_gradients_and_no_sync_accumulation_match_torch_fsdp():
    """param_dtype=bf16, reduce_dtype=fp32: gradients after one backward and after 4 micro-batches
    (no-sync accumulation in fp32) equal torch's fully_shard (so a 2x scale or bf16 accumulation fails)."""
    SPAWNS.check(3, "runtime_bf16_grads")
