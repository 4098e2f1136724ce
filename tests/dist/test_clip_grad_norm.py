"""Gradient-norm clipping on RaggedShard grads equals single-process clipping (issue 25 item 1, 19 item 3).

* torch's own ``clip_grad_norm_`` / ``get_total_norm`` (foreach and per-tensor paths), norm types
  1, 2, 3, inf, -inf, at world sizes 2, 3, 5 and HSDP 2x2: the returned total equals the
  single-process total ON EVERY RANK (``.to_local()``), and the clipped grads equal the
  single-process grads times the same coefficient. The model is issue 25's: linears 6 -> 7 -> 10
  -> 13, a router and a (3, 13, 4) expert stack, plus explicit layouts with empty local pieces and
  a list mixing RaggedShard grads with plain tensors.
* ``raggedfsdp.clip_grad_norm_`` over grads on DIFFERENT meshes of a 2x2 mesh (RaggedShard FSDP
  params on mesh["dp"], Shard(0) DTensors on mesh["tp"], 2-D (RaggedShard, Shard(1)) DTensors on
  the whole mesh, plain tensors), where torch's own clip raises.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from torch import nn

INF = float("inf")
NORMS = (1.0, 2.0, 3.0, INF, -INF)


class MoE(nn.Module):
    """issue 25's model: linears 6 -> 7 -> 10 -> 13, a router over 3 experts, a (3, 13, 4) expert stack."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 7), nn.Linear(7, 10), nn.Linear(10, 13)
        self.router = nn.Linear(13, 3)
        self.experts = nn.Parameter(torch.randn(3, 13, 4))

    def forward(self, x):
        h = self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))
        w = torch.softmax(self.router(h), -1)
        return torch.einsum("be,bd,edo->bo", w, h, self.experts).square().mean()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_grads_close(params, ref, where, gather):
    """Every clipped grad equals the single-process one (rtol 1e-5, atol 1e-7): gathered with
    ``full_tensor()`` (one collective per grad) when ``gather``; otherwise each rank compares its own
    piece with the same piece of the reference grad (``distribute_tensor(..., src_data_rank=None)``
    slices locally, no collective), element for element the same check over all ranks."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, r in zip(params, ref):
        g = p.grad
        if gather or not isinstance(g, DTensor):
            torch.testing.assert_close(_full(g), r.grad, rtol=1e-5, atol=1e-7, msg=where)
            continue
        want = distribute_tensor(r.grad, g.device_mesh, g.placements, src_data_rank=None).to_local()
        torch.testing.assert_close(g.to_local(), want, rtol=1e-5, atol=1e-7, msg=where)


def _check_torch_clip(params, ref, label):
    """torch's clip on ``params`` (sharded) vs on ``ref`` (single-process), every norm type and path."""
    from torch.distributed.tensor import DTensor

    import raggedfsdp

    grads0 = [p.grad.detach().clone() for p in params]
    rgrads0 = [r.grad.detach().clone() for r in ref]
    for nt in NORMS:
        rtotal = torch.nn.utils.get_total_norm(rgrads0, nt)
        max_norm = 0.5 * float(rtotal)
        for foreach in (None, True, False):
            for fn in ("torch", "ours") if foreach is None else ("torch",):
                for p, g in zip(params, grads0):
                    p.grad = g.clone()
                for r, g in zip(ref, rgrads0):
                    r.grad = g.clone()
                where = f"{label} norm_type={nt} foreach={foreach} {fn}"
                clip = torch.nn.utils.clip_grad_norm_ if fn == "torch" else raggedfsdp.clip_grad_norm_
                total = clip(params, max_norm, nt, foreach=foreach)
                rtot = torch.nn.utils.clip_grad_norm_(ref, max_norm, nt, foreach=foreach)
                if isinstance(total, DTensor):
                    assert all(p.is_replicate() for p in total.placements), (where, total.placements)
                    total = total.to_local()
                # the value THIS rank holds (what .item() / logging / a clip coefficient read)
                torch.testing.assert_close(total, rtot, rtol=1e-5, atol=0, msg=where)
                # gathered once per norm type (the full_tensor path); the other paths per piece
                _assert_grads_close(params, ref, where, gather=foreach is None and fn == "torch")
                if fn == "torch":
                    tn = torch.nn.utils.get_total_norm([p.grad for p in params], nt, foreach=foreach)
                    torch.testing.assert_close(
                        tn.to_local(),
                        torch.nn.utils.get_total_norm([r.grad for r in ref], nt),
                        rtol=1e-5,
                        atol=0,
                        msg=where,
                    )
    for t, g in zip(params + ref, grads0 + rgrads0):
        t.grad = g


