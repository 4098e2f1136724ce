"""The quantized parameter all-gather composed with tensor parallelism (dp 2 x tp 2), expert parallelism
(dp 2 x ep 2, torchtitan's layout) and ``torch.compile`` per block (ws 3), on real gloo ranks.

Blocks are tiles of the TP- / EP-LOCAL tensor (``fully_shard`` plans, shards and gathers the local tensor,
Note [FSDP x TP] in raggedfsdp/fsdp/_tp.py), so the reference quantizes each TP / EP chunk of the global
tensor on its own (``_fake_quant_local``); an expert stack split along the expert dim gives the same blocks
as the whole stack. References, independent of the payload / plan code under test:

* gathered values: every unsharded (TP-local) parameter equals ``dequantize(quantize(local chunk of the full
  master))`` (``raggedfsdp.buffer.block_quant`` on the whole chunk, bit-exact against a plain-Python
  reference in tests/unit/test_block_quant.py), bit for bit;
* training: the single-process model on the global batch whose parameters are fake-quantized in forward
  (straight-through gradients), the same AdamW and batches: losses within rtol 1e-4; a quantized run
  differs from the unquantized one (a policy silently dropped fails);
* compile: the per-block compiled run's losses equal the eager quantized run's, with one graph per block
  body and no recompile over the steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _dist import run_distributed

STEPS = 4


def _fake_quant_local(t, policy, tp_dim, tp_size):
    """``t`` (global) quantized chunk by chunk along ``tp_dim`` (``None``: whole), dequantized in fp32."""
    from raggedfsdp.buffer import block_quant as bq

    chunks = [t] if tp_dim is None else list(t.chunk(tp_size, tp_dim))
    out = []
    for c in chunks:
        c = c.detach().contiguous()
        if not policy.eligible(c.shape):
            out.append(c.float())
            continue
        w = c.shape[-1]
        codes, scales = bq.quantize(c.reshape(-1, w), policy.block, policy.dtype)
        deq = bq.dequantize(codes, scales, policy.block, policy.dtype, out_dtype=torch.float32)
        out.append(deq.view(c.shape))
    return out[0] if tp_dim is None else torch.cat(out, tp_dim)


def _split_dims(model):
    """``{name: (dim, size)}`` of the parameters that are DTensors ``Shard(dim)`` on a 1-D TP / EP mesh."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) and p.placements[0].is_shard():
            out[n] = (p.placements[0].dim, p.device_mesh.size())
    return out


