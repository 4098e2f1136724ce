"""Single-device reference implementations (plain tensors): the oracles the distributed optimizers match.

* :func:`muon_reference_step` -- the Muon update of torch 2.13's ``torch.optim.Muon``
  (``torch/optim/_muon.py``: EMA momentum ``buf.lerp_(g, 1 - mu)``, Nesterov ``g.lerp(buf, mu)``,
  Newton-Schulz of :mod:`raggedfsdp.optim._newton_schulz`, decoupled weight decay
  ``p *= 1 - lr * wd`` and the "original" / "match_rms_adamw" learning-rate adjustment), extended to
  3-D expert stacks ``(E, d, h)`` by orthogonalising each ``(d, h)`` expert matrix separately.
* :func:`adamw8bit_reference_step` -- block-wise 8-bit AdamW: both moments stored as 8-bit codes
  of a non-linear (dynamic-exponent) code book with one fp32 absmax scale per ``R x C`` tile of the
  matrix (:mod:`raggedfsdp.optim._quant`); tensors that are not eligible (decided from the *global*
  shape by ``tile_eligible``) keep fp32 moments.
* :func:`shampoo_reference_step` -- block-diagonal Shampoo with AdamW grafting
  (:mod:`raggedfsdp.optim._shampoo_math`: ``R_b x B`` blocks, ``L^-1/4 m R^-1/4`` rescaled to the
  AdamW step's norm per block, roots by fp32 ``eigh`` every ``precondition_frequency`` steps).

Each oracle steps a whole tensor on one device. The distributed optimizers run the very same
kernels (``_newton_schulz``, ``_quant``) on their shards, which is why the tests can demand
bit-identical results across world sizes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from raggedfsdp.optim._newton_schulz import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    adjust_lr,
    matrices_of,
    newton_schulz,
)
from raggedfsdp.optim._quant import adamw_math, as_matrix, dequantize_tiles, quantize_tiles, tile_eligible
from raggedfsdp.optim._shampoo_math import (
    SHAMPOO_DEFAULTS,
    band_geometry,
    shampoo_state_shapes,
    shampoo_update,
)


@torch.no_grad()
def muon_reference_step(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """One Muon step on a full (unsharded) 2-D or 3-D ``param``, in place (``param``, ``momentum_buffer``)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    param.mul_(1 - lr * weight_decay)
    flat_p, flat_u = param.view(-1), update.reshape(-1)
    for s, n, r, c in matrices_of(tuple(param.shape)):
        ortho = newton_schulz(flat_u[s : s + n].view(r, c), ns_coefficients, ns_steps, eps, ns_dtype)
        flat_p[s : s + n].add_(ortho.reshape(-1), alpha=-adjust_lr(lr, adjust_lr_fn, r, c))


@torch.no_grad()
def adamw8bit_reference_step(
    param: Tensor,
    grad: Tensor,
    state: dict,
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    block: tuple[int, int] = (32, 32),
) -> None:
    """One 8-bit AdamW step on a full ``param``; ``state`` (a dict, empty at first) is updated in place.

    State keys: ``step`` (int); eligible tensors: ``exp_avg_codes``/``exp_avg_sq_codes`` (uint8,
    ``(numel/shape[-1], shape[-1])``) and ``exp_avg_scale``/``exp_avg_sq_scale`` (fp32 per tile);
    others: fp32 ``exp_avg``/``exp_avg_sq``.
    """
    shape = tuple(param.shape)
    q = tile_eligible(shape, block)
    if not state:
        state["step"] = 0
        if q:
            x = as_matrix(torch.zeros_like(param, dtype=torch.float32), shape)
            state["exp_avg_codes"], state["exp_avg_scale"] = quantize_tiles(x, block, True)
            state["exp_avg_sq_codes"], state["exp_avg_sq_scale"] = quantize_tiles(x, block, False)
        else:
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
    state["step"] += 1
    if q:
        m = dequantize_tiles(state["exp_avg_codes"], state["exp_avg_scale"], block, True)
        v = dequantize_tiles(state["exp_avg_sq_codes"], state["exp_avg_sq_scale"], block, False)
        adamw_math(
            as_matrix(param, shape),
            as_matrix(grad, shape),
            m,
            v,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=weight_decay,
            step=state["step"],
        )
        state["exp_avg_codes"], state["exp_avg_scale"] = quantize_tiles(m, block, True)
        state["exp_avg_sq_codes"], state["exp_avg_sq_scale"] = quantize_tiles(v, block, False)
    else:
        adamw_math(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=weight_decay,
            step=state["step"],
        )


@torch.no_grad()
def shampoo_reference_step(param: Tensor, grad: Tensor, state: dict, **hp) -> None:
    """One block-diagonal Shampoo step with AdamW grafting on a full ``param`` (``_shampoo_math``).

    ``state`` (a dict, empty at first) is updated in place: ``step`` (int), fp32 ``exp_avg`` /
    ``exp_avg_sq`` (``param``'s shape) and, for 2-D/3-D parameters, the statistics ``L``, ``R``,
    ``L_root``, ``R_root`` (:func:`shampoo_state_shapes`). Other parameters get plain AdamW
    (``_quant.adamw_math``). ``hp``: any of :data:`SHAMPOO_DEFAULTS`.
    """
    bad = set(hp) - set(SHAMPOO_DEFAULTS)
    if bad:
        raise TypeError(f"shampoo_reference_step: unknown hyperparameters {sorted(bad)}")
    h = {**SHAMPOO_DEFAULTS, **hp}
    shape = tuple(param.shape)
    shapes = shampoo_state_shapes(shape, h["block_size"])
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        for k, s in (shapes or {}).items():
            state[k] = torch.zeros(s, dtype=torch.float32, device=param.device)
    state["step"] += 1
    b1, b2 = h["betas"]
    if shapes is None:
        adamw_math(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            lr=h["lr"],
            beta1=b1,
            beta2=b2,
            eps=h["eps"],
            weight_decay=h["weight_decay"],
            step=state["step"],
        )
        return
    r_b = band_geometry(shape, h["block_size"])[0]
    shampoo_update(
        as_matrix(param, shape),
        as_matrix(grad, shape),
        as_matrix(state["exp_avg"], shape),
        as_matrix(state["exp_avg_sq"], shape),
        state,
        block=h["block_size"],
        r_b=r_b,
        lr=h["lr"],
        beta1=b1,
        beta2=b2,
        eps=h["eps"],
        weight_decay=h["weight_decay"],
        step=state["step"],
        shampoo_beta=h["shampoo_beta"],
        precondition_frequency=h["precondition_frequency"],
        matrix_eps=h["matrix_eps"],
    )
