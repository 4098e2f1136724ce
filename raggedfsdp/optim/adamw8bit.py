"""Block-wise 8-bit AdamW on RaggedShard parameters: per-tile statistics that never straddle ranks.

Each eligible parameter (``_quant.tile_eligible``: ``ndim >= 2``, ``numel >= 4096``, tile height
dividing ``shape[-2]``, decided from the **global** shape only) keeps both moments as uint8 codes
(one per element, laid out exactly like the parameter) plus one fp32 absmax scale per ``R x C``
tile of the matrix (``shape`` viewed as ``(numel / shape[-1], shape[-1])``). Other parameters keep
fp32 moments. A rank quantizes only its own tiles, with no communication, so the result is
bit-identical to :func:`raggedfsdp.optim.reference.adamw8bit_reference_step` at every world size,
provided no rank boundary cuts a tile: use ``shard_placement_fn=AdamW8bit.shard_placement_fn`` in
``fully_shard`` (the planner's ``tile:32x32`` block), otherwise the constructor raises.

Memory per parameter element (eligible tensors): 2 bytes of codes + ``8 / (R*C)`` bytes of scales
(2.0078 B for 32x32 tiles) against 8 B for torch's fp32 AdamW: about 1/4.
"""

from __future__ import annotations

import math
from itertools import chain

import torch
from torch import Tensor
from torch.optim import Optimizer

from raggedfsdp.optim._quant import (
    adamw_math,
    dequantize_tiles,
    quantize_tiles,
    tile_eligible,
    zero_code,
)
from raggedfsdp.optim._shards import local_flat, shard_info
from raggedfsdp.optim._state_check import check_loaded_state
from raggedfsdp.placement.ragged_shard import RaggedShard

_QUANT_KEYS = ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale")


def tile_placement_fn(block: tuple[int, int] = (32, 32)):
    """A ``fully_shard`` ``shard_placement_fn``: ``"tile:RxC"`` for parameters :func:`tile_eligible` for
    ``block``, ``None`` (the default layout) for the rest. Decided from the global shape only."""
    r, c = block

    def fn(param) -> str | None:
        return f"tile:{r}x{c}" if tile_eligible(tuple(param.shape), block) else None

    fn.__name__ = f"tile_placement_fn({r}x{c})"
    return fn


