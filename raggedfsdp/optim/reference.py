"""Single-device reference implementations (plain tensors): the oracles the distributed optimizers match.

* :func:`newton_schulz` / :func:`muon_reference_step` -- the Muon update of torch 2.13's
  ``torch.optim.Muon`` (``torch/optim/_muon.py``: EMA momentum ``buf.lerp_(g, 1 - mu)``, Nesterov
  ``g.lerp(buf, mu)``, 5-step quintic Newton-Schulz in bfloat16 with coefficients
  ``(3.4445, -4.7750, 2.0315)``, decoupled weight decay ``p *= 1 - lr * wd`` and the "original" /
  "match_rms_adamw" learning-rate adjustment), extended to 3-D expert stacks ``(E, d, h)`` by
  orthogonalising each ``(d, h)`` expert matrix separately.
* :func:`adamw8bit_reference_step` -- block-wise 8-bit AdamW: both moments stored as 8-bit codes
  of a non-linear (dynamic-exponent) code book with one fp32 absmax scale per ``R x C`` tile of the
  matrix; tensors that are not eligible (decided from the *global* shape by :func:`tile_eligible`)
  keep fp32 moments.

Everything here is local, deterministic and communication-free; ``raggedfsdp.optim.Muon`` and
``raggedfsdp.optim.AdamW8bit`` run the very same element-wise and per-tile arithmetic on their
shards, which is why the tests can demand bit-identical results across world sizes.
Sources: Keller Jordan's Muon post; Dettmers et al., "8-bit Optimizers via Block-wise
Quantization" (arXiv 2110.02861) for the idea of a dynamic code book with block-wise absmax
scaling (our code book and tiles are our own construction).
"""

from __future__ import annotations

import math
from functools import cache

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim._muon DEFAULT_A/B/C
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


# ---------------------------------------------------------------------------------------------
# Muon
# ---------------------------------------------------------------------------------------------
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
        f"Muon handles 2-D matrices and 3-D expert stacks (E, d, h), got a parameter of shape {tuple(shape)}; "
        "put it in an AdamW group (raggedfsdp.optim.muon_param_groups does this)"
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
        ortho = newton_schulz(flat_u[s:s + n].view(r, c), ns_coefficients, ns_steps, eps, ns_dtype)
        flat_p[s:s + n].add_(ortho.reshape(-1), alpha=-adjust_lr(lr, adjust_lr_fn, r, c))


# ---------------------------------------------------------------------------------------------
# 8-bit block-wise quantisation
# ---------------------------------------------------------------------------------------------
@cache
def _code_book(signed: bool) -> tuple[Tensor, Tensor]:
    """Sorted 256-entry fp32 code book in ``[-1, 1]`` (signed) or ``[0, 1]``, and its 255 midpoints.

    Dynamic-exponent construction: for exponent ``e = 0, 1, ...`` the values ``10^-e * f`` with
    ``f`` linearly spaced in ``(0.1, 1)`` on ``2^(bits-1-e)`` points, so resolution is relative
    (like floating point) down to ~1e-7 of the block's absmax; plus exact ``0`` and ``1``.
    """
    bits = 7 if signed else 8
    vals: list[float] = []
    for e in range(bits - 1):
        n = 2 ** (bits - 1 - e)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        vals.extend((((edges[:-1] + edges[1:]) / 2) * 10.0 ** (-e)).tolist())
    mags = sorted(set(vals))
    book = [0.0, 1.0] + mags + ([-v for v in mags] + [-1.0] if signed else [])
    if signed:
        book.append(float(2.0 ** -20))  # fill the 256th code with a tiny positive value
    book = sorted(set(book))
    assert len(book) == 256, len(book)
    t = torch.tensor(book, dtype=torch.float32)
    return t, (t[:-1] + t[1:]) / 2


@cache
def _encode_table(signed: bool) -> tuple[Tensor, Tensor]:
    """Lookup table for :func:`encode`: the code of the smallest value of each 2^15-ulp fp32 bucket.

    A bucket (sign, exponent and the top 8 mantissa bits of an fp32) spans 0.4 % relative, finer than
    the code book's spacing, so it holds at most one midpoint (checked here) and one comparison
    finishes the rounding. Returns ``(code (2^17,) uint8, the midpoint above it (2^17,) fp32)``.
    """
    _, mids = _code_book(signed)
    keys = torch.arange(1 << 17, dtype=torch.int64)
    sign = (keys >> 16).bool()
    lo_bits = (keys << 15) | torch.where(sign, 0x7FFF, 0)
    hi_bits = (keys << 15) | torch.where(sign, 0, 0x7FFF)
    lo = lo_bits.to(torch.int32).view(torch.float32)
    hi = hi_bits.to(torch.int32).view(torch.float32)
    lut = torch.bucketize(lo, mids)
    finite = lo.abs() <= 1.0
    span = torch.bucketize(hi, mids) - lut
    assert int(span[finite & hi.abs().le(1.0)].max()) <= 1, "code book finer than the lookup buckets"
    mid_of_key = torch.cat([mids, torch.tensor([float("inf")])])[lut]
    return lut.clamp(max=255).to(torch.uint8), mid_of_key


