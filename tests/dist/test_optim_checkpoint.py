"""DCP: optimizer state saved at 4 ranks loads at 3 and at 1 rank (other layouts) and continues bit-exactly.

Muon (momentum, plus an AdamW group), AdamW8bit (uint8 codes + fp32 tile scales) and Shampoo
(per-band block statistics and inverse roots, RaggedShard over bands) state tensors
are DTensors laid out like the parameters; DCP writes each rank's piece without a gather and
reshards on load. The oracle is the single-device run of all 4 steps.
"""

import torch
from _cases import case_tmpdir
from _spawns import CHECKPOINTS  # one spawn per world size for the 4 checkpoint tests

M_SHAPES = [(64, 48), (2, 32, 24), (48,)]  # Muon: matrix, expert stack, and a vector for the AdamW group
Q_SHAPES = [(64, 80), (96, 65), (300,)]  # AdamW8bit: two tiled matrices and an fp32-state vector
S_SHAPES = [(32, 24), (2, 16, 12), (40,)]  # Shampoo (block 8): 8-row bands, an expert stack, an AdamW vector
S_HP = {"lr": 1e-2, "weight_decay": 0.05, "block_size": 8, "precondition_frequency": 2}  # roots at steps 2, 4
WHICH = ("muon", "adamw8bit", "shampoo")


def _shapes(which):
    return {"muon": M_SHAPES, "adamw8bit": Q_SHAPES, "shampoo": S_SHAPES}[which]


STEPS = 4


def _grads(shapes, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _inits(shapes):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) for s in shapes]


def _make_opt(which, params):
    from raggedfsdp.optim import AdamW8bit, Muon, Shampoo

    if which == "shampoo":
        return Shampoo(params, **S_HP)
    if which == "muon":
        groups = [
            {"params": params[:2]},
            {
                "params": params[2:],
                "algorithm": "adamw",
                "lr": 3e-3,
                "eps": 1e-8,
                "betas": (0.9, 0.95),
                "weight_decay": 0.0,
            },
        ]
        return Muon(groups, lr=0.02)
    return AdamW8bit(params, lr=1e-2, weight_decay=0.05)


def _reference(which):
    """Parameters after STEPS single-device steps (torch.optim.Muon / AdamW / the 8-bit reference)."""
    from raggedfsdp.optim.reference import (
        adamw8bit_reference_step,
        muon_reference_step,
        shampoo_reference_step,
    )

    shapes = _shapes(which)
    ps = [torch.nn.Parameter(f) for f in _inits(shapes)]
    if which == "muon":
        tm = torch.optim.Muon([ps[0]], lr=0.02)
        ta = torch.optim.AdamW([ps[2]], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        buf = torch.zeros(M_SHAPES[1])
    states = [{} for _ in shapes]
    for s in range(STEPS):
        gs = _grads(shapes, s)
        if which == "muon":
            ps[0].grad, ps[2].grad = gs[0], gs[2]
            tm.step()
            ta.step()
            muon_reference_step(ps[1].data, gs[1], buf, lr=0.02)
        elif which == "shampoo":
            for p, gr, st in zip(ps, gs, states):
                shampoo_reference_step(p.data, gr, st, **S_HP)
        else:
            for p, gr, st in zip(ps, gs, states):
                adamw8bit_reference_step(p.data, gr, st, lr=1e-2, weight_decay=0.05)
    return [p.detach() for p in ps]


def _build(which, rank, ws, seed, fulls):
    from _optim_cases import layout, make_param
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.optim._quant import tile_eligible
    from raggedfsdp.optim._shampoo_math import band_geometry

    mesh = init_device_mesh("cpu", (ws,))
    model = torch.nn.Module()
    params = []
    for i, f in enumerate(fulls):
        if which == "muon":
            kind = ("element", "row")[(seed + i) % 2] if f.ndim > 1 else "element"
            rs = layout(kind, f.shape, ws, seed + i)
        elif which == "shampoo":
            br = band_geometry(tuple(f.shape), 8)[0] if f.ndim > 1 else 1
            rs = layout("row" if f.ndim > 1 else "element", f.shape, ws, seed + i, block_rows=br)
        else:
            br = 32 if tile_eligible(tuple(f.shape)) else 1
            rs = layout("row" if f.ndim > 1 else "element", f.shape, ws, seed + i, block_rows=br)
        p = make_param(f, mesh, (rs,), rank)
        model.register_parameter(f"p{i}", p)
        params.append(p)
    return model, params


def _run_steps(params, opt, shapes, steps, rank):
    from _optim_cases import set_grad

    for s in steps:
        for p, gr in zip(params, _grads(shapes, s)):
            set_grad(p, gr, rank)
        opt.step()


def _save(rank, ws, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import raggedfsdp  # noqa: F401

    for which in WHICH:
        shapes = _shapes(which)
        model, params = _build(which, rank, ws, 11, _inits(shapes))
        opt = _make_opt(which, params)
        _run_steps(params, opt, shapes, range(STEPS // 2), rank)
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=f"{path}/{which}",
        )


def _load(rank, ws, path):
    import torch.distributed.checkpoint as dcp
    from _optim_cases import full
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import raggedfsdp  # noqa: F401

    for which in WHICH:
        shapes = _shapes(which)
        model, params = _build(which, rank, ws, 23 + ws, [torch.zeros(s) for s in shapes])
        opt = _make_opt(which, params)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=f"{path}/{which}")
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        if which == "adamw8bit":
            st = opt.state[params[0]]
            assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_scale"].dtype == torch.float32
        _run_steps(params, opt, shapes, range(STEPS // 2, STEPS), rank)
        for i, (p, r) in enumerate(zip(params, _reference(which))):
            assert torch.equal(full(p), r), (which, i, (full(p) - r).abs().max())


def _save_shared(rank, ws):
    _save(rank, ws, case_tmpdir("optim"))


def _load_shared(rank, ws):
    _load(rank, ws, case_tmpdir("optim"))


def test_optimizer_state_reshards_4_to_3_and_1():
    CHECKPOINTS.check(4, "optim_save")
    CHECKPOINTS.check(3, "optim_load")
    CHECKPOINTS.check(1, "optim_load")
