"""Distributed Shampoo with AdamW grafting on RaggedShard parameters: whole blocks on their owner rank.

Every 2-D parameter (and every matrix of a 3-D expert stack) is cut into bands of ``R_b`` rows and
blocks of at most ``B x B`` (``_shampoo_math``). Laid out with ``shard_placement_fn=
Shampoo.shard_placement_fn`` (the planner's ``tile:R_bxB`` block), every band lies whole on one
rank, so each block's statistics ``L``, ``R`` and inverse roots live on the rank that holds the
block (its owner) and a step needs **no communication**: the owner accumulates its blocks'
statistics, refreshes their roots every ``precondition_frequency`` steps (``eigh``, fp32) and
applies the grafted update to its own rows. The result is bit-identical to
:func:`raggedfsdp.optim.reference.shampoo_reference_step` at every world size and layout that keeps
bands whole; a layout that cuts a band raises. Parameters that are not 2-D/3-D get plain AdamW.
Source: Shi et al., arXiv 2309.06497 (distributed Shampoo; there blocks follow the local FSDP shard,
so results depend on the layout; here the layout follows the blocks); Anil et al., arXiv 2002.09018.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor
from torch.optim import Optimizer

from raggedfsdp.optim._quant import adamw_math
from raggedfsdp.optim._shampoo_math import (
    SHAMPOO_DEFAULTS,
    band_geometry,
    shampoo_state_shapes,
    shampoo_update,
)
from raggedfsdp.optim._shards import local_flat, shard_info, wrap_like

_STAT_KEYS = ("L", "R", "L_root", "R_root")


def shampoo_placement_fn(block_size: int = 128):
    """A ``fully_shard`` ``shard_placement_fn``: ``"tile:R_bxB"`` (whole Shampoo bands) for 2-D/3-D
    parameters, ``None`` (the default layout) for the rest. Decided from the global shape only."""

    def fn(param) -> str | None:
        shape = tuple(param.shape)
        if len(shape) not in (2, 3):
            return None
        return f"tile:{band_geometry(shape, block_size)[0]}x{block_size}"

    fn.__name__ = f"shampoo_placement_fn({block_size})"
    return fn


class Shampoo(Optimizer):
    """Block-diagonal Shampoo (``L^-1/4 m R^-1/4`` per block) grafted onto AdamW's per-block step norm.

    Args:
        params: parameters or param groups (plain tensors or RaggedShard DTensors, FSDP or HSDP).
        lr, betas, eps, weight_decay: AdamW's (decoupled decay ``p *= 1 - lr * wd``); the grafting
            direction is ``m_hat / (sqrt(v_hat) + eps)``.
        block_size: ``B``, blocks are at most ``B x B`` (rows: the largest divisor of ``shape[-2]``
            that is ``<= B``). Default 128.
        shampoo_beta: statistics ``L <- beta L + (1 - beta) G G^T`` (``1.0``: a plain sum, default).
        precondition_frequency: ``K``; roots are refreshed when ``step % K == 0`` and used from step
            ``K`` on (AdamW before). Default 10.
        matrix_eps: added to the statistics' eigenvalues before the ``-1/4`` power. Default 1e-6.

    State (created at construction; DTensors laid out like the parameter, so DCP saves without a
    gather and reshards on load): ``step`` (fp32 scalar), fp32 ``exp_avg`` / ``exp_avg_sq``; 2-D/3-D
    parameters also ``L``, ``L_root`` ``(bands, col_blocks, R_b, R_b)`` and ``R``, ``R_root``
    ``(bands, col_blocks, C, C)`` fp32, ``RaggedShard((0,), bands per rank)``.

    Which ranks: ``step()`` needs no communication (under HSDP every replica updates its own copy).

    Raises:
        ValueError: bad hyperparameters; a parameter whose piece on some rank cuts a band (naming it
            and the fix ``shard_placement_fn=Shampoo.shard_placement_fn``).
        NotImplementedError: tensor-parallel (``Shard``) placements.
    """

    shard_placement_fn = staticmethod(shampoo_placement_fn(SHAMPOO_DEFAULTS["block_size"]))
    """``fully_shard(..., shard_placement_fn=Shampoo.shard_placement_fn)`` keeps 128-wide bands whole."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        block_size: int = 128,
        shampoo_beta: float = 1.0,
        precondition_frequency: int = 10,
        matrix_eps: float = 1e-6,
    ) -> None:
        if not float(lr) >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0 or not matrix_eps > 0.0:
            raise ValueError(
                f"Shampoo: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0 and "
                f"matrix_eps={matrix_eps} > 0"
            )
        if not all(0.0 <= b < 1.0 for b in betas) or not 0.0 < shampoo_beta <= 1.0:
            raise ValueError(
                f"Shampoo: betas={betas} must lie in [0, 1) and shampoo_beta={shampoo_beta} in (0, 1]"
            )
        for nm, v in (("block_size", block_size), ("precondition_frequency", precondition_frequency)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Shampoo: {nm}={v!r} must be an int >= 1")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "block_size": block_size,
            "shampoo_beta": shampoo_beta,
            "precondition_frequency": precondition_frequency,
            "matrix_eps": matrix_eps,
        }
        super().__init__(params, defaults)
        self._index = {
            id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))
        }
        for group in self.param_groups:
            for p in group["params"]:
                self._init_param(p, int(group["block_size"]))

    def _init_param(self, p: Tensor, block: int) -> None:
        st = self.state[p]
        if st:
            return
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        shape = tuple(p.shape)
        shapes = shampoo_state_shapes(shape, block)
        if shapes is None:
            return
        info = shard_info(p, f"#{self._index[id(p)]}")
        r_b = band_geometry(shape, block)[0]
        band = r_b * shape[-1]
        for q, (a, b) in enumerate(info.ranges):
            if a % band or b % band:
                raise ValueError(
                    f"Shampoo: parameter #{self._index[id(p)]} of shape {shape}: rank {q}'s piece [{a}, {b}) "
                    f"cuts a {r_b}-row Shampoo band (block_size={block}; pieces must hold whole multiples of "
                    f"{band} elements = {r_b} rows); shard it with fully_shard(..., "
                    f"shard_placement_fn=Shampoo.shard_placement_fn) (or shampoo_placement_fn({block}))"
                )
        units = tuple((b - a) // band for a, b in info.ranges)
        for k in _STAT_KEYS:
            s = shapes[k]
            local = torch.zeros(
                units[info.rank] * s[1] * s[2] * s[3], dtype=torch.float32, device=info.local.device
            )
            st[k] = wrap_like(p, local, s, units)

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter with a gradient; no communication. Returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            block = int(group["block_size"])
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
                m, v = local_flat(st["exp_avg"]), local_flat(st["exp_avg_sq"])
                if "L" not in st:
                    adamw_math(pl, gl, m, v, step=t, **kw)
                    continue
                shape = tuple(p.shape)
                r_b, cols, _, _ = band_geometry(shape, block)
                stats = {}
                for k in _STAT_KEYS:
                    s = st[k].shape
                    stats[k] = local_flat(st[k]).view(-1, s[1], s[2], s[3])
                shampoo_update(
                    pl.view(-1, cols),
                    gl.view(-1, cols),
                    m.view(-1, cols),
                    v.view(-1, cols),
                    stats,
                    block=block,
                    r_b=r_b,
                    step=t,
                    shampoo_beta=group["shampoo_beta"],
                    precondition_frequency=group["precondition_frequency"],
                    matrix_eps=group["matrix_eps"],
                    **kw,
                )
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (local pieces; ``step`` scalars excluded)."""
        return sum(
            local_flat(v).numel() * v.element_size()
            for st in self.state.values()
            for k, v in st.items()
            if k != "step" and isinstance(v, Tensor)
        )