def _model_case(mesh, rank):
    from raggedfsdp import fully_shard

    torch.manual_seed(0)
    model = MoE()
    ref = copy.deepcopy(model)
    for lin in (model.l1, model.l2, model.l3):
        fully_shard(lin, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    model(x).backward()  # the same batch on every rank: the averaged grads are the single-process grads
    ref(x).backward()
    _check_torch_clip(list(model.parameters()), list(ref.parameters()), f"MoE rank {rank}")


def _explicit_case(mesh, rank, ws):
    """Hand-made RaggedShard layouts with empty pieces; the max-abs on the last non-empty piece."""
    from torch.distributed.tensor import distribute_tensor

    from raggedfsdp import RaggedShard

    g = torch.Generator().manual_seed(5)
    units = tuple([2, 0] * ws)[:ws]
    specs = [
        ((2 * sum(units), 3), RaggedShard((0,), units)),
        ((7,), RaggedShard((0,), (1,) + (0,) * (ws - 1))),
        ((ws, 2, 2), RaggedShard((0, 1, 2), tuple(range(ws)))),
        ((3, 13, 4), RaggedShard((0, 1), (0,) * (ws - 1) + (3,))),
    ]
    params, ref = [], []
    for shape, pl in specs:
        full, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        p = nn.Parameter(distribute_tensor(full, mesh, [pl]))
        p.grad = distribute_tensor(grad, mesh, [pl])
        params.append(p)
        r = nn.Parameter(full.clone())
        r.grad = grad.clone()
        ref.append(r)
    _check_torch_clip(params, ref, f"explicit rank {rank}")
    # a list mixing RaggedShard grads with a plain tensor (the same on every rank): torch's norm
    plain = torch.randn(5, generator=g)
    for nt in NORMS:
        want = torch.nn.utils.get_total_norm([r.grad for r in ref] + [plain], nt)
        for foreach in (None, True, False):
            got = torch.nn.utils.get_total_norm([p.grad for p in params] + [plain], nt, foreach=foreach)
            torch.testing.assert_close(
                got.to_local(), want, rtol=1e-5, atol=0, msg=f"mixed {nt} {foreach} {got} {want}"
            )


def _cases(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    _model_case(mesh, rank)
    _explicit_case(mesh, rank, ws)


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_torch_clip_grad_norm_on_ragged_grads(ws):
    SPAWNS.check(ws, "clip_grad_norm")


def _mixed_mesh_case(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import raggedfsdp
    from raggedfsdp import RaggedShard, fully_shard

    # HSDP 2x2: (Replicate, RaggedShard) grads, replicated grads counted once
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _model_case(hsdp, rank)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(0)
    fsdp_part = MoE()  # FSDP-only params on mesh["dp"], repeated on each tp rank
    ref_part = copy.deepcopy(fsdp_part)
    fully_shard(fsdp_part.l2, mesh=mesh["dp"])
    fully_shard(fsdp_part, mesh=mesh["dp"])
    params, ref = [], []
    for p, r in zip(fsdp_part.parameters(), ref_part.parameters()):
        grad = torch.randn(r.shape, generator=g)
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        r.grad = grad.clone()
        params.append(p)
        ref.append(r)
    for shape, sub, pls in (
        ((6, 5), "tp", [Shard(0)]),
        ((8, 4), None, [RaggedShard((0,), (3, 1)), Shard(1)]),
        ((3, 2), "dp", [Shard(1)]),
    ):
        full, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        m = mesh if sub is None else mesh[sub]
        p = nn.Parameter(distribute_tensor(full, m, pls))
        p.grad = distribute_tensor(grad, m, pls)
        params.append(p)
        r = nn.Parameter(full.clone())
        r.grad = grad.clone()
        ref.append(r)
    plain = nn.Parameter(torch.randn(4, generator=g))
    plain.grad = torch.randn(4, generator=g)
    params.append(plain)
    rp = nn.Parameter(plain.detach().clone())
    rp.grad = plain.grad.clone()
    ref.append(rp)

    with pytest.raises(Exception, match="must have the same mesh"):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    grads0 = [p.grad.clone() for p in params]
    for nt in NORMS:
        rtotal = float(torch.nn.utils.get_total_norm([r.grad for r in ref], nt))
        for foreach in (None, False):
            for p, g0 in zip(params, grads0):
                p.grad = g0.clone()
            rgrads = [r.grad.clone() for r in ref]
            total = raggedfsdp.clip_grad_norm_(params, 0.5 * rtotal, nt, foreach=foreach)
            rtot = torch.nn.utils.clip_grad_norm_(ref, 0.5 * rtotal, nt)
            assert type(total) is torch.Tensor
            where = f"mixed mesh {nt} {foreach}"
            torch.testing.assert_close(total, rtot, rtol=1e-5, atol=0, msg=where)
            _assert_grads_close(params, ref, where, gather=foreach is None)
            for r, rg in zip(ref, rgrads):
                r.grad = rg
    with pytest.raises(ValueError, match="norm_type"):
        raggedfsdp.clip_grad_norm_(params, 1.0, norm_type=0)
    with pytest.raises(ValueError, match="max_norm"):
        raggedfsdp.clip_grad_norm_(params, -1.0)


def test_hsdp_and_mixed_mesh_clip_grad_norm():
    SPAWNS.check(4, "clip_grad_norm_mixed_mesh")