def _oracle(make_model, split, policy, steps_data, loss_fn):
    """Single process: losses of AdamW on the fake-quantized model (straight-through), global batches.
    ``loss_fn(model, params, batch)`` runs forward and backward with ``params`` and returns the loss."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in steps_data:
        q = {
            n: _fake_quant_local(p, policy, *split.get(n, (None, 1))).requires_grad_()
            if policy is not None
            else p.detach().clone().requires_grad_()
            for n, p in model.named_parameters()
        }
        losses.append(loss_fn(model, q, batch))
        for n, p in model.named_parameters():
            p.grad = q[n].grad
        opt.step()
        opt.zero_grad()
    return losses


def _check_gathered(model, units, split, policy, tp_rank):
    """Each unit unsharded: its local parameters equal the fake-quantized local chunks, bit for bit."""
    from torch.distributed.tensor import DTensor

    full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    for u in units:
        u.unshard()
    n_quant = 0
    for n, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        dim, size = split.get(n, (None, 1))
        want = _fake_quant_local(full[n], policy, dim, size)
        if dim is not None:
            want = want.chunk(size, dim)[tp_rank]
            n_quant += policy.eligible(want.shape)
        assert local.shape == want.shape and torch.equal(local.detach(), want), n
    for u in units:
        u.reshard()
    return n_quant


# ---- FSDP x TP ------------------------------------------------------------------------------------------

B, T = 4, 16


def _llama():
    from raggedfsdp.app.models import Llama, LlamaConfig

    m = Llama(LlamaConfig.flavor("debug"))
    m.init_weights(seed=3)
    return m


def _llama_batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (B, T + 1), generator=g) for _ in range(STEPS)]


def _llama_loss(model, params, tok):
    from torch.func import functional_call

    logits = model(tok[:, :-1]) if params is None else functional_call(model, params, (tok[:, :-1],))
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1))
    loss.backward()
    return loss.item()


def _tp_case(rank, ws):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import MixedPrecisionPolicy, QuantizedAllGatherPolicy
    from raggedfsdp.app.models import apply_tp

    warnings.simplefilter("ignore")  # padding warnings of the tiny units
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, dp, tp = mesh["dp"].get_group(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    rows = slice(dp * B // 2, (dp + 1) * B // 2)
    batches = _llama_batches()
    # (8, 8) tiles: every TP-local matrix of the debug Llama is quantized; (1, 20) rows: the rowwise
    # (32, 16) local pieces of wo are one narrow block per row where the global (32, 32) has two
    policies = (QuantizedAllGatherPolicy("fp8_e4m3", (8, 8), 0), QuantizedAllGatherPolicy("int8", (1, 20), 0))
    split = _split_dims(apply_tp(_llama(), mesh["tp"]))
    assert split["layers.0.attention.wo.weight"] == (1, 2) and split["output.weight"] == (0, 2), split
    res = {}
    for policy in (*policies, None):
        model = _tp_sharded(mesh, policy)
        if policy is not None:
            units = [*model.layers, model]
            n_quant = _check_gathered(model, units, split, policy, tp)
            assert n_quant >= 14, n_quant  # 7 matrices a block (TP-split), embedding and output
        losses, _ = _tp_train(model, batches, rows, dp_group)
        want = _oracle(_llama, split, policy, batches, _llama_loss)
        if rank == 0:
            print(policy, "ours", losses, "oracle", want)
        torch.testing.assert_close(losses, want, rtol=1e-4, atol=0)
        res[policy] = losses
    for policy in policies:
        assert max(abs(a - b) for a, b in zip(res[None][1:], res[policy][1:])) > 1e-5, policy
    # with the bf16-wire reduce-scatter: bf16 params, fp32 reduce; the same run with the fp32
    # reduce-scatter is the reference (bf16 gradients cast to bf16 exactly: equal up to the sum's order)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    got = {}
    for wire in (None, torch.bfloat16):
        model = _tp_sharded(mesh, policies[0], mp)
        model.set_reduce_scatter_wire_dtype(wire)
        got[wire] = (*_tp_train(model, batches, rows, dp_group), _full_params(model))
    (plain, w_plain, p_plain), (wired, w_wired, p_wired) = got[None], got[torch.bfloat16]
    if rank == 0:
        print("bf16 params, fp32 reduce-scatter", plain, "bf16 wire", wired)
    torch.testing.assert_close(wired, plain, rtol=1e-5, atol=0)
    for n, p in p_wired.items():  # dp 2: a sum of two fp32 values does not depend on the order
        assert torch.equal(p, p_plain[n]), n
    assert w_plain.all_to_all == 0 and w_wired.calls["all_to_all"] == 3 * STEPS, (w_plain, w_wired.calls)
    assert w_wired.all_gather == w_plain.all_gather > 0  # the same quantized payloads


def _full_params(model):
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _tp_sharded(mesh, policy, mp=None):
    from raggedfsdp import MixedPrecisionPolicy, fully_shard
    from raggedfsdp.app.models import apply_tp

    model = apply_tp(_llama(), mesh["tp"])
    mp = mp or MixedPrecisionPolicy()
    for blk in model.layers:
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, all_gather_policy=policy)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=mp, all_gather_policy=policy)


def _tp_train(model, batches, rows, dp_group):
    """AdamW steps on this dp rank's rows; ``(dp-mean losses, the wire bytes of forward + backward)``."""
    import torch.distributed as dist

    from raggedfsdp.buffer.wire import count_wire_bytes

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with count_wire_bytes() as wire:
        for tok in batches:
            loss = _llama_loss(model, None, tok[rows])
            opt.step()
            opt.zero_grad()
            t = torch.tensor(loss)
            dist.all_reduce(t, group=dp_group)
            losses.append(t.item() / 2)
    return losses, wire


