"""The switch of the element-wise ``_foreach_*`` fast path (raggedfsdp/placement/_foreach.py); its
results are checked against torch's dispatch in tests/dist/test_foreach_fast_path.py."""

from __future__ import annotations

import pytest
import torch


def test_installed_by_default_only_where_torch_dispatches_in_python(monkeypatch):
    from raggedfsdp._compat import torch_minor
    from raggedfsdp.placement import _foreach

    monkeypatch.delenv(_foreach.ENV, raising=False)
    assert _foreach.wanted() == (torch_minor() < (2, 13))
    monkeypatch.setenv(_foreach.ENV, "0")
    assert _foreach.wanted() is False and _foreach.install({}) == []
    monkeypatch.setenv(_foreach.ENV, "1")
    h: dict = {}
    got = _foreach.install(h)
    assert _foreach.wanted() is True and set(got) == set(_foreach.supported_ops()) == set(h)
    assert all(h[op] is _foreach.foreach_handler for op in got)
    # only ops torch's DTensor can run itself (a registered strategy), and every op AdamW / SGD use
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    regs = (prop.op_strategy_funcs, prop.op_to_rules, getattr(prop, "op_single_dim_strategy_funcs", {}))
    assert all(any(op in r for r in regs) for op in got)
    a = torch.ops.aten
    used = {
        a._foreach_lerp_.Scalar,
        a._foreach_mul_.Scalar,
        a._foreach_addcmul_.Scalar,
        a._foreach_sqrt.default,
    }
    used |= {a._foreach_div_.ScalarList, a._foreach_add_.Scalar, a._foreach_addcdiv_.ScalarList}
    used |= {a._foreach_add_.List, a._foreach_mul_.List}
    assert used <= set(got), used - set(got)
    assert a._foreach_norm.Scalar not in h
    h[got[0]] = print  # torch gaining its own handler is refused loudly
    with pytest.raises(RuntimeError, match="port placement/_foreach.py"):
        _foreach.install(h)
    monkeypatch.setenv(_foreach.ENV, "yes")
    with pytest.raises(ValueError, match="RAGGEDFSDP_FOREACH_FAST_PATH='yes'"):
        _foreach.wanted()