@cache
def _tables_on(signed: bool, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(book, lut, mid)`` on ``device``, cached: no host-to-device copy per step."""
    lut, mid = _encode_table(signed)
    return _code_book(signed)[0].to(device), lut.to(device), mid.to(device)


def encode(xn: Tensor, signed: bool) -> Tensor:
    """uint8 code of the nearest code-book value for fp32 ``xn`` in ``[-1, 1]`` (``[0, 1]`` unsigned).

    Same result as ``torch.bucketize(xn, midpoints)`` (ties round down), about 10x faster on CPU:
    a table lookup on the top 17 bits of each fp32 plus one comparison. Element-wise.
    """
    _, lut, mid = _tables_on(signed, xn.device)
    x = xn.float().contiguous().view(-1)
    key = (x.view(torch.int32) >> 15) & 0x1FFFF  # sign, exponent, top 8 mantissa bits
    return (lut.index_select(0, key) + (x > mid.index_select(0, key))).view(xn.shape)


def zero_code(signed: bool) -> int:
    """The code of 0.0 (the initial state)."""
    return int((_code_book(signed)[0] == 0).nonzero().item())


def _scales_full(scales: Tensor, r: int, c: int, ncols: int) -> Tensor:
    return scales.repeat_interleave(r, 0).repeat_interleave(c, 1)[:, :ncols]


def tile_absmax(x: Tensor, block: tuple[int, int]) -> Tensor:
    """Per-tile ``max |x|`` of a 2-D ``x`` ``(n, m)`` with ``block=(R, C)``, ``R | n``: ``(n/R, ceil(m/C))`` fp32.

    Edge tiles of a width not divisible by ``C`` are narrower. Exact (max is order-independent).
    """
    r, c = block
    n, m = x.shape
    nb = -(-m // c)
    a = x.abs().float()
    if nb * c != m:
        a = torch.nn.functional.pad(a, (0, nb * c - m))
    return a.view(n // r, r, nb, c).amax(dim=(1, 3))


def quantize_tiles(x: Tensor, block: tuple[int, int], signed: bool) -> tuple[Tensor, Tensor]:
    """8-bit codes (uint8, ``x``'s shape) and fp32 absmax scales (``(n/R, ceil(m/C))``) of a 2-D ``x``.

    Each element is divided by its tile's absmax (0 -> 1) and rounded to the nearest code-book value.
    Purely per tile: the result for a tile depends on that tile only.
    """
    scales = tile_absmax(x, block)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    xn = x.float() / _scales_full(safe, block[0], block[1], x.shape[1])
    codes = encode(xn, signed)
    return codes, scales


def dequantize_tiles(codes: Tensor, scales: Tensor, block: tuple[int, int], signed: bool) -> Tensor:
    """fp32 values of ``codes`` (2-D uint8) with per-tile ``scales``: ``book[code] * scale``."""
    book = _tables_on(signed, codes.device)[0]
    vals = book.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)
    return vals * _scales_full(scales, block[0], block[1], codes.shape[1])


MIN_8BIT_NUMEL = 4096


def tile_eligible(shape: tuple[int, ...], block: tuple[int, int] = (32, 32)) -> bool:
    """Whether a parameter of *global* ``shape`` gets 8-bit tile state (else fp32 moments).

    True iff ``ndim >= 2``, ``numel >= 4096`` and the tile height ``R`` divides ``shape[-2]`` (so
    tiles never straddle two matrices of a stack). Never depends on the local piece or world size.
    """
    return len(shape) >= 2 and math.prod(shape) >= MIN_8BIT_NUMEL and shape[-2] % block[0] == 0


def adamw_math(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, step: int) -> None:
    """The element-wise AdamW update shared by the reference and the sharded optimizer (in place).

    ``p`` (param dtype), ``g`` gradient, ``m``/``v`` fp32 moments (dequantised); all one shape.
    Only correctly rounded single ops (no fused multiply-adds), so any slicing gives the same bits.
    """
    gf = g.float()
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(gf * (1 - beta1))
    v.mul_(beta2).add_(gf * gf * (1 - beta2))
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p.sub_((m / denom * (lr / (1 - beta1 ** step))).to(p.dtype))


def as_matrix(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """View a flat piece (or a full tensor) of a tensor of global ``shape`` as rows of ``shape[-1]``."""
    return t.reshape(-1, shape[-1])


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
        adamw_math(as_matrix(param, shape), as_matrix(grad, shape), m, v, lr=lr, beta1=betas[0],
                   beta2=betas[1], eps=eps, weight_decay=weight_decay, step=state["step"])
        state["exp_avg_codes"], state["exp_avg_scale"] = quantize_tiles(m, block, True)
        state["exp_avg_sq_codes"], state["exp_avg_sq_scale"] = quantize_tiles(v, block, False)
    else:
        adamw_math(param, grad, state["exp_avg"], state["exp_avg_sq"], lr=lr, beta1=betas[0],
                   beta2=betas[1], eps=eps, weight_decay=weight_decay, step=state["step"])
