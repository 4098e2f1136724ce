"""Block-wise 8-bit quantisation and the AdamW arithmetic: the kernels shared by
:class:`raggedfsdp.optim.AdamW8bit` and its oracle
:func:`raggedfsdp.optim.reference.adamw8bit_reference_step`.

* :func:`_code_book` / :func:`encode` / :func:`zero_code` -- a 256-entry dynamic-exponent code book
  (signed for the first moment, unsigned for the second) and nearest-code rounding;
* :func:`tile_absmax` / :func:`quantize_tiles` / :func:`dequantize_tiles` -- codes plus one fp32
  absmax scale per ``R x C`` tile of a 2-D matrix;
* :func:`tile_eligible` -- 8-bit or fp32 state, from the *global* shape only;
* :func:`adamw_math` -- the element-wise AdamW update, only correctly rounded single ops.

Everything here is local, deterministic and communication-free, and each result depends on its own
tile (or element) only, so any sharding that keeps tiles whole gives the same bits. Source: Dettmers
et al., "8-bit Optimizers via Block-wise Quantization" (arXiv 2110.02861) for the idea of a dynamic
code book with block-wise absmax scaling (our code book and tiles are our own construction).
"""

from __future__ import annotations

import math
from functools import cache

import torch
from torch import Tensor


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
        book.append(float(2.0**-20))  # fill the 256th code with a tiny positive value
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
    """Per-tile ``max |x|`` of a 2-D ``x`` ``(n, m)`` with ``block=(R, C)``, ``R | n``: ``(n/R, ceil(m/C))``
    fp32.

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


def adamw_math(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """The element-wise AdamW update shared by the reference and the sharded optimizer (in place).

    ``p`` (param dtype), ``g`` gradient, ``m``/``v`` fp32 moments (dequantised); all one shape.
    Only correctly rounded single ops (no fused multiply-adds), so any slicing gives the same bits.
    """
    gf = g.float()
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(gf * (1 - beta1))
    v.mul_(beta2).add_(gf * gf * (1 - beta2))
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.sub_((m / denom * (lr / (1 - beta1**step))).to(p.dtype))


def as_matrix(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """View a flat piece (or a full tensor) of a tensor of global ``shape`` as rows of ``shape[-1]``."""
    return t.reshape(-1, shape[-1])
