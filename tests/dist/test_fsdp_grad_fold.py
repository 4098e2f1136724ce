"""Adversarial cases for Note [grad fold] and Note [early free] (``raggedfsdp/fsdp/_grads.py``,
``_reduce.py``): each scenario's sharded gradients are compared with a DDP oracle (the unsharded
model run on every rank's own data, gradients averaged over ranks; torch's ``fully_shard`` for mixed
precision), and the gradients of the early free modes -- off, ``is_done()`` always True, ``is_done()``
random per rank -- must be bitwise equal (collective order must not depend on completion timing)."""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import DIM, VOCAB, Block, Boom

MODES = ("off", "always", "random")  # Note [early free] off; is_done() always True; random per rank


class Pair(nn.Module):
    """Two blocks in one unit, each optionally checkpointed inside the unit."""

    def __init__(self, ac=False):
        super().__init__()
        self.a, self.b = Block(), Block()
        self.ac = ac

    def forward(self, x):
        if self.ac:
            return checkpoint(self.b, checkpoint(self.a, x, use_reentrant=False), use_reentrant=False)
        return self.b(self.a(x))


class SkipBlock(Block):
    """``skip`` (set per rank / step): ``up`` unused, ``down`` gets a zero gradient."""

    skip = False

    def forward(self, x):
        if self.skip:
            return x + self.down(x.new_zeros(x.shape[:-1] + (self.up.out_features,)))
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, tie=False, pair_ac=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Pair(pair_ac), SkipBlock()])
        self.extra = nn.Linear(DIM, DIM)  # in block unit 2's neighbourhood: used per scenario
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, tok, body=None):
        return (body or _std_forward)(self, tok)


def _std_forward(m, tok):
    x = m.emb(tok)
    for b in m.blocks:
        x = b(x)
    return m.head(m.norm(x))


def _loss(logits, tgt):
    return F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())


def _data(steps, n, seq=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (n, seq), generator=g), torch.randint(0, VOCAB, (n, seq), generator=g))
        for _ in range(steps)
    ]


