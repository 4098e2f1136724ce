"""Block-quantized format of the quantized all-gather: 8-bit codes plus one fp32 scale per block.

A 2-D matrix ``x`` of shape ``(n, w)`` (an N-D parameter is viewed row-major as ``(numel // w, w)``,
``w = shape[-1]``) is cut into ``R x C`` blocks (``block=(R, C)``: ``(32, 32)`` tiles by default,
``(1, K)`` for row blocks); ``R`` must divide ``n``; blocks of the last column group are narrower when
``C`` does not divide ``w`` (as the 8-bit optimizer's tiles, ``raggedfsdp/optim/_quant.py``). Per block:

* ``scale = absmax / QMAX`` in fp32 (one correctly rounded division; ``QMAX`` = 448 for ``fp8_e4m3``,
  127 for ``int8``);
* ``code = cast(clamp(x / s, -QMAX, QMAX))`` with ``s = scale`` (``1`` where ``scale == 0``): the fp32
  quotient (correctly rounded) rounded to the nearest ``float8_e4m3fn`` value (ties to even, subnormals
  kept) or to the nearest integer (ties to even) for ``int8``; stored as its 8 raw bits (``uint8``);
* ``dequantized = float32(code) * scale`` (one correctly rounded fp32 product), then cast to the
  compute dtype (``param_dtype``).

Every step is a correctly rounded fp32 operation on the block's own values, so the bits of a block do
not depend on where the block sits or which rank quantizes it: any sharding that keeps blocks whole
(the planner's ``tile:RxC`` granularity) gives the same codes and scales. :func:`quantize_reference`
and :func:`dequantize_reference` are an independent plain-Python (float64) implementation of the same
format, used by the tests for a bit-exact comparison.

Sources: block-wise absmax scaling as in Dettmers et al., "8-bit Optimizers via Block-wise
Quantization" (arXiv 2110.02861) and DeepSpeed ZeRO++'s qwZ (arXiv 2306.10209, section 3.1:
block-quantized weight all-gather); the e4m3 format from Micikevicius et al., "FP8 Formats for Deep
Learning" (arXiv 2209.05433), torch's ``float8_e4m3fn`` (max 448, no infinities).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

# name -> (code dtype, QMAX)
FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "int8": (torch.int8, 127.0),
}


def check_format(dtype: str, block: tuple[int, int], *, who: str = "block_quant") -> tuple[int, int]:
    """Validate a format name and a block shape; return the block as a tuple of two ints.

    Raises:
        ValueError: an unknown ``dtype`` or a block that is not two positive ints.
    """
    if dtype not in FORMATS:
        raise ValueError(f"{who}: dtype={dtype!r} is not a block format; use one of {sorted(FORMATS)}")
    try:
        r, c = (int(v) for v in block)
    except (TypeError, ValueError):
        raise ValueError(
            f"{who}: block={block!r} must be two ints (R, C), e.g. (32, 32) or (1, 128)"
        ) from None
    if r < 1 or c < 1:
        raise ValueError(f"{who}: block={block!r} must be two positive ints (R, C), e.g. (32, 32)")
    return r, c


def num_blocks(n: int, w: int, block: tuple[int, int]) -> int:
    """Blocks of an ``(n, w)`` matrix: ``(n / R) * ceil(w / C)`` (``R`` must divide ``n``)."""
    r, c = block
    return (n // r) * (-(-w // c))


def block_absmax(x: Tensor, block: tuple[int, int]) -> Tensor:
    """``max |x|`` per block of a 2-D ``x`` ``(n, w)``: fp32 ``(n / R, ceil(w / C))``. Exact. Local."""
    r, c = block
    n, w = x.shape
    nb = -(-w // c)
    a = x.detach().abs().float()
    if nb * c != w:
        a = torch.nn.functional.pad(a, (0, nb * c - w))
    return a.view(n // r, r, nb, c).amax(dim=(1, 3))


def _expand(scales: Tensor, block: tuple[int, int], w: int) -> Tensor:
    return scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:, :w]


def quantize(
    x: Tensor, block: tuple[int, int], dtype: str, *, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D ``x`` ``(n, w)`` (any float dtype; computed in fp32) into blocks.

    Args:
        x: the matrix; ``R`` (``block[0]``) must divide ``n``.
        block: ``(R, C)``.
        dtype: ``"fp8_e4m3"`` or ``"int8"``.
        out: optional ``uint8`` ``(n, w)`` tensor (e.g. a view into a payload) the codes are written to.

    Returns:
        ``(codes, scales)``: ``uint8`` ``(n, w)`` raw code bits and fp32 ``(n / R, ceil(w / C))``.
        Local, no communication; each block's result depends on that block only.

    Raises:
        ValueError: a non-2-D ``x``, ``R`` not dividing ``n``, a bad format (:func:`check_format`).
    """
    block = check_format(dtype, block, who="quantize")
    if x.ndim != 2 or x.shape[0] % block[0]:
        raise ValueError(
            f"quantize: x of shape {tuple(x.shape)} must be 2-D with rows a multiple of the block height "
            f"{block[0]} (block={block})"
        )
    code_dtype, qmax = FORMATS[dtype]
    scales = block_absmax(x, block) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (x.detach().float() / _expand(safe, block, x.shape[1])).clamp_(-qmax, qmax)
    if code_dtype is torch.int8:
        q = q.round_()
    codes = q.to(code_dtype).view(torch.uint8)
    if out is not None:
        out.copy_(codes)
        codes = out
    return codes, scales


