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
    assert _foreach.wanted() is True and set(_foreach.install(h)) == set(_foreach.OPS)
    assert all(h[op] is _foreach.foreach_handler for op in _foreach.OPS)
    assert torch.ops.aten._foreach_addcdiv_.Scalar in h and torch.ops.aten._foreach_norm.Scalar not in h
    h[_foreach.OPS[0]] = print  # torch gaining its own handler is refused loudly
    with pytest.raises(RuntimeError, match="port placement/_foreach.py"):
        _foreach.install(h)
    monkeypatch.setenv(_foreach.ENV, "yes")
    with pytest.raises(ValueError, match="RAGGEDFSDP_FOREACH_FAST_PATH='yes'"):
        _foreach.wanted()