def test_quantized_all_gather_with_tp_dp2_tp2():
    run_distributed(_tp_case, 4)


# ---- FSDP beside expert parallelism ----------------------------------------------------------------------


def _moe_loss(model, params, data):
    """The single-process loss of test_moe_ep_fsdp: mean over the ranks' slices of CE + aux."""
    from test_moe_ep_fsdp import WS
    from torch.func import functional_call

    total = 0.0
    for r in range(WS):
        tok = data[r]
        logits = functional_call(model, params, (tok[:, :-1],))
        ce = F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())
        ((ce + model.aux_loss) / WS).backward()  # aux_loss: set by the forward
        total += ce.item() / WS
    return total


def _ep_case(rank, ws):
    """``apply_ep`` then ``apply_fsdp(..., experts_mesh=world['dp'], all_gather_dtype=...)``: the app's
    EP path. With the default policy (32x32 tiles, min_numel 4096) exactly the EP-local expert stacks
    (4, 32, 32) are quantized; every other matrix of the debug MoE is smaller and travels in fp32."""
    import warnings

    import torch.distributed as dist
    from test_moe_ep_fsdp import STEPS as MOE_STEPS
    from test_moe_ep_fsdp import _build, _data, _loss
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import QuantizedAllGatherPolicy
    from raggedfsdp.app.models import apply_ep, apply_fsdp

    warnings.simplefilter("ignore")
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    split = _split_dims(apply_ep(_build(), world["ep"]))
    assert split["layers.0.feed_forward.experts.w1"] == (0, 2), split
    res, grads0 = {}, {}
    for dtype, wire in (("fp8_e4m3", None), ("int8", None), ("none", None), ("fp8_e4m3", torch.bfloat16)):
        policy = QuantizedAllGatherPolicy(dtype) if dtype != "none" else None
        model = apply_ep(_build(), world["ep"])
        apply_fsdp(
            model,
            world["dp", "ep"]._flatten("dp_ep"),
            experts_mesh=world["dp"],
            all_gather_dtype=dtype,
        )
        model.set_reduce_scatter_wire_dtype(wire)
        if policy is not None and wire is None:
            experts = [blk.feed_forward.experts for blk in model.layers]
            units = [*experts, *model.layers, model]
            assert _check_gathered(model, units, split, policy, world["ep"].get_local_rank()) == 6
            for ex in experts:
                assert ex._raggedfsdp_state.group.quant_gather.plan(torch.float32).quantized == [True] * 3
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for s in range(MOE_STEPS):
            ce, aux = _loss(model, _data(s)[rank])
            (ce + aux).backward()
            if s == 0:
                grads0[dtype, wire] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            t = ce.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / ws)
        want = _oracle(_build, split, policy, [_data(s) for s in range(MOE_STEPS)], _moe_loss)
        if rank == 0:
            print(dtype, wire, "ours", losses, "oracle", want)
        # the bf16 wire rounds each rank's fp32 gradient once (rel 2^-9): close to the oracle, not equal
        torch.testing.assert_close(losses, want, rtol=1e-4 if wire is None else 1e-3, atol=0)
        res[dtype, wire] = losses
    for dtype in ("fp8_e4m3", "int8"):
        assert max(abs(a - b) for a, b in zip(res["none", None][1:], res[dtype, None][1:])) > 1e-5, dtype
    # the bf16-wire gradients: the fp32 reduce-scatter's to bf16 precision (a lost gradient divide
    # factor of the expert units, 4, or a misplaced piece is far outside), and not bit-equal (it was used)
    exact, wired = grads0["fp8_e4m3", None], grads0["fp8_e4m3", torch.bfloat16]
    diff = 0.0
    for n, g in exact.items():
        err = ((wired[n] - g).norm() / g.norm()).item()
        assert err < 1e-2, (n, err)
        diff = max(diff, err)
    assert diff > 0, diff


def test_quantized_all_gather_with_ep_dp2_ep2():
    run_distributed(_ep_case, 4)


# ---- torch.compile per block -----------------------------------------------------------------------------


