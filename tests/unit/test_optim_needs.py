"""Optimizers declare the blocks they need (issue 22 item 1); the training job passes them to fully_shard.

With no ``shard_placement_fn`` a parameter is element-granular (the least padding). AdamW8bit (32x32
tiles) and Shampoo (whole bands) refuse such a layout with a ValueError naming the fix, and accept the
layout of ``raggedfsdp.app.train.optimizers.shard_placement_fn_for(name)``, the policy the job gives
``fully_shard``; Muon and AdamW declare nothing and run on the default. Fake process group, 7 ranks,
rank 3 (uneven element pieces).
"""

from __future__ import annotations

from _memory import run_fake_rank


def _case(rank, ws):
    import warnings

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import raggedfsdp
    from raggedfsdp.optim import AdamW8bit, Muon, Shampoo
    from raggedfsdp.app.train.optimizers import shard_placement_fn_for

    warnings.simplefilter("ignore")  # the padding warning of the block layouts
    mesh = init_device_mesh("cpu", (ws,))
    make = {
        "adamw8bit": lambda ps: AdamW8bit(ps, lr=1e-3),
        "shampoo": lambda ps: Shampoo(ps, lr=1e-3),
        "muon": lambda ps: Muon(ps, lr=1e-3),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    }
    out = {}
    for name, build in make.items():
        spf = shard_placement_fn_for(name)
        for given in (False, True):
            m = nn.Sequential(nn.Linear(96, 160, bias=False), nn.Linear(160, 96, bias=False))
            raggedfsdp.fully_shard(m, mesh=mesh, shard_placement_fn=spf if given else None)
            dims = [p.placements[-1].dims for p in m.parameters()]
            try:
                build(list(m.parameters()))
                out[name, given] = ("ok", spf is None, dims)
            except ValueError as e:
                out[name, given] = (str(e), spf is None, dims)
    return out


def test_optimizers_declare_their_blocks_and_the_job_passes_them():
    r = run_fake_rank(_case, 7, 3)
    for name in ("adamw8bit", "shampoo"):
        msg, none, dims = r[name, False]
        assert not none and dims == [(0, 1), (0, 1)], r[name, False]  # the default: element pieces
        cls = "AdamW8bit" if name == "adamw8bit" else "Shampoo"
        assert "cuts" in msg and f"shard_placement_fn={cls}" in msg, msg
        assert r[name, True][0] == "ok" and r[name, True][2] == [(0,), (0,)], r[name, True]
    for name in ("muon", "adamw"):  # no needs: the job passes None, the default layout
        want = ("ok", True, [(0, 1), (0, 1)])
        assert r[name, False] == r[name, True] == want, (r[name, False], r[name, True])
