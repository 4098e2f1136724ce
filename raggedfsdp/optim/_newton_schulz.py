"""Newton-Schulz orthogonalisation and Muon's per-matrix helpers: the kernels shared by
:class:`raggedfsdp.optim.Muon` and its single-device oracle
:func:`raggedfsdp.optim.reference.muon_reference_step`.

* :func:`newton_schulz` -- torch 2.13's ``torch.optim._muon._zeropower_via_newtonschulz`` arithmetic
  (5-step quintic, coefficients ``(3.4445, -4.7750, 2.0315)``, bfloat16), optionally compiled;
* :func:`ns_cost` / :func:`ns_flops` -- its balancing weight and FLOP count;
* :func:`adjust_lr` -- torch.optim.Muon's learning-rate scaling per matrix shape;
* :func:`matrices_of` -- the Muon matrices of a 2-D parameter or a 3-D expert stack.

Everything here is local, deterministic and communication-free. Source: Keller Jordan's Muon post;
``torch/optim/_muon.py`` (torch 2.13).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim._muon DEFAULT_A/B/C
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(
    g: Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximate orthogonalisation ``U V^T`` of a 2-D ``g`` (``U S V^T = g``) by a quintic Newton-Schulz.

    Same arithmetic as ``torch.optim._muon._zeropower_via_newtonschulz`` (torch 2.13): cast to
    ``dtype`` (bfloat16), transpose tall matrices, divide by the Frobenius norm (clamped at ``eps``),
    then ``steps`` iterations ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``.
    Returns a ``dtype`` tensor of ``g``'s shape. Cost: ``steps * (2 r^2 c + 2 r^3 + 2 r^2 c)`` FLOPs
    with ``r = min(shape)``, ``c = max(shape)`` (see :func:`ns_flops`).
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz: expected a 2-D matrix, got shape {tuple(g.shape)}")
    if steps >= 100:
        raise ValueError(f"newton_schulz: steps={steps} must be < 100")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def ns_cost(rows: int, cols: int) -> int:
    """Balancing weight of one Newton-Schulz call on a ``(rows, cols)`` matrix: ``rows * cols * min``."""
    return rows * cols * min(rows, cols)


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per MAC) of :func:`newton_schulz` on a ``(rows, cols)`` matrix."""
    r, c = min(rows, cols), max(rows, cols)
    return steps * 2 * (r * r * c + r * r * r + r * r * c)


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate scaling for a ``(rows, cols)`` matrix.

    ``None`` / ``"original"``: ``lr * sqrt(max(1, rows / cols))``; ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(rows, cols))``.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")


def matrices_of(shape: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """The Muon matrices of a parameter: ``(flat_start, numel, rows, cols)`` each.

    2-D ``(r, c)``: one matrix. 3-D ``(E, d, h)`` (an expert stack): ``E`` matrices ``(d, h)``.
    Raises ``ValueError`` for other ranks.
    """
    if len(shape) == 2:
        return [(0, shape[0] * shape[1], shape[0], shape[1])]
    if len(shape) == 3:
        n = shape[1] * shape[2]
        return [(e * n, n, shape[1], shape[2]) for e in range(shape[0])]
    raise ValueError(
        "Muon handles 2-D matrices and 3-D expert stacks (E, d, h), got a parameter of shape "
        f"{tuple(shape)}; put it in an AdamW group (raggedfsdp.optim.muon_param_groups does this)"
    )


_COMPILED: list = []


def compiled_newton_schulz():
    """:func:`newton_schulz` through ``torch.compile`` (built once per process, lazily; recompiles per shape).

    Same mathematics; inductor may fuse the normalisation and the element-wise steps, so results can
    differ from eager in the last bits (``Muon(compile_ns=True)`` is therefore off by default and not
    covered by the bitwise parity tests).
    """
    if not _COMPILED:
        _COMPILED.append(torch.compile(newton_schulz, dynamic=False))
    return _COMPILED[0]
