"""``--unit auto`` / ``choose_unit_size``: the smallest K (layers per unit) within the padding target.

Every claim is re-checked with plain :func:`plan_model` on ``model_units(model, "layers:K")``, not
with the search's own bookkeeping: the chosen K meets the target, every smaller K misses it, and
where no K meets it the reported best is the minimum over all K and the bound is below every plan.
The cells are the ones quoted in ``benchmarks/README.md`` (Planner, unit auto).
"""

from __future__ import annotations

import json

import pytest

from raggedfsdp.app.sizing.archs import model_units
from raggedfsdp.app.sizing.autounit import choose_unit_size
from raggedfsdp.app.commands.plan import main as plan_main
from raggedfsdp.app.sizing.modelplan import gcd_fallback, plan_model

TARGET = 0.03


def _padding(model, m, k, gran="row", order="best", per=1):
    units = model_units(model, f"layers:{k * per}")
    return plan_model(units, m, policy=gcd_fallback(gran), align=8, order=order).padding_ratio


@pytest.mark.parametrize(
    ("model", "gran", "m", "k", "pad"),
    [
        ("llama3-70b", "row", 10240, 2, 0.02879),  # K=1: 26.6% (bound); README table "unit auto"
        ("llama3-70b", "rows:32", 512, 12, 0.01561),  # K=1: 8.74%
        ("deepseek-v3-671b", "row", 4096, 3, 0.02496),  # K=1: 10.6%, K=2: 4.45%
        ("deepseek-v3-671b", "rows:32", 256, 2, 0.01644),  # K=1: 3.69%
    ],
)
def test_auto_reaches_target_with_minimal_k(model, gran, m, k, pad):
    c = choose_unit_size(model, m, policy=gcd_fallback(gran), target=TARGET, align=8, order="best")
    assert c.met and c.k == k and c.unit == f"layers:{k}" and c.base == "layer"
    assert c.padding_ratio == pytest.approx(pad, abs=1e-5)
    # independent re-plan of the chosen K, and every smaller K misses the target
    assert _padding(model, m, k, gran) == c.padding_ratio <= TARGET
    for j in range(1, k):
        assert _padding(model, m, j, gran) > TARGET, j
    # the plan reported is a plain plan of those units
    assert len(c.plan.units) == len(model_units(model, c.unit))
    assert c.plan.fsdp2_padding_ratio == plan_model(model_units(model), m, align=8).fsdp2_padding_ratio


def test_auto_unreachable_reports_best_k_and_bound():
    """llama3-70b, 32-row blocks, M = 10,240: no K reaches 3%; best over all 80 K, bound proves it."""
    m, gran = 10240, "rows:32"
    c = choose_unit_size("llama3-70b", m, policy=gcd_fallback(gran), target=TARGET, align=8, order="best")
    assert not c.met and c.max_k == 80
    pads = {k: _padding("llama3-70b", m, k, gran) for k in range(1, 81)}
    best = min(pads.values())
    assert c.padding_ratio == best and c.k == min(k for k, p in pads.items() if p == best)
    assert c.min_bound_ratio > TARGET  # the proof: no K (and no order) can reach 3%
    for t in c.tries:
        assert t.bound_ratio <= pads[t.k] + 1e-12  # the bound is a bound
    assert c.min_bound_ratio == pytest.approx(min(pads.values()))  # and tight here
    assert "no K in 1..80" in c.summary() and "so no K can reach 3%" in c.summary()


def test_auto_superblocks_and_max_k():
    """Hybrids step in super-blocks of full_attention_interval layers; max_k caps the search."""
    c = choose_unit_size("hybrid-27b", 512, policy="row", target=TARGET, align=8, order="best")
    assert c.base == "superblock" and c.met
    assert c.layers_per_unit == 4 * c.k and c.unit == f"layers:{4 * c.k}"
    assert _padding("hybrid-27b", 512, c.k, per=4) == c.padding_ratio <= TARGET
    assert _padding("hybrid-27b", 512, c.k - 1, per=4) > TARGET
    capped = choose_unit_size("llama3-70b", 10240, policy="row", target=TARGET, align=8, max_k=1)
    assert not capped.met and capped.k == 1 and capped.max_k == 1
    with pytest.raises(ValueError, match="max_k"):
        choose_unit_size("llama3-70b", 8, max_k=0)
    with pytest.raises(ValueError, match="target"):
        choose_unit_size("llama3-70b", 8, target=-0.1)


def test_cli_unit_auto(capsys):
    assert (
        plan_main(
            ["--model", "llama3-70b", "-m", "10240", "--unit", "auto", "--order", "best"]
            + ["--granularity", "row", "--json"]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["unit"] == "layers:2" and d["num_units"] == 42
    ch = d["unit_choice"]
    assert ch["k"] == 2 and ch["met"] and ch["target"] == TARGET
    assert d["padding_ratio"] == ch["padding_ratio"] <= TARGET
    assert ch["tries"][0][0] == 1 and ch["tries"][0][1] > TARGET  # K=1 ruled out by its bound

    assert (
        plan_main(["--model", "llama3-70b", "-m", "10240", "--unit", "auto", "--granularity", "rows:32"]) == 0
    )
    out = capsys.readouterr().out
    assert "unit auto (layers:" in out and "no K in 1..80 layers per unit reaches padding <= 3%" in out

    assert plan_main(["--model", "llama3-70b", "-m", "8", "--unit", "auto", "--padding-target", "-1"]) == 2
    assert "--padding-target" in capsys.readouterr().err
    assert plan_main(["--model", "llama3-70b", "-m", "8", "--unit", "auto", "--max-k", "0"]) == 2
    assert "--max-k" in capsys.readouterr().err


def test_auto_moe_2_4t_search_plans_only_what_the_bounds_allow():
    """moe-2.4t at M=1024: the auto search computes a bound for every K but runs the planner only for
    K whose bound is within the target (or needed for the best), so its cost is a few whole-model
    plans (its speed, 0.12-0.16 s on 2 CPU cores, is a benchmark: README planner table 8)."""
    choice = choose_unit_size("moe-2.4t", 1024, policy="rows:32", align=8, order="best")
    planned = [t.k for t in choice.tries if t.padding_ratio is not None]
    assert len(choice.tries) == choice.max_k  # every K bounded
    assert choice.k in planned and len(planned) <= 3, planned
    for t in choice.tries:  # a K skipped by the search is one its bound rules out
        if t.padding_ratio is None:
            assert t.bound_ratio > choice.target or t.k > choice.k, t