def _compile_case(rank, ws):
    """``torch.compile(block, fullgraph=True)`` before ``fully_shard`` (and whole-model compile after it):
    the quantized gather and dequantize run in the eager hooks, never in a graph."""
    import warnings

    from test_quant_all_gather import Net, _data, _oracle, _shard, _train, _train_opt
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import QuantizedAllGatherPolicy

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (ws,))
    data = _data()
    policy = QuantizedAllGatherPolicy("fp8_e4m3")
    torch.manual_seed(0)
    eager = _train(_shard(Net(), mesh, policy), data, rank, ws)
    torch.testing.assert_close(eager, _oracle(policy, data), rtol=1e-4, atol=0)
    for mode in ("block", "whole"):
        torch._dynamo.reset()
        graphs = []

        def record(gm, example_inputs, graphs=graphs):
            graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return gm.forward

        backend = aot_autograd(fw_compiler=record, bw_compiler=record)  # aot_eager, forward and backward

        torch.manual_seed(0)
        model = Net()
        if mode == "block":
            for i, blk in enumerate(model.blocks):
                model.blocks[i] = torch.compile(blk, fullgraph=True, backend=backend)
        _shard(model, mesh, policy)
        run = torch.compile(model, backend=backend) if mode == "whole" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, n_graphs = [], []
        for batch in data:
            losses += _train_opt(run, opt, [batch], rank, ws)
            n_graphs.append(len(graphs))
        if rank == 0:
            print(mode, "compiled", losses, "eager", eager, "graphs after each step", n_graphs)
        torch.testing.assert_close(losses, eager, rtol=1e-6, atol=0)
        # one forward and one backward graph per block body, compiled at the first step, no recompile
        assert n_graphs[0] >= 4 and n_graphs[-1] == n_graphs[0], n_graphs
        for g in graphs:
            assert not any(k in t for t in g for k in ("all_gather", "quant", "resize")), g
        # the compiled run really gathered quantized values (one payload per unit and step)
        assert model.blocks[0]._raggedfsdp_state.group.quant_gather.quantizations == len(data)


def test_quantized_all_gather_with_compile_per_block_ws3():
    run_distributed(_compile_case, 3)


# ---- post-forward resharding to a smaller group -----------------------------------------------------------


def _int_reshard_case(rank, ws):
    """``reshard_after_forward=2`` at ws 4: after forward each rank keeps a 1/2 slice of the DEQUANTIZED
    unsharded parameters and backward re-gathers it within pairs (unquantized): the same values as the
    quantized gather, so the losses equal the ``reshard_after_forward=True`` run's bit for bit."""
    import warnings

    from test_quant_all_gather import Net, _data, _oracle, _train
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import QuantizedAllGatherPolicy, fully_shard

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (ws,))
    data = _data()
    policy = QuantizedAllGatherPolicy("fp8_e4m3")
    from raggedfsdp.buffer.wire import count_wire_bytes

    res, wire = {}, {}
    for raf in (True, 2):
        torch.manual_seed(0)
        model = Net()
        for b in model.blocks:
            fully_shard(b, mesh=mesh, all_gather_policy=policy, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, all_gather_policy=policy)
        with count_wire_bytes() as wire[raf]:
            res[raf] = _train(model, data, rank, ws)
        assert model.blocks[0]._raggedfsdp_state.group.quant_gather.quantizations == len(data)
    if rank == 0:
        print("reshard_after_forward True", res[True], "2", res[2])
    assert res[2] == res[True], res
    # the backward re-gathers of the blocks really came from the kept fp32 slices: other bytes, as many calls
    ag_true, ag_2 = wire[True], wire[2]
    assert ag_2.calls["all_gather"] == ag_true.calls["all_gather"], (ag_2.calls, ag_true.calls)
    assert ag_2.all_gather != ag_true.all_gather, (ag_2.all_gather, ag_true.all_gather)
    torch.testing.assert_close(res[2], _oracle(policy, data), rtol=1e-4, atol=0)


def test_quantized_all_gather_with_int_reshard_after_forward_ws4():
    run_distributed(_int_reshard_case, 4)