def dequantize(
    codes: Tensor,
    scales: Tensor,
    block: tuple[int, int],
    dtype: str,
    *,
    out_dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
) -> Tensor:
    """Values of ``uint8`` ``codes`` ``(n, w)`` with fp32 ``scales`` ``(n / R, ceil(w / C))``.

    ``float32(code) * scale`` (fp32), cast to ``out_dtype`` (or written into ``out``, cast to its dtype).
    Returns the ``(n, w)`` result. Local.
    """
    block = check_format(dtype, block, who="dequantize")
    code_dtype, _ = FORMATS[dtype]
    n, w = codes.shape
    vals = codes.view(code_dtype).float()
    r, c = block
    if w % c == 0:  # broadcast the scales, no expanded copy
        vals = vals.view(n // r, r, w // c, c).mul_(scales.view(n // r, 1, w // c, 1)).view(n, w)
    else:
        vals = vals.mul_(_expand(scales, block, w))
    if out is not None:
        out.copy_(vals)
        return out
    return vals.to(out_dtype)


# ---- reference: plain Python floats (float64), independent of torch's casts ------------------------


def round_to_format(v: float, mant_bits: int, min_exp: int, max_value: float | None = None) -> float:
    """``v`` rounded to the nearest value of a binary float format (ties to even), as a Python float.

    ``mant_bits``: explicit mantissa bits (fp32 23, bf16 7, e4m3 3); ``min_exp``: exponent of the
    smallest normal (fp32 -126, bf16 -126, e4m3 -6); subnormals below it keep the spacing
    ``2**(min_exp - mant_bits)``. ``max_value``: finite maximum (``None``: no overflow handling;
    the reference never exceeds it). Pure Python.
    """
    if v == 0 or math.isnan(v) or math.isinf(v):
        return v
    m, e = math.frexp(abs(v))  # abs(v) = m * 2**e, m in [0.5, 1)
    exp = max(e - 1, min_exp)  # exponent of the leading bit, clamped at the subnormal range
    ulp = math.ldexp(1.0, exp - mant_bits)
    q = abs(v) / ulp  # exact: a power-of-two scaling
    lo = math.floor(q)
    frac = q - lo
    n = lo + 1 if frac > 0.5 or (frac == 0.5 and lo % 2 == 1) else lo
    out = math.ldexp(float(n), exp - mant_bits)
    if max_value is not None and out > max_value:
        raise OverflowError(f"round_to_format: {v} exceeds the format's maximum {max_value}")
    return math.copysign(out, v)


def f32(v: float) -> float:
    """Round a Python float to the nearest fp32 (ties to even)."""
    return round_to_format(v, 23, -126)


def bf16(v: float) -> float:
    """Round a Python float to the nearest bf16 (ties to even)."""
    return round_to_format(v, 7, -126)


def _e4m3_bits(v: float) -> int:
    """The ``float8_e4m3fn`` bit pattern of a value already on the e4m3 grid (``|v| <= 448``)."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a == 0:
        return sign
    m, e = math.frexp(a)
    exp = e - 1
    if exp < -6:  # subnormal: a = mant * 2**-9
        return sign | int(a / 2.0**-9)
    mant = int((a / 2.0**exp - 1.0) * 8)
    return sign | ((exp + 7) << 3) | mant


def quantize_reference(rows: list[list[float]], block: tuple[int, int], dtype: str):
    """The block format in plain Python: ``rows`` (``n`` lists of ``w`` floats, values of the input dtype).

    Returns ``(codes, scales)``: ``n`` lists of ``w`` ints (the 8 raw code bits, 0..255) and
    ``n / R`` lists of ``ceil(w / C)`` floats (the fp32 scale values). Implements the module
    docstring's arithmetic with float64 operations each rounded to fp32 (exact emulation: a float64
    division or product of two fp32 values rounded to fp32 is the correctly rounded fp32 result).
    """
    r, c = check_format(dtype, block, who="quantize_reference")
    _, qmax = FORMATS[dtype]
    n, w = len(rows), len(rows[0]) if rows else 0
    nb = -(-w // c)
    codes = [[0] * w for _ in range(n)]
    scales = [[0.0] * nb for _ in range(n // r)]
    for bi in range(n // r):
        for bj in range(nb):
            cols = range(bj * c, min((bj + 1) * c, w))
            amax = max(abs(f32(rows[i][j])) for i in range(bi * r, bi * r + r) for j in cols)
            s = f32(amax / qmax)
            scales[bi][bj] = s
            d = s if s > 0 else 1.0
            for i in range(bi * r, bi * r + r):
                for j in cols:
                    q = min(max(f32(f32(rows[i][j]) / d), -qmax), qmax)
                    if dtype == "int8":
                        k = round(q)  # Python rounds half to even
                        codes[i][j] = k & 0xFF
                    else:
                        codes[i][j] = _e4m3_bits(round_to_format(q, 3, -6, 448.0))
    return codes, scales


def _decode(bits: int, dtype: str) -> float:
    if dtype == "int8":
        return float(bits - 256 if bits >= 128 else bits)
    sign = -1.0 if bits & 0x80 else 1.0
    exp, mant = (bits >> 3) & 0xF, bits & 0x7
    if exp == 0:
        return sign * mant * 2.0**-9
    return sign * (1.0 + mant / 8.0) * 2.0 ** (exp - 7)


def dequantize_reference(codes, scales, block: tuple[int, int], dtype: str, out: str = "fp32"):
    """Plain-Python values of ``codes`` / ``scales`` (as :func:`quantize_reference` returns them):
    ``f32(decode(code) * scale)``, then rounded to ``out`` (``"fp32"``, ``"bf16"``) or left as fp32.
    Returns ``n`` lists of ``w`` floats."""
    r, c = check_format(dtype, block, who="dequantize_reference")
    rnd = {"fp32": f32, "bf16": lambda v: bf16(f32(v))}[out]
    return [
        [rnd(_decode(b, dtype) * scales[i // r][j // c]) for j, b in enumerate(row)]
        for i, row in enumerate(codes)
    ]


def fp32_bits(v: float) -> int:
    """The IEEE fp32 bit pattern of ``v`` (for bit-exact comparisons)."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


__all__ = [
    "FORMATS",
    "block_absmax",
    "check_format",
    "dequantize",
    "dequantize_reference",
    "num_blocks",
    "quantize",
    "quantize_reference",
    "round_to_format",
]
