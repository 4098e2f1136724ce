"""Block-diagonal Shampoo with AdamW grafting: the kernels shared by :class:`raggedfsdp.optim.Shampoo`
and its oracle :func:`raggedfsdp.optim.reference.shampoo_reference_step`.

A parameter of shape ``(..., rows, cols)`` is viewed as the matrix ``(numel / cols, cols)`` and cut
into **bands** of ``R_b = block_rows(shape[-2], B)`` rows (the largest divisor of ``shape[-2]`` that
is ``<= B``, so a band never straddles two matrices of a 3-D stack) and each band into column blocks
of ``B`` (the last one narrower). Each ``R_b x C`` block has its own left / right statistics
``L = sum G G^T`` (``R_b x R_b``) and ``R = sum G^T G`` (``C x C``) and their inverse fourth roots,
recomputed every ``precondition_frequency`` steps by ``eigh`` in fp32 with ``matrix_eps`` added to
the eigenvalues. The step (``t`` from 1):

1. ``p *= 1 - lr * wd``; AdamW moments ``m``, ``v`` (element-wise, as ``_quant.adamw_math``);
2. ``adam = m_hat / (sqrt(v_hat) + eps)`` (the grafting direction);
3. per block: accumulate ``L``, ``R``; every ``K`` steps (``t % K == 0``) refresh the roots; once
   roots exist (``t >= K``) the block's direction is ``S = L^-1/4 m_hat R^-1/4`` rescaled to
   ``adam``'s Frobenius norm on that block (grafting), before that it is ``adam``;
4. ``p -= lr * direction``.

Each block's result depends on that block only and all block arithmetic runs on contiguous copies
of fixed shape, so any layout that keeps bands whole on ranks gives the same bits. Sources: Gupta,
Koren, Singer, "Shampoo" (arXiv 1802.09568, section 3: L^-1/4 G R^-1/4); Anil et al., "Scalable
Second Order Optimization" (arXiv 2002.09018: blocking, grafting, infrequent roots); Shi et al.,
"A Distributed Data-Parallel PyTorch Implementation of Distributed Shampoo" (arXiv 2309.06497).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SHAMPOO_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "block_size": 128,
    "shampoo_beta": 1.0,
    "precondition_frequency": 10,
    "matrix_eps": 1e-6,
}


def shampoo_state_shapes(shape: tuple[int, ...], block: int) -> dict[str, tuple[int, ...]] | None:
    """Global shapes of the block statistics of a 2-D/3-D parameter (``None``: AdamW only)."""
    if len(shape) not in (2, 3):
        return None
    r_b, _, nbc, cmax = band_geometry(shape, block)
    nb = math.prod(shape[:-1]) // r_b
    return {
        "L": (nb, nbc, r_b, r_b),
        "R": (nb, nbc, cmax, cmax),
        "L_root": (nb, nbc, r_b, r_b),
        "R_root": (nb, nbc, cmax, cmax),
    }


def block_rows(rows: int, block: int) -> int:
    """Band height ``R_b``: the largest divisor of ``rows`` that is ``<= block``."""
    if rows <= block:
        return rows
    return max(d for d in range(1, block + 1) if rows % d == 0)


def band_geometry(shape: tuple[int, ...], block: int) -> tuple[int, int, int, int]:
    """``(R_b, cols, n_col_blocks, C_max)`` of a 2-D/3-D ``shape`` for block size ``block``."""
    cols = shape[-1]
    return block_rows(shape[-2], block), cols, -(-cols // block), min(block, cols)


def inv_fourth_root(a: Tensor, eps: float) -> Tensor:
    """``(A + eps I)^{-1/4}`` of a symmetric PSD fp32 ``A`` via ``torch.linalg.eigh`` (eigenvalues clamped at
    eps)."""
    n = a.shape[0]
    lam, q = torch.linalg.eigh(a + eps * torch.eye(n, dtype=a.dtype, device=a.device))
    lam = lam.clamp_min(eps).pow(-0.25)
    return (q * lam) @ q.T


def shampoo_update(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    stats: dict[str, Tensor],
    *,
    block: int,
    r_b: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    shampoo_beta: float,
    precondition_frequency: int,
    matrix_eps: float,
) -> None:
    """One step on whole bands, in place.

    ``p`` (param dtype), ``g``, ``m``, ``v`` (fp32): ``(n_bands * r_b, cols)``; ``stats``: ``L`` /
    ``L_root`` ``(n_bands, n_col_blocks, r_b, r_b)`` and ``R`` / ``R_root`` ``(n_bands,
    n_col_blocks, C_max, C_max)`` fp32 (an edge block of width ``w`` uses the top-left ``w x w``).
    """
    gf = g.float()
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(gf * (1 - beta1))
    v.mul_(beta2).add_(gf * gf * (1 - beta2))
    m_hat = m / (1 - beta1**step)
    direction = m_hat / (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    refresh = step % precondition_frequency == 0
    if direction.numel():
        L, R, Lr, Rr = stats["L"], stats["R"], stats["L_root"], stats["R_root"]
        cols = p.shape[1]
        for b in range(p.shape[0] // r_b):
            rs = slice(b * r_b, (b + 1) * r_b)
            for c in range(L.shape[1]):
                c0, c1 = c * block, min(cols, (c + 1) * block)
                w = c1 - c0
                gb = gf[rs, c0:c1].contiguous()
                lb, rb = L[b, c], R[b, c, :w, :w]
                for acc, outer in ((lb, gb @ gb.T), (rb, gb.T @ gb)):
                    if shampoo_beta == 1.0:
                        acc.add_(outer)
                    else:
                        acc.mul_(shampoo_beta).add_(outer * (1 - shampoo_beta))
                if refresh:
                    Lr[b, c].copy_(inv_fourth_root(lb.contiguous(), matrix_eps))
                    Rr[b, c, :w, :w].copy_(inv_fourth_root(rb.contiguous(), matrix_eps))
                if step >= precondition_frequency:
                    s = Lr[b, c].contiguous() @ m_hat[rs, c0:c1].contiguous() @ Rr[b, c, :w, :w].contiguous()
                    graft = direction[rs, c0:c1].contiguous().norm()
                    direction[rs, c0:c1] = s * (graft / s.norm().clamp_min(1e-30))
    p.sub_((direction * lr).to(p.dtype))
