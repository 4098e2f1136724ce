"""``estimate-memory`` against torch's own FSDP2 tracker (``FSDPMemTracker``) and our measured state.

Each row trains one step of a tiny model at world size 2-4 (rank 0 of torch's fake process group)
under torch's ``fully_shard`` + ``FSDPMemTracker`` and under ``raggedfsdp.fully_shard``
(``benchmarks/estimate_vs_tracker.py``, whose table docs/memory.md records). Bounds:

* our estimate's sharded params equal our measured storage exactly (the planner's layout), and its
  AdamW state equals ours up to the padding (moments are per-parameter) and the ``step`` scalars;
* torch's tracker differs from our estimate by exactly the two layouts' padding difference (FSDP2's
  dim-0 padding on rank 0, computed independently here), plus ``step`` scalars for the optimizer;
* the working-set estimate (two units unsharded, params + grads) is at least the tracker's peak of
  unsharded params.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest

from raggedfsdp.app.sizing.registry import model_units

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "estimate_vs_tracker", ROOT / "benchmarks" / "estimate_vs_tracker.py"
)
evt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(evt)


def _fsdp2_rank0_bytes(units, ws: int) -> int:
    """Rank 0's FSDP2 shard bytes (fp32): ``ceil(dim0 / ws)`` rows of every parameter."""
    return 4 * sum(-(-s[0] // ws) * math.prod(s[1:]) if s else 1 for u in units for _, s in u.params)


@pytest.mark.parametrize("model", ["llama:debug", "moe:debug"])
@pytest.mark.parametrize("ws", [2, 3, 4])
def test_estimate_next_to_torch_tracker(model, ws):
    fam, flavor = model.split(":")
    r = evt.compare(fam, flavor, ws)
    est, ours, tr = r["estimate"], r["measured"], r["tracker"]
    units = model_units(fam, flavor)
    n_params = sum(len(u.params) for u in units)
    assert est["SHARDED_PARAM"] == ours["SHARDED_PARAM"]
    # AdamW's moments are per-parameter (unpadded local pieces), plus a step scalar each; the estimate
    # counts the padded shard: within the rank's padding (< 1 %) and the scalars
    assert abs(ours["OPT"] - est["OPT"]) <= 8 * n_params + 0.01 * est["OPT"]
    fsdp2 = _fsdp2_rank0_bytes(units, ws)
    assert tr["SHARDED_PARAM"] == fsdp2
    assert 0 <= tr["OPT"] - 2 * fsdp2 <= 8 * n_params
    assert est["WORKING"] >= tr["UNSHARDED_PARAM"]
