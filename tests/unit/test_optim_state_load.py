"""``AdamW8bit`` / ``Muon.load_state_dict`` check the state at load time (issue 41 item 6): a missing key,
a state of another block size or shape, or another optimizer's state raised later, at the first
``step()``, as a bare ``KeyError: 'exp_avg_codes'`` or a size mismatch naming no parameter. Now one
``ValueError`` names the parameter, and nothing is loaded. A state that matches loads and steps as the
uninterrupted optimizer does (bitwise)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from raggedfsdp.optim import AdamW8bit, Muon


def _params(shapes):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(s)) for s in shapes]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_adamw8bit_round_trip_equals_the_uninterrupted_run():
    ps = _params([(64, 64), (7,)])
    opt = AdamW8bit(ps, lr=0.01)
    _grads(ps, 1)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    fresh = AdamW8bit(qs, lr=0.01)
    fresh.load_state_dict(sd)
    _grads(ps, 2), _grads(qs, 2)
    opt.step(), fresh.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda sd: sd["state"][0].pop("exp_avg_codes"),
            r"AdamW8bit.load_state_dict: parameter #0 of shape \(64, 64\): the loaded state has keys "
            r"\['exp_avg_scale', 'exp_avg_sq_codes', 'exp_avg_sq_scale', 'step'\], this optimizer's are .*"
            r"\(missing \['exp_avg_codes'\], unexpected \[\]",
        ),
        (
            lambda sd: sd["state"].pop(1),
            r"AdamW8bit.load_state_dict: parameter #1 of shape \(7,\) has no state in the loaded state dict "
            r"\(expected \['exp_avg', 'exp_avg_sq', 'step'\]\)",
        ),
        (
            lambda sd: sd["state"][0].__setitem__("exp_avg_codes", sd["state"][0]["exp_avg_codes"].float()),
            r"parameter #0 of shape \(64, 64\): exp_avg_codes has dtype torch.float32, this optimizer's "
            r"torch.uint8",
        ),
    ],
    ids=["missing_key", "missing_param", "codes_as_floats"],
)
def test_adamw8bit_bad_state_is_refused_naming_the_parameter(edit, match):
    ps = _params([(64, 64), (7,)])
    sd = copy.deepcopy(AdamW8bit(ps).state_dict())
    edit(sd)
    opt = AdamW8bit(ps)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()  # nothing was loaded
    for k, st in before["state"].items():
        assert all(torch.equal(v, after["state"][k][n]) for n, v in st.items())


def test_adamw8bit_state_of_another_block_size_or_optimizer_is_refused():
    ps = _params([(64, 64), (7,)])
    other_block = AdamW8bit(ps, block=(16, 16)).state_dict()
    with pytest.raises(ValueError, match=r"#0 of shape \(64, 64\): exp_avg_scale has shape \(4, 4\), this "
                       r"optimizer's \(2, 2\)"):  # fmt: skip
        AdamW8bit(ps).load_state_dict(other_block)
    adamw = torch.optim.AdamW(ps)
    _grads(ps, 0)
    adamw.step()
    with pytest.raises(ValueError, match=r"#0 of shape \(64, 64\): the loaded state has keys \['exp_avg', "
                       r"'exp_avg_sq', 'step'\].*saved by another optimizer"):  # fmt: skip
        AdamW8bit(ps).load_state_dict(adamw.state_dict())


def test_muon_bad_state_is_refused_naming_the_parameter():
    ps = _params([(8, 6), (6,)])
    groups = [{"params": [ps[0]]}, {"params": [ps[1]], "algorithm": "adamw"}]
    good = copy.deepcopy(Muon(groups).state_dict())
    Muon(groups).load_state_dict(good)  # its own state loads

    sd = copy.deepcopy(good)
    sd["state"][0].pop("momentum_buffer")
    with pytest.raises(
        ValueError, match=r"Muon.load_state_dict: parameter #0 of shape \(8, 6\) has no state"
    ):
        Muon(groups).load_state_dict(sd)
    sd = copy.deepcopy(good)
    sd["state"][1].pop("exp_avg_sq")
    with pytest.raises(ValueError, match=r"parameter #1 of shape \(6,\): .*\(missing \['exp_avg_sq'\]"):
        Muon(groups).load_state_dict(sd)
    qs = _params([(6, 8), (6,)])  # a transposed matrix: another model's state
    other = Muon([{"params": [qs[0]]}, {"params": [qs[1]], "algorithm": "adamw"}]).state_dict()
    with pytest.raises(
        ValueError, match=r"parameter #0 of shape \(8, 6\): momentum_buffer has shape \(6, 8\)"
    ):
        Muon(groups).load_state_dict(other)
