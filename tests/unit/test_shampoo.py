"""Single-process checks of raggedfsdp.optim.Shampoo: the fp32 reference against a float64 direct
implementation of block-diagonal Shampoo with AdamW grafting, the optimizer on plain tensors against
the reference (bitwise), AdamW for vectors, the placement fn and bad input."""

import math

import pytest
import torch

import raggedfsdp  # noqa: F401
from raggedfsdp.optim import Shampoo, shampoo_placement_fn
from raggedfsdp.optim.reference import shampoo_reference_step

HP = {
    "lr": 0.01,
    "betas": (0.9, 0.99),
    "eps": 1e-8,
    "weight_decay": 0.05,
    "block_size": 8,
    "precondition_frequency": 2,
    "matrix_eps": 1e-3,
}  # eps well above fp32 eigh noise: rank-deficient
# early statistics (a 6x2 edge block after 2 steps) make (0 + eps)^-1/4 amplify the fp32 rounding


def _root64(a, eps):
    lam, q = torch.linalg.eigh(a + eps * torch.eye(a.shape[0], dtype=torch.float64))
    return q @ torch.diag(lam.clamp_min(eps) ** -0.25) @ q.T


def _direct64(w, grads, band_rows, hp):
    """Float64 Shampoo written from the maths: explicit block list, per-block L, R, roots, grafting."""
    b1, b2 = hp["betas"]
    lr, wd, k, eps, meps, bs = (
        hp["lr"],
        hp["weight_decay"],
        hp["precondition_frequency"],
        hp["eps"],
        hp["matrix_eps"],
        hp["block_size"],
    )
    x = w.double().reshape(-1, w.shape[-1]).clone()
    n, c = x.shape
    blocks = [
        (r, r + band_rows, c0, min(c, c0 + bs)) for r in range(0, n, band_rows) for c0 in range(0, c, bs)
    ]
    L = {bl: torch.zeros(bl[1] - bl[0], bl[1] - bl[0], dtype=torch.float64) for bl in blocks}
    R = {bl: torch.zeros(bl[3] - bl[2], bl[3] - bl[2], dtype=torch.float64) for bl in blocks}
    Lr, Rr = {}, {}
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    for t, g in enumerate(grads, start=1):
        g = g.double().reshape(n, c)
        x *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1**t), v / (1 - b2**t)
        adam = mh / (vh.sqrt() + eps)
        upd = adam.clone()
        for bl in blocks:
            r0, r1, c0, c1 = bl
            gb = g[r0:r1, c0:c1]
            L[bl] += gb @ gb.T
            R[bl] += gb.T @ gb
            if t % k == 0:
                Lr[bl], Rr[bl] = _root64(L[bl], meps), _root64(R[bl], meps)
            if t >= k:
                s = Lr[bl] @ mh[r0:r1, c0:c1] @ Rr[bl]
                upd[r0:r1, c0:c1] = s * (adam[r0:r1, c0:c1].norm() / s.norm())
        x -= lr * upd
    return x.reshape(w.shape)


@pytest.mark.parametrize("shape,band_rows", [((12, 20), 6), ((2, 6, 10), 6), ((2, 12, 10), 6), ((5, 8), 5)])
def test_reference_matches_float64_shampoo_maths(shape, band_rows):
    torch.manual_seed(0)
    w = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(5)]  # roots at steps 2 and 4; Shampoo from step 2
    p, st = w.clone(), {}
    for g in grads:
        shampoo_reference_step(p, g, st, **HP)
    want = _direct64(w, grads, band_rows, HP)
    assert st["L"].shape[2] == band_rows
    torch.testing.assert_close(p.double(), want, rtol=0, atol=2e-5)
    # the preconditioner matters: plain AdamW (the grafting direction alone) lands elsewhere
    q, sq = w.clone(), {}
    for g in grads:
        shampoo_reference_step(q, g, sq, **{**HP, "precondition_frequency": 100})
    assert (q - p).abs().max() > 1e-3


def test_optimizer_on_plain_tensors_equals_reference_and_vectors_get_adamw():
    torch.manual_seed(1)
    shapes = [(16, 24), (3, 8, 12), (7,)]
    ws = [torch.randn(s) for s in shapes]
    ps = [torch.nn.Parameter(w.clone()) for w in ws]
    refs, states = [w.clone() for w in ws], [{} for _ in ws]
    opt = Shampoo(ps, **HP)
    tadam_p = torch.nn.Parameter(ws[2].clone())
    tadam = torch.optim.AdamW([tadam_p], lr=HP["lr"], betas=HP["betas"], weight_decay=HP["weight_decay"])
    for _ in range(4):
        gs = [torch.randn(s) for s in shapes]
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        tadam_p.grad = gs[2].clone()
        opt.step(), tadam.step()
        for r, g, st in zip(refs, gs, states):
            shampoo_reference_step(r, g, st, **HP)
    for p, r in zip(ps, refs):
        assert torch.equal(p.detach(), r)
    assert "L" not in opt.state[ps[2]] and opt.state[ps[1]]["L"].shape == (
        3,
        2,
        8,
        8,
    )  # 3 bands (experts) x 2 blocks
    torch.testing.assert_close(ps[2].detach(), tadam_p.detach(), rtol=0, atol=1e-6)
    assert opt.state_bytes() == sum(4 * (2 * math.prod(s)) for s in shapes) + 4 * 2 * (
        2 * 3 * 8 * 8 * 2 + 3 * 2 * 8 * 8 * 2
    )


def test_placement_fn_and_bad_input():
    fn = shampoo_placement_fn(128)
    assert fn(torch.empty(256, 512)) == "tile:128x128" and fn(torch.empty(96, 40)) == "tile:96x128"
    assert fn(torch.empty(4, 300, 64)) == "tile:100x128" and fn(torch.empty(64)) is None
    assert Shampoo.shard_placement_fn(torch.empty(130, 8)) == "tile:65x128"
    for kw, word in (
        ({"block_size": 0}, "block_size"),
        ({"precondition_frequency": 1.5}, "precondition_frequency"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"matrix_eps": 0.0}, "matrix_eps"),
    ):
        with pytest.raises(ValueError, match=word):
            Shampoo([torch.nn.Parameter(torch.randn(4, 4))], **kw)