def _shard(model, mesh, fs, extra_in_block=False, **kw):
    for b in model.blocks:
        fs(b, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


_EARLY_FREE = [True]  # of the current mode; applied to each model by _early_free (Note [early free])


def _early_free(model):
    from raggedfsdp.fsdp import set_runtime_options

    set_runtime_options(model, early_free=_EARLY_FREE[0])
    return model


def _set_mode(mode, rank, seed):
    from raggedfsdp.buffer.streams import CommHandle

    if not hasattr(CommHandle, "is_done"):  # a runtime without Note [early free]
        return
    if not hasattr(CommHandle, "_orig_is_done"):
        CommHandle._orig_is_done = CommHandle.is_done
    _EARLY_FREE[0] = mode != "off"
    rng = random.Random(1000 * seed + rank)
    if mode == "always":
        CommHandle.is_done = lambda self: True
    elif mode == "random":
        CommHandle.is_done = lambda self: rng.random() < 0.5
    else:
        CommHandle.is_done = CommHandle._orig_is_done


def _oracle(ref, rank, ws):
    """The grads ``ref`` got from this rank's data, averaged over all ranks; None where unused everywhere
    (one all-reduce of every grad and a used flag each)."""
    params = list(ref.named_parameters())
    flat = torch.cat(
        [
            torch.cat(
                [
                    (p.grad.detach().to_dense() if p.grad is not None else torch.zeros_like(p)).reshape(-1),
                    torch.tensor([float(p.grad is not None)]),
                ]
            )
            for _, p in params
        ]
    )
    dist.all_reduce(flat)
    out, off = {}, 0
    for n, p in params:
        g, used = flat[off : off + p.numel()], flat[off + p.numel()].item()
        off += p.numel() + 1
        out[n] = None if used == 0 else (g / ws).view(p.shape)
    return out


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        out[n] = None if p.grad is None else p.grad.full_tensor().detach().clone()
    return out


def _local_grads(model):
    """Each grad's local piece with its layout (no collective): two runs whose pieces are bitwise equal
    on every rank, under the same placements and shape, have bitwise equal full grads."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (
            None
            if g is None
            else (g.to_local().detach().clone(), tuple(g.placements), g.shape, g.device_mesh)
        )
    return out


def _compare_pieces(case, got, exp, rtol=1e-5, atol=1e-6):
    """Grads equal the expected ones, each rank on its pieces: ``got`` from ``_local_grads``; ``exp``
    (name -> full grad, None where there must be none) sliced to this rank's piece by
    ``distribute_tensor(..., src_data_rank=None)`` (local, no collective): over all ranks, element for
    element the check of grads gathered with ``full_tensor()``."""
    from torch.distributed.tensor import distribute_tensor

    for n, e in exp.items():
        g = got[n]
        if e is None:
            assert g is None, f"{case}: {n} should have no grad"
            continue
        assert g is not None, f"{case}: {n} has no grad"
        local, placements, shape, mesh = g
        assert shape == e.shape, f"{case} {n}: shape {shape} != {e.shape}"
        want = distribute_tensor(e, mesh, placements, src_data_rank=None)
        torch.testing.assert_close(
            local, want.to_local(), rtol=rtol, atol=atol, msg=lambda m: f"{case} {n}: {m}"
        )


def _assert_bitwise(case, a, b):
    """``a``, ``b``: ``_local_grads`` of two runs; the same grads present, bitwise equal pieces."""
    for n in a:
        if a[n] is None or b[n] is None:
            assert a[n] is None and b[n] is None, f"{case} {n}: presence differs"
            continue
        assert a[n][1:3] == b[n][1:3], f"{case} {n}: layout {b[n][1:3]} != {a[n][1:3]}"
        assert torch.equal(a[n][0], b[n][0]), f"{case} {n}: not bitwise equal"


def _scenario(
    case,
    rank,
    ws,
    mesh,
    build,
    run,
    *,
    steps=2,
    shard_kw=None,
    k=(1,),
    modes=("off", "random"),
    oracle=True,
    step_opt=True,
    rtol=1e-5,
    atol=1e-6,
    shard_fn=None,
    post_shard=None,
):
    """build() -> unsharded model; run(model, step, sync, rank) does the step's forward/backward(s).
    Compares with the DDP oracle after every step (optimizer steps in between), and every mode bitwise.
    Each rank compares its pieces (``_compare_pieces``: no all-gather per grad and step); the first mode
    of each K against the oracle, a later mode of that K bitwise against the first (``_assert_bitwise``:
    the same full grads, so the same oracle check, without a second reference run)."""
    import raggedfsdp

    torch.manual_seed(0)
    base = build()
    local = {}
    for kk in k:
        for mode in modes:
            first_of_k = mode == modes[0]
            _set_mode(mode, rank, seed=kk)
            try:
                ref = copy.deepcopy(base)
                model = (shard_fn or _shard)(
                    copy.deepcopy(base), mesh, raggedfsdp.fully_shard, **(shard_kw or {})
                )
                _early_free(model)
                if post_shard is not None:
                    post_shard(model)
                model.set_reduce_scatter_max_input_buffers(kk)
                opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1)
                ref_opt = torch.optim.SGD([p for p in ref.parameters()], lr=0.1)
                hist = []
                for step in range(steps):
                    run(model, step, lambda on: model.set_requires_gradient_sync(on), rank)
                    hist.append(_local_grads(model))
                    if not first_of_k:
                        _assert_bitwise(f"{case} K={kk} mode={mode} step={step} vs {modes[0]}",
                                        local[(kk, modes[0])][step], hist[-1])  # fmt: skip
                    elif oracle:
                        run(ref, step, lambda on: None, rank)
                        exp = _oracle(ref, rank, ws)
                        _compare_pieces(f"{case} K={kk} mode={mode} step={step}", hist[-1], exp, rtol, atol)
                        for n, p in ref.named_parameters():  # the reference steps with the averaged grads
                            p.grad = exp[n]
                    if step_opt:
                        opt.step()
                        ref_opt.step()
                    opt.zero_grad(set_to_none=True)
                    ref_opt.zero_grad(set_to_none=True)
                local[(kk, mode)] = hist
            finally:
                _set_mode("on", rank, 0)
    first = next(iter(local))
    for key, hist in local.items():  # across K: the same grads present (each K was checked vs the oracle)
        for step, (a, b) in enumerate(zip(local[first], hist)):
            for n in a:
                assert (a[n] is None) == (b[n] is None), f"{case} {key} step {step} {n}: presence differs"


# ---- scenarios -------------------------------------------------------------------------------


def _local(step, rank, ws, n=2, micro=1, seed=1):
    tok, tgt = _data(step + 1, n * ws * micro, seed=seed)[step]
    per = n * micro
    return tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def _cases_1d(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))

    def std(model, step, sync, rank):
        tok, tgt = _local(step, rank, ws)
        _loss(model(tok), tgt).backward()

    _scenario("tied-root", rank, ws, mesh, lambda: Net(tie=True), std)

    def twice(model, step, sync, rank):  # unit blocks[0] twice in a row, blocks[2] on two branches
        tok, tgt = _local(step, rank, ws)

        def body(m, tok):
            x = m.emb(tok)
            x = m.blocks[0](m.blocks[0](x))
            x = m.blocks[1](x)
            x = m.blocks[2](x) + m.blocks[2](x * 0.5)
            return m.head(m.norm(x))

        _loss(model(tok, body), tgt).backward()

    _scenario("called-twice", rank, ws, mesh, Net, twice, k=(2,), modes=MODES)

    def ac(model, step, sync, rank):
        tok, tgt = _local(step, rank, ws)

        def body(m, tok):
            x = m.emb(tok)
            x = checkpoint(m.blocks[0], x, use_reentrant=False)
            x = m.blocks[1](x)  # checkpoints its two blocks inside the unit
            x = checkpoint(lambda y: m.blocks[2](m.blocks[2](y)), x, use_reentrant=False)
            return m.head(m.norm(x))

        _loss(model(tok, body), tgt).backward()

    _scenario("activation-checkpointing", rank, ws, mesh, lambda: Net(pair_ac=True), ac)

    def ac_stack(model, step, sync, rank):
        tok, tgt = _local(step, rank, ws)

        def body(m, tok):
            def stack(x):
                for b in m.blocks:
                    x = b(x)
                return x

            x = checkpoint(stack, m.emb(tok), use_reentrant=False)
            return m.head(m.norm(x))

        _loss(model(tok, body), tgt).backward()

    _scenario("checkpoint-around-all-units", rank, ws, mesh, Net, ac_stack)

    def rank_unused(model, step, sync, rank):  # data-dependent: blocks[2].up used on rank 0 only (bypass)
        tok, tgt = _local(step, rank, ws)
        model.blocks[2].skip = rank != 0

        def body(m, tok):
            x = m.blocks[2](m.blocks[1](m.blocks[0](m.emb(tok))))
            x = x + m.extra(x) if (rank + step) % 2 == 0 else x
            return m.head(m.norm(x))

        _loss(model(tok, body), tgt).backward()

    _scenario("unused-on-some-ranks", rank, ws, mesh, Net, rank_unused)

    def retain(model, step, sync, rank):
        tok, tgt = _local(step, rank, ws)
        loss = _loss(model(tok), tgt)
        loss.backward(retain_graph=True)
        (loss * 0.5).backward()

    _scenario("retain-graph-twice", rank, ws, mesh, Net, retain)

    def keep_grads(model, step, sync, rank):  # no zero_grad between two backwards: .grad accumulates
        for i in range(2):
            tok, tgt = _local(2 * step + i, rank, ws)
            _loss(model(tok), tgt).backward()

    _scenario("accumulate-across-steps", rank, ws, mesh, Net, keep_grads)


def _no_prefetch(model):
    """No forward/backward prefetch: a unit not run in a backward stays sharded (and untouched) in it."""
    for m in (model, *model.blocks):
        m.set_modules_to_forward_prefetch([])
        m.set_modules_to_backward_prefetch([])


def _cases_accum(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    _scenario("no-sync", rank, ws, mesh, Net, _accum_run())
    _scenario("no-sync-freeze-mid-window", rank, ws, mesh, Net, _accum_run(freeze_at=1))
    _scenario(
        "no-sync-unused-on-one-rank", rank, ws, mesh, Net, _accum_run(skip_rank=(0, 1)), k=(2,), modes=MODES
    )
    # blocks[2].up gets no gradient on any rank in micro-batch 0 and its unit holds grads after it: from
    # micro-batch 1 on its gradient is added into a pre-set .grad view, seen only by the pre-hook that
    # every param then gets (Note [grad hooks]); without it, up would end the step with no .grad
    no_hooks_plan = ((False, True), (False, False), (False, True))
    _scenario(
        "no-sync-param-first-used-in-a-view-micro",
        rank,
        ws,
        mesh,
        Net,
        _accum_run(skip_plan=no_hooks_plan, skip_all=0),
        shard_fn=_one_poll_hook_shard,  # this toy's units have <= 8 params: every one is a poll point
    )
    skipped_last = ((False, True), (False, False), (True, True))
    # the unit skipped in the synced micro-batch is not prefetched: its held grads were never reduced
    # (missing from .grad, then added into the next step's); a prefetched one was reduced by chance
    _scenario(
        "no-sync-unit-skipped-in-synced-micro, no prefetch",
        rank,
        ws,
        mesh,
        Net,
        _accum_run(skip_plan=skipped_last),
        post_shard=_no_prefetch,
    )


def _one_poll_hook_shard(model, mesh, fs, **kw):
    """``_shard`` with one gradient pre-hook per unit (Note [grad hooks]), as in a unit of many params."""
    from raggedfsdp.fsdp import _grads

    saved, _grads.POLL_HOOKS_PER_UNIT = _grads.POLL_HOOKS_PER_UNIT, 1
    try:
        return _shard(model, mesh, fs, **kw)
    finally:
        _grads.POLL_HOOKS_PER_UNIT = saved


def _vs_torch(
    case, rank, ws, mesh, build, run, mp, *, steps=2, modes=("off", "random"), rtol=1e-4, atol=1e-6
):
    """Mixed precision: the same steps under torch's fully_shard with the same policy are the reference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    torch.manual_seed(0)
    base = build()

    def train(fs, policy, grads):
        model = _shard(copy.deepcopy(base), mesh, fs, mp_policy=policy)
        if fs is raggedfsdp.fully_shard:
            _early_free(model)
        opt = torch.optim.SGD(list(model.parameters()), lr=0.1)
        hist = []
        for step in range(steps):
            run(model, step, lambda on: model.set_requires_gradient_sync(on), rank)
            hist.append(grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return hist

    want = train(torch_fully_shard, TorchMP(*mp), _grads)
    first = None
    for mode in modes:  # the first mode compared with torch's grads, a later one bitwise with it
        _set_mode(mode, rank, seed=7)
        try:
            got = train(
                raggedfsdp.fully_shard,
                raggedfsdp.MixedPrecisionPolicy(*mp),
                _local_grads,
            )
        finally:
            _set_mode("on", rank, 0)
        for step, g in enumerate(got):
            if first is None:
                _compare_pieces(f"{case} mode={mode} step={step}", g, want[step], rtol=rtol, atol=atol)
            else:
                _assert_bitwise(f"{case} mode={mode} step={step} vs {modes[0]}", first[step], g)
        first = first or got


def _cases_mp(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    bf = torch.bfloat16
    plan = ((False, True), (False, False), (False, True))  # torch's fully_shard fails on a unit not run
    _vs_torch(
        "bf16/fp32 no-sync",
        rank,
        ws,
        mesh,
        Net,
        _accum_run(skip_plan=plan, skip_rank=(1, 0)),
        (bf, torch.float32),
    )
    _vs_torch(
        "bf16/bf16 no-sync",
        rank,
        ws,
        mesh,
        Net,
        _accum_run(skip_plan=plan, skip_rank=(1, 0)),
        (bf, bf),
        rtol=2e-2,
        atol=1e-3,
        modes=("off",),
    )
    import raggedfsdp

    for red in (torch.float32, bf):  # units skipped in micro-batches (synced one included): fp32 oracle
        _scenario(
            f"bf16/{red} no-sync, unit skipped in synced micro",
            rank,
            ws,
            mesh,
            Net,
            _accum_run(skip_plan=((True, True), (False, False), (True, True))),
            modes=("off",),
            shard_kw=dict(mp_policy=raggedfsdp.MixedPrecisionPolicy(bf, red)),
            rtol=5e-2,
            atol=2e-3,
            post_shard=_no_prefetch,
        )


def _boom_body(m, tok):
    x = m.blocks[1](m.blocks[0](m.emb(tok)))
    return m.head(m.norm(m.blocks[2](Boom.apply(x))))


def _reset_run(model, step, sync, rank):
    """micro 0 (no-sync) fails mid-backward: reset_iter_state + zero_grad; then 2 no-sync micro-batches
    and a synced one, the synced one failing once first (then redone)."""
    ws = dist.get_world_size()
    tok, tgt = _local(step, rank, ws, n=2, micro=4)
    failed = False
    i = 0
    while i < 4:
        sync(i == 3)
        Boom.armed = (i == 0 or (i == 3 and not failed)) and step == 0
        try:
            (_loss(model(tok[2 * i : 2 * i + 2], _boom_body), tgt[2 * i : 2 * i + 2]) / 4).backward()
        except RuntimeError as e:
            assert "injected failure" in str(e)
            if hasattr(model, "reset_iter_state"):
                model.reset_iter_state()
            model.zero_grad(set_to_none=True)
            failed = failed or i == 3
            i = 1 if i == 3 else i + 1  # a failed synced micro-batch restarts the window after micro 0
            continue
        finally:
            Boom.armed = False
        i += 1


def _user_grad_run(model, step, sync, rank):
    """.grad set by hand before backward (a foreign tensor, incl. on a param unused this step)."""
    ws = dist.get_world_size()
    for p in (model.blocks[0].up.weight, model.emb.weight, model.extra.bias):
        p.grad = torch.full_like(p, 0.25 * (step + 1))
    tok, tgt = _local(step, rank, ws)
    _loss(model(tok), tgt).backward()


def _frozen_build():
    m = Net()
    m.blocks[1].a.up.weight.requires_grad_(False)  # compacted grad layout in the Pair unit
    for p in m.blocks[0].norm.parameters():
        p.requires_grad_(False)
    return m


def _frozen_run(model, step, sync, rank):
    # step 1: unfreeze one of unit 1's frozen params and freeze a param of unit 2 (layout changes)
    model.blocks[1].a.up.weight.requires_grad_(step != 1)
    model.blocks[2].down.weight.requires_grad_(step != 1)
    _accum_run(freeze_at=1, skip_rank=(1, 2))(model, step, sync, rank)


def _multi_module_shard(model, mesh, fs, **kw):
    fs([model.blocks[0], model.blocks[2]], mesh=mesh, **kw)
    fs(model.blocks[1], mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


def _create_graph_run(model, step, sync, rank):
    """A no-sync window (param_dtype grads held, views pre-set) with one backward(create_graph=True):
    autograd then sets .grad out of place, so a pre-set view was counted twice."""
    ws = dist.get_world_size()
    tok, tgt = _local(step, rank, ws, n=2, micro=3)
    for i in range(3):
        sync(i == 2)
        (_loss(model(tok[2 * i : 2 * i + 2]), tgt[2 * i : 2 * i + 2]) / 3).backward(create_graph=i == 1)


def _sparse_build():
    m = Net()
    m.emb.sparse = True  # sparse grads: folded densified (the fold's reshape failed on them)
    return m


def _std_run(model, step, sync, rank):
    tok, tgt = _local(step, rank, dist.get_world_size())
    _loss(model(tok), tgt).backward()


def _cases_misc(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    _scenario(
        "create_graph in a no-sync window",
        rank,
        ws,
        mesh,
        Net,
        _create_graph_run,
        k=(1,),
        steps=1,
        modes=("off", "random"),
    )
    _scenario("sparse embedding grads", rank, ws, mesh, _sparse_build, _accum_run(), modes=("off",))
    _scenario("reset-after-exception", rank, ws, mesh, Net, _reset_run, k=(1,))
    _scenario("user-set-grad", rank, ws, mesh, Net, _user_grad_run, k=(1,))
    _scenario("frozen-and-toggled", rank, ws, mesh, _frozen_build, _frozen_run, steps=3, modes=MODES)
    _scenario(
        "cpu-offload no-sync",
        rank,
        ws,
        mesh,
        Net,
        _accum_run(skip_rank=(2, 1)),
        k=(2,),
        shard_kw=dict(offload_policy=raggedfsdp.CPUOffloadPolicy(pin_memory=False)),
    )
    _scenario(
        "reshard_after_backward=False no-sync",
        rank,
        ws,
        mesh,
        Net,
        _accum_run(),
        k=(2,),
        post_shard=lambda m: m.set_reshard_after_backward(False),
    )
    _scenario(
        "multi-module unit",
        rank,
        ws,
        mesh,
        Net,
        _accum_run(skip_plan=((False, True), (False, False), (False, True))),
        k=(1,),
        shard_fn=_multi_module_shard,
    )


def _hsdp_run(model, step, sync, rank):
    """HSDP micro-batches: no-sync, then reduce-scatter only (all-reduce deferred) x2, then full sync."""
    ws = dist.get_world_size()
    micro = 4
    tok, tgt = _local(step, rank, ws, n=2, micro=micro)
    for i in range(micro):
        if hasattr(model, "set_requires_all_reduce"):
            model.set_requires_gradient_sync(i > 0)
            model.set_requires_all_reduce(i == micro - 1)
        model.blocks[2].skip = (i, rank) in ((1, 3), (2, 0))
        body = _accum_body(skip_unit2=False, use_extra=(i + rank) % 2 == 0)
        (_loss(model(tok[2 * i : 2 * i + 2], body), tgt[2 * i : 2 * i + 2]) / micro).backward()


def _hsdp_skip_run(model, step, sync, rank):
    ws = dist.get_world_size()
    tok, tgt = _local(step, rank, ws, n=2, micro=3)
    for i in range(3):
        if hasattr(model, "set_requires_all_reduce"):
            model.set_requires_gradient_sync(i != 0)
            model.set_requires_all_reduce(i == 2)
        body = _accum_body(skip_unit2=(i == 2), use_extra=True)
        (_loss(model(tok[2 * i : 2 * i + 2], body), tgt[2 * i : 2 * i + 2]) / 3).backward()


def _hsdp_unfreeze_run(model, step, sync, rank):
    """Params unfrozen inside an HSDP window after a held and a deferred micro-batch (the compacted grad
    layout changes while the held grads and the partial sum exist)."""
    ws = dist.get_world_size()
    tok, tgt = _local(step, rank, ws, n=2, micro=4)
    for p in (model.blocks[1].a.up.weight, model.blocks[0].up.weight):
        p.requires_grad_(False)
    for i in range(4):
        if i == 2:
            for p in (model.blocks[1].a.up.weight, model.blocks[0].up.weight):
                p.requires_grad_(True)
        if hasattr(model, "set_requires_all_reduce"):
            model.set_requires_gradient_sync(i != 0)
            model.set_requires_all_reduce(i == 3)
        (
            _loss(model(tok[2 * i : 2 * i + 2], _accum_body(False, True)), tgt[2 * i : 2 * i + 2]) / 4
        ).backward()


def _cases_hsdp(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _scenario("hsdp deferred all-reduce", rank, ws, mesh, Net, _hsdp_run, k=(2,), modes=MODES)
    _scenario("hsdp frozen", rank, ws, mesh, _frozen_build, _hsdp_run, modes=("random",))
    _scenario("hsdp unfreeze mid-window", rank, ws, mesh, _frozen_build, _hsdp_unfreeze_run, steps=1)
    # a unit whose all-reduce was deferred does not run in the synced micro-batch: its partial sum was
    # never all-reduced (missing from .grad, then added into the next step's)
    _scenario(
        "hsdp deferred, unit skipped in synced micro",
        rank,
        ws,
        mesh,
        Net,
        _hsdp_skip_run,
        post_shard=_no_prefetch,
    )
    _scenario(
        "hsdp deferred, unit skipped in synced micro, prefetch",
        rank,
        ws,
        mesh,
        Net,
        _hsdp_skip_run,
        k=(1,),
        modes=("off",),
    )


def test_grad_fold_hsdp_2x2():
    SPAWNS.check(4, "grad_fold_hsdp")


def _accum_body(skip_unit2, use_extra):
    def body(m, tok):
        x = m.blocks[1](m.blocks[0](m.emb(tok)))
        if not skip_unit2:
            x = m.blocks[2](x)
        if use_extra:
            x = x + m.extra(x)
        return m.head(m.norm(x))

    return body


def _accum_run(
    micro=3,
    skip_plan=((True, True), (False, False), (False, True)),
    freeze_at=None,
    skip_rank=None,
    skip_all=None,
):
    """``micro`` micro-batches, gradient sync on the last only; ``skip_plan[i]`` = (skip unit 2 entirely,
    use ``extra``) in micro-batch i; ``freeze_at``: micro-batch from which blocks[0].up.weight is frozen
    (unfrozen again at the next step); ``skip_rank``: (micro, rank) where blocks[2].skip is set;
    ``skip_all``: a micro-batch where every rank sets it."""

    def run(model, step, sync, rank):
        ws = dist.get_world_size()
        tok, tgt = _local(step, rank, ws, n=2, micro=micro)
        model.blocks[0].up.weight.requires_grad_(True)
        for i in range(micro):
            if freeze_at is not None and i == freeze_at:
                model.blocks[0].up.weight.requires_grad_(False)
            model.blocks[2].skip = (skip_rank is not None and (i, rank) == skip_rank) or i == skip_all
            sync(i == micro - 1)
            skip2, extra = skip_plan[i]
            logits = model(tok[2 * i : 2 * i + 2], _accum_body(skip2, extra))
            (_loss(logits, tgt[2 * i : 2 * i + 2]) / micro).backward()

    return run


def _cases_ws3(rank, ws):
    for cases in (_cases_1d, _cases_accum, _cases_mp, _cases_misc):
        cases(rank, ws)


def test_grad_fold_ws3():
    """Tied weights, a unit called twice, activation checkpointing, params unused on some ranks,
    retain_graph, no-sync windows (unit skipped in the synced micro-batch, requires_grad toggled,
    frozen params, bf16/fp32 and bf16/bf16 vs torch's fully_shard), create_graph, sparse grads,
    reset_iter_state after an exception, a hand-set .grad, CPU offload, one unit of two modules."""
    SPAWNS.check(3, "grad_fold")
