"""The block-quantized format (``raggedfsdp/buffer/block_quant.py``) against its plain-Python reference.

Bit-exact: codes (raw 8 bits), scales (fp32 bits), dequantized fp32 and bf16 values, for fp8 e4m3 and
int8, square tiles, row blocks and an edge column group narrower than the block; inputs cover zero
blocks, ties, tiny values (e4m3 subnormals) and large magnitudes. The reference
(``quantize_reference``) uses Python floats only; its rounding helper is itself checked against
torch's fp32 / bf16 / e4m3 casts on chosen values.
"""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.buffer import block_quant as bq


def _matrix(n, w, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, w, generator=g) * torch.logspace(-6, 3, n).unsqueeze(1)  # rows of very different scale
    x[: n // 4, : min(w, 8)] = 0.0  # an all-zero block (scale 0)
    x[-1, 0] = 1e-30  # e4m3 subnormal after scaling
    return x


def _ref(x, block, dtype):
    return bq.quantize_reference(x.double().tolist(), block, dtype)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize(
    "block,shape", [((32, 32), (64, 70)), ((1, 16), (5, 40)), ((4, 8), (8, 8)), ((2, 64), (6, 3))]
)
def test_bit_exact_against_reference(dtype, block, shape):
    x = _matrix(*shape, seed=shape[0] * 7 + block[0])
    codes, scales = bq.quantize(x, block, dtype)
    rc, rs = _ref(x, block, dtype)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.shape == (shape[0] // block[0], -(-shape[1] // block[1]))
    assert codes.tolist() == rc
    assert [[bq.fp32_bits(v) for v in row] for row in scales.tolist()] == [
        [bq.fp32_bits(v) for v in row] for row in rs
    ]
    deq = bq.dequantize(codes, scales, block, dtype)
    want = bq.dequantize_reference(rc, rs, block, dtype)
    assert deq.dtype == torch.float32
    assert torch.equal(deq.view(torch.int32), torch.tensor(want, dtype=torch.float32).view(torch.int32))
    deq16 = bq.dequantize(codes, scales, block, dtype, out_dtype=torch.bfloat16)
    want16 = bq.dequantize_reference(rc, rs, block, dtype, out="bf16")
    assert deq16.float().tolist() == want16
    # the error bound of the format: half a code step of the block's absmax
    step = {"fp8_e4m3": 2.0**-4, "int8": 1.0 / 127}[dtype]  # e4m3: 3 mantissa bits, relative 1/16
    amax = bq._expand(bq.block_absmax(x, block), block, shape[1])
    err = (deq - x).abs()
    if dtype == "int8":
        assert bool((err <= amax * step / 2 * 1.0001 + 1e-45).all())
    else:  # relative error 2^-4 of each value, or the subnormal step of the block
        assert bool((err <= x.abs() * step + amax / 448 * 2.0**-9 + 1e-45).all())


def test_reference_rounding_matches_torch_casts():
    vals = [
        1.0 + 2.0**-24,
        1.0 + 3 * 2.0**-24,
        3.1415926535,
        -(2.0**-130),
        1e-45,
        448.0 / 3,
        0.1,
        2.0**-10 * 1.5,
    ]
    for v in vals:
        t = torch.tensor(v, dtype=torch.float64)
        assert bq.f32(v) == t.float().item()
        assert bq.bf16(bq.f32(v)) == t.float().bfloat16().item()
    for v in [0.0, 1.0625, 1.1875, 2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 447.0, 17.0, -0.3, 3.0 * 2.0**-8]:
        t = torch.tensor(v, dtype=torch.float32).to(torch.float8_e4m3fn)
        assert bq.round_to_format(bq.f32(v), 3, -6, 448.0) == t.float().item(), v
        assert bq._e4m3_bits(t.float().item()) == t.view(torch.uint8).item(), v


def test_world_size_invariance_of_blocks():
    """Quantizing row-slices that keep blocks whole gives the same bits as the whole matrix."""
    x = _matrix(96, 50, seed=3)
    for dtype in bq.FORMATS:
        codes, scales = bq.quantize(x, (32, 32), dtype)
        parts = [bq.quantize(x[a:b], (32, 32), dtype) for a, b in ((0, 32), (32, 96))]
        assert torch.equal(torch.cat([p[0] for p in parts]), codes)
        assert torch.equal(torch.cat([p[1] for p in parts]), scales)


def test_bad_input():
    with pytest.raises(ValueError, match="dtype='fp4'"):
        bq.quantize(torch.zeros(32, 32), (32, 32), "fp4")
    with pytest.raises(ValueError, match="block"):
        bq.quantize(torch.zeros(32, 32), (0, 32), "int8")
    with pytest.raises(ValueError, match="multiple of the block height 32"):
        bq.quantize(torch.zeros(33, 32), (32, 32), "int8")