class AdamW8bit(Optimizer):
    """AdamW with 8-bit block-wise moments (``R x C`` tiles, fp32 absmax scale per tile), exact on shards.

    Args:
        params: parameters or param groups (plain tensors or RaggedShard DTensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled decay ``p *= 1 - lr * wd``;
            bias-corrected ``m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``).
        block: tile ``(R, C)`` in elements (rows, cols); default 32x32.

    State (created at construction, all DTensors laid out like the parameter so DCP saves them
    without a gather and reshards them on load): ``step`` (fp32 scalar); eligible parameters:
    ``exp_avg_codes`` / ``exp_avg_sq_codes`` (uint8, the parameter's shape) and ``exp_avg_scale`` /
    ``exp_avg_sq_scale`` (fp32, ``(rows / R, ceil(cols / C))``, ``RaggedShard((0,), tile rows per
    rank)``); other parameters: fp32 ``exp_avg`` / ``exp_avg_sq``.
    The moments are quantized with a signed / unsigned dynamic-exponent code book
    (``_quant._code_book``: relative resolution down to ~1e-7 of a tile's absmax).

    Which ranks: ``step()`` needs no communication at all.

    Raises:
        ValueError: bad hyperparameters or ``block``; a parameter whose piece on some rank cuts a tile
            (naming it and the fix ``shard_placement_fn=AdamW8bit.shard_placement_fn``).
        NotImplementedError: tensor-parallel (``Shard``) placements.
    """

    shard_placement_fn = staticmethod(tile_placement_fn((32, 32)))
    """``fully_shard(..., shard_placement_fn=AdamW8bit.shard_placement_fn)`` keeps 32x32 tiles whole."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block: tuple[int, int] = (32, 32),
    ) -> None:
        if not float(lr) >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"AdamW8bit: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW8bit: betas={betas} must lie in [0, 1)")
        block = tuple(int(b) for b in block)
        if len(block) != 2 or min(block) < 1:
            raise ValueError(
                f"AdamW8bit: block={block} must be two positive ints (rows, cols), e.g. (32, 32)"
            )
        super().__init__(
            params,
            {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "block": block},
        )
        self._index = {
            id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))
        }
        for group in self.param_groups:
            for p in group["params"]:
                self._init_param(p, tuple(group["block"]))

    def _init_param(self, p: Tensor, block: tuple[int, int]) -> None:
        st = self.state[p]
        if st:
            return
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        shape = tuple(p.shape)
        if not tile_eligible(shape, block):
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            return
        info = shard_info(p, f"#{self._index[id(p)]}", tp="local")  # FSDP x TP: the TP-local tensor's pieces
        lshape = info.shape
        r, c = block
        ncols = lshape[-1]
        if lshape != shape and (lshape[-2] % r or ncols % c):
            raise ValueError(
                f"AdamW8bit: parameter #{self._index[id(p)]} of global shape {shape}: its tensor-parallel "
                f"local "
                f"block {lshape} cuts a {r}x{c} tile (tiles are global: the TP split must keep whole tiles); "
                "use a TP degree that divides the tile rows/cols, or give this parameter to torch.optim.AdamW"
            )
        tile = r * ncols  # elements in one row of tiles
        for q, (a, b) in enumerate(info.ranges):
            if a % tile or b % tile:
                raise ValueError(
                    f"AdamW8bit: parameter #{self._index[id(p)]} of shape {shape}: rank {q}'s piece [{a}, "
                    f"{b}) cuts a {r}x{c} tile (pieces must hold whole multiples of {tile} elements = {r} "
                    "rows); shard it with fully_shard(..., shard_placement_fn=AdamW8bit.shard_placement_fn)"
                )
        ncb = -(-ncols // c)
        units = tuple((b - a) // tile for a, b in info.ranges)
        n_local = info.local.numel()
        # the scale grid of the GLOBAL tensor: TP-split rows / columns of tiles become Shard(0) / Shard(1)
        scale_shape = (math.prod(shape[:-1]) // r, -(-shape[-1] // c))
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            codes = torch.full((n_local,), zero_code(signed), dtype=torch.uint8, device=info.local.device)
            scale = torch.zeros(units[info.rank] * ncb, dtype=torch.float32, device=info.local.device)
            st[key + "_codes"] = self._wrap(p, codes, shape, None)
            st[key + "_scale"] = self._wrap(p, scale, scale_shape, units)

    @staticmethod
    def _wrap(p: Tensor, local: Tensor, shape, units) -> Tensor:
        """``local`` as a DTensor like ``p`` (``units``: a ``RaggedShard((0,), units)`` scale tensor of the
        tile grid, whose TP placements split tile rows (``Shard(0)``) or tile columns (``Shard(1)``))."""
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(p, DTensor):
            return local.view(shape)

        def scale_pl(pl):
            if isinstance(pl, RaggedShard):
                return RaggedShard((0,), units)
            if type(pl) is Shard:
                return Shard(1 if pl.dim % p.ndim == p.ndim - 1 else 0)
            return pl

        placements = tuple((scale_pl(pl) if units is not None else pl) for pl in p.placements)
        shape = tuple(shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, p.device_mesh, placements, run_check=False, shape=shape, stride=stride
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter with a gradient; no communication. Returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            block = tuple(group["block"])
            kw = {
                "lr": float(group["lr"]),
                "beta1": b1,
                "beta2": b2,
                "eps": group["eps"],
                "weight_decay": group["weight_decay"],
            }
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] += 1
                t = int(st["step"].item())
                pl, gl = local_flat(p), local_flat(p.grad)
                if "exp_avg" in st:
                    adamw_math(pl, gl, local_flat(st["exp_avg"]), local_flat(st["exp_avg_sq"]), step=t, **kw)
                    continue
                ncols = shard_info(p, tp="local").shape[-1]  # of the TP-local tensor (FSDP x TP)
                ncb = -(-ncols // block[1])
                codes = [local_flat(st[k]) for k in ("exp_avg_codes", "exp_avg_sq_codes")]
                scales = [local_flat(st[k]) for k in ("exp_avg_scale", "exp_avg_sq_scale")]
                m, v = (
                    dequantize_tiles(cd.view(-1, ncols), sc.view(-1, ncb), block, signed)
                    for cd, sc, signed in zip(codes, scales, (True, False))
                )
                adamw_math(pl.view(-1, ncols), gl.view(-1, ncols), m, v, step=t, **kw)
                for x, cd, sc, signed in zip((m, v), codes, scales, (True, False)):
                    newc, news = quantize_tiles(x, block, signed)
                    cd.copy_(newc.view(-1))
                    sc.copy_(news.view(-1))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """``Optimizer.load_state_dict`` that keeps the uint8 codes and fp32 scales in their dtypes.

        (Torch casts every floating/non-``step`` state value to the parameter's dtype, which would turn
        codes into floats and scales into the parameter's dtype.)

        Raises ``ValueError`` naming the parameter, before anything is loaded, when a parameter's state
        lacks a key of this optimizer's or has another one (another block size, or fp32 moments of an
        ineligible shape), or a tensor of another shape, layout or code dtype
        (``_state_check.check_loaded_state``).
        """
        check_loaded_state(self, state_dict)
        sd = dict(state_dict)
        state = {k: dict(v) for k, v in sd["state"].items()}
        kept = {k: {n: v.pop(n) for n in list(v) if n in _QUANT_KEYS} for k, v in state.items()}
        sd["state"] = state
        super().load_state_dict(sd)
        ids = chain.from_iterable(g["params"] for g in sd["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for k, p in zip(ids, params):
            for n, v in kept.get(k, {}).items():
                self.state[p][n] = v.to(device=p.device)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (local pieces; ``step`` scalars excluded)."""
        total = 0
        for st in self.state.values():
            for k, v in st.items():
                if k != "step" and isinstance(v, Tensor):
                    loc = local_flat(v)
                    total += loc.numel() * loc.element_size()
        return total
