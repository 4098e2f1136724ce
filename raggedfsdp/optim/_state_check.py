"""Load-time validation of an optimizer's state dict against the state it built.

``AdamW8bit`` and ``Muon`` create every parameter's state at construction (keys, dtypes, layouts).
``torch.optim.Optimizer.load_state_dict`` copies whatever it is given: a state with a missing key, one
saved with another tile size or layout, or by another optimizer, was accepted and failed at the first
``step()`` as a bare ``KeyError: 'exp_avg_codes'`` or a size mismatch naming no parameter.
:func:`check_loaded_state` compares the incoming state of each parameter with the one it replaces,
before anything is changed, and raises one ``ValueError`` naming the parameter. Local (no collective).
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor

from raggedfsdp.optim._shards import local_flat

__all__ = ["check_loaded_state"]


def check_loaded_state(opt, state_dict: dict) -> None:
    """Raise ``ValueError`` unless ``state_dict["state"]`` gives each of ``opt``'s parameters the keys
    of the state ``opt`` holds now, each a tensor of the same global shape and local element count on
    this rank (a state saved at another world size or layout: load it through
    ``torch.distributed.checkpoint``, which reshards) and, for the 8-bit codes (``uint8``), the same
    dtype. Parameters are named ``#i`` (their order in ``opt.param_groups``) with their shape.
    Group-count and group-size mismatches are left to ``Optimizer.load_state_dict`` (its own error)."""
    name = type(opt).__name__
    ids = list(chain.from_iterable(g["params"] for g in state_dict.get("param_groups", ())))
    params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
    if len(ids) != len(params):
        return
    loaded = state_dict.get("state", {})
    fix = "load the state this optimizer saved, with the same constructor arguments and layout"
    for i, (key, p) in enumerate(zip(ids, params)):
        want = opt.state.get(p) or {}
        if not want:
            continue
        label = f"{name}.load_state_dict: parameter #{i} of shape {tuple(p.shape)}"
        got = loaded.get(key)
        if not got:
            raise ValueError(
                f"{label} has no state in the loaded state dict (expected {sorted(want)}); {fix}"
            )
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise ValueError(
                f"{label}: the loaded state has keys {sorted(got)}, this optimizer's are {sorted(want)} "
                f"(missing {missing}, unexpected {extra}: saved by another optimizer, or with another "
                f"block size or parameter shape); {fix}"
            )
        for k, w in want.items():
            g = got[k]
            if not isinstance(g, Tensor):
                raise ValueError(f"{label}: {k} is a {type(g).__name__}, not a tensor; {fix}")
            if k != "step" and tuple(g.shape) != tuple(w.shape):
                raise ValueError(
                    f"{label}: {k} has shape {tuple(g.shape)}, this optimizer's {tuple(w.shape)}; {fix}"
                )
            n_got, n_want = local_flat(g).numel(), local_flat(w).numel()
            if n_got != n_want:
                raise ValueError(
                    f"{label}: {k} holds {n_got} elements on this rank, this optimizer's piece {n_want} "
                    "(saved with another sharding layout or world size): load it through "
                    "torch.distributed.checkpoint (get/set_optimizer_state_dict), which reshards"
                )
            if (w.dtype == torch.uint8) != (g.dtype == torch.uint8):
                raise ValueError(f"{label}: {k} has dtype {g.dtype}, this optimizer's {w.dtype}; {fix}")
