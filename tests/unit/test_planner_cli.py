"""``raggedfsdp plan``: whole-model planning from shapes, JSON output re-validated from scratch."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from raggedfsdp.planner import plan_layout
from raggedfsdp.app.sizing.archs import model_units
from raggedfsdp.app.commands.plan import main as plan_main
from raggedfsdp.app.sizing.modelplan import fsdp1_padding, fsdp2_padding, plan_model


def _plan_json(capsys, *argv):
    assert plan_main(list(argv) + ["--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object
    return json.loads(out)


def _row_granularity(shape, rows=1):
    """Independent re-derivation: matrices get `rows` trailing-dim rows (`rows=0`: single elements, the
    default), vectors single elements."""
    return rows * shape[-1] if len(shape) >= 2 and rows else 1


def _revalidate(d, rows=1):
    """Check invariants (a)-(d) and the reported ratios from the JSON alone (interval arithmetic)."""
    m, align = d["world_size"], d["align"]
    total_e = total_pad = 0
    for u in d["units"]:
        S = u["shard_size"]
        assert S > 0 and S % align == 0, u["name"]  # (a), (d)
        spans = []
        for t in u["tensors"]:
            e = math.prod(t["shape"])
            g, x = t["granularity"], t["offset"]
            assert g == _row_granularity(t["shape"], rows), t["name"]
            assert e % g == 0
            assert 0 <= x and x + e <= m * S, t["name"]  # (c) in bounds
            if e:
                spans.append((x, x + e, t["name"]))
            k = x // S + 1  # (b) every boundary strictly inside cuts at a block edge
            while k * S < x + e:
                assert (k * S - x) % g == 0, (u["name"], t["name"], k)
                k += 1
            dims = t["dims"]
            assert dims == list(range(len(dims))) and len(dims) >= 1
            assert g % math.prod(t["shape"][len(dims) :]) == 0
        spans.sort()
        for (_, a1, n0), (b0, _, n1) in itertools.pairwise(spans):
            assert a1 <= b0, f"{n0} overlaps {n1}"  # (c) disjoint, each tensor one range
        e_unit = sum(math.prod(t["shape"]) for t in u["tensors"])
        assert u["padding"] == m * S - e_unit
        total_e += e_unit
        total_pad += m * S - e_unit
    assert d["num_params"] == total_e
    assert d["padding_ratio"] == pytest.approx(total_pad / (total_e + total_pad))


@pytest.mark.parametrize(
    "model, m, extra, rows",
    [
        ("llama3-8b", 64, [], 0),  # the default: element granularity, as fully_shard's
        ("llama3-70b", 1000, ["--granularity", "rows:32", "--order", "best"], 32),
        ("deepseek-v3-671b", 24, ["--granularity", "rows:32"], 32),
        ("gpt-oss-120b", 48, ["--order", "shape", "--granularity", "row"], 1),
        ("hybrid-27b", 96, ["--unit", "superblock", "--align", "16"], 0),
    ],
)
def test_json_output_revalidates(capsys, model, m, extra, rows):
    d = _plan_json(capsys, "--model", model, "--world-size", str(m), *extra)
    for key in ("padding_ratio", "fsdp2_padding_ratio", "fsdp1_padding_ratio", "plan_seconds", "units"):
        assert key in d
    assert d["world_size"] == m and d["model"] == model
    _revalidate(d, rows)
    assert d["padding_ratio"] >= d["bound_padding_ratio"] - 1e-12
    assert d["padding_ratio"] >= d["fsdp1_padding_ratio"] - 1e-12
    # issue 22: the default pads within 0.1 percentage point of FSDP2 (at most align * m per unit)
    if rows == 0:
        assert d["padding_ratio"] <= d["fsdp2_padding_ratio"] + 1e-3
        assert all(u["padding"] <= d["align"] * m for u in d["units"])


def test_units_and_baselines_match_direct_planning():
    units = model_units("llama3-8b")
    plan = plan_model(units, 48, policy="row", align=8)
    assert plan.distinct_units == 3 and len(plan.units) == 34
    for up, unit in zip(plan.units[:3], units[:3]):
        shapes = [s for _, s in unit.params]
        numels = [math.prod(s) for s in shapes]
        grans = [s[-1] if len(s) > 1 else 1 for s in shapes]
        direct = plan_layout(numels, grans, 48, align=8)
        assert up.layout.shard_size == direct.shard_size and up.layout.offsets == direct.offsets
        assert up.fsdp2_padding == sum((-(-s[0] // 48) * 48 - s[0]) * math.prod(s[1:]) for s in shapes)
        assert up.fsdp1_padding == fsdp1_padding(sum(numels), 48, 8)
    # identical layers share one plan but keep their own names
    assert plan.units[1].layout.offsets == plan.units[7].layout.offsets
    assert plan.units[7].layout.names[0] == "model.layers.6.self_attn.q_proj.weight"


def test_fsdp2_padding_formula():
    # (1000, 3), (7,), (513, 257) on 4 ranks: 772 padding elements (fsdp2-internals.md section 2.5)
    assert fsdp2_padding([(1000, 3), (7,), (513, 257)], 4) == 772


def test_builtin_tables():
    want = {
        "llama3-8b": 8.03e9,
        "llama3-70b": 70.55e9,
        "gpt-oss-120b": 116.83e9,
        "deepseek-v3-671b": 671.03e9,
        "hybrid-27b": 26.90e9,
        "moe-2.4t": 2402.1e9,
    }
    for name, n in want.items():
        units = model_units(name)
        assert sum(u.numel for u in units) == pytest.approx(n, rel=1e-3), name
    gpt = dict(model_units("gpt-oss-120b")[1].params)
    assert gpt["model.layers.0.mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert gpt["model.layers.0.mlp.experts.down_proj"] == (128, 2880, 2880)
    ds = model_units("deepseek-v3-671b")
    assert sum(".mlp.experts." in n for n, _ in ds[4].params) == 256 * 3
    assert dict(ds[4].params)["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    hyb = model_units("hybrid-27b", "superblock")
    assert len(hyb) == 18 and hyb[1].name == "layers.0-3"
    assert (
        sum(".linear_attn." in n for n, _ in hyb[1].params) > 0
        and sum(".self_attn." in n for n, _ in hyb[1].params) > 0
    )


def test_hf_config_path(tmp_path, capsys):
    cfg = {
        "model_type": "mixtral",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "num_local_experts": 4,
        "tie_word_embeddings": True,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    d = _plan_json(capsys, "--model", str(path), "-m", "8")
    assert [u["name"] for u in d["units"]] == ["embed", "layers.0", "layers.1", "head"]
    assert len(d["units"][1]["tensors"]) == 4 + 1 + 4 * 3 + 2
    assert [t["name"] for t in d["units"][-1]["tensors"]] == ["model.norm.weight"]  # tied head
    _revalidate(d, rows=0)


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--model", "gpt-oss-120b", "-m", "8", "--granularity", "rows:128"],
            r"o_proj.weight' shape=\(2880, 4096\)",
        ),
        (["--model", "llama3-8b", "-m", "0"], r"--world-size 0: the FSDP group size must be >= 1"),
        (["--model", "llama3-8b", "-m", "8", "--unit", "superblock"], r"needs a hybrid model"),
        (["--model", "no-such-model", "-m", "8"], r"unknown model 'no-such-model'"),
        (
            ["--model", "llama3-8b", "-m", "8", "--granularity", "rows:5"],
            r"embed_tokens.weight. shape=\(128256, 4096\) has 128256 rows .* 5 rows",
        ),
        (["--model", "llama3-8b", "-m", "8", "--granularity", "banana"], r"cannot parse 'banana'"),
    ],
)
def test_bad_input_exits_2(capsys, argv, match):
    assert plan_main(argv) == 2
    import re

    assert re.search(match, capsys.readouterr().err)


def _one_clean_error(capsys, argv) -> str:
    """`raggedfsdp plan ARGV` exits 2 with exactly one error line and no traceback; returns it."""
    from raggedfsdp.app.cli import main as top_main

    assert top_main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("raggedfsdp plan: error: "), captured.err
    return lines[0]


def test_model_folder_without_config_json(tmp_path, capsys):
    err = _one_clean_error(capsys, ["--model", str(tmp_path), "-m", "8"])
    assert f"--model: model {str(tmp_path)!r} is a folder without a config.json" in err
    assert "llama3-8b" in err and "path of a Hugging Face config.json" in err  # the fix


def test_model_folder_with_config_json_is_used(tmp_path, capsys):
    cfg = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = _plan_json(capsys, "--model", str(tmp_path), "-m", "8")
    assert [u["name"] for u in d["units"]] == ["embed", "layers.0", "layers.1", "head"]


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\xff\xfe{}", r"is not UTF-8 text \(byte 0xff at offset 0\)"),
        (b'{"model_type": ', r"is not valid JSON \(Expecting value"),
        (b"[1, 2]", r"must be a JSON object, got a list"),
        (
            b'{"hidden_size": "big", "vocab_size": 8, "num_hidden_layers": 1}',
            r"'hidden_size' must be an integer",
        ),
    ],
    ids=["non-utf8", "truncated", "list", "bad-value"],
)
def test_bad_config_file_names_the_file(tmp_path, capsys, content, match):
    import re

    path = tmp_path / "weird.json"
    path.write_bytes(content)
    err = _one_clean_error(capsys, ["--model", str(path), "-m", "8"])
    assert "--model" in err and str(path) in err and re.search(match, err), err


@pytest.mark.parametrize("granularity", ["rows:3", "tile:7x7"])
def test_indivisible_block_suggests_gcd_fallback(capsys, granularity):
    err = _one_clean_error(capsys, ["--model", "gpt-oss-120b", "-m", "8", "--granularity", granularity])
    assert f"--granularity {granularity}: unit 'embed'" in err and "not a multiple" in err
    assert "--on-indivisible gcd" in err
    # ... and the suggested fix works
    assert (
        plan_main(
            ["--model", "gpt-oss-120b", "-m", "8", "--granularity", granularity, "--on-indivisible", "gcd"]
        )
        == 0
    )


def test_gcd_fallback_for_sweeps(capsys):
    d = _plan_json(
        capsys, "--model", "gpt-oss-120b", "-m", "64", "--granularity", "rows:128", "--on-indivisible", "gcd"
    )
    o_proj = next(t for t in d["units"][1]["tensors"] if t["name"].endswith("o_proj.weight"))
    assert o_proj["granularity"] == 64 * 4096  # gcd(128, 2880) = 64 rows


def test_text_report_and_toplevel_cli(capsys):
    from raggedfsdp.app.cli import main as top_main

    assert top_main(["plan", "--model", "llama3-8b", "--world-size", "128", "--granularity", "rows:32"]) == 0
    out = capsys.readouterr().out
    assert "layers.0 .. layers.31 (x32)" in out and "total padding" in out and "FSDP2" in out


def test_moe_2_4t_plans_each_distinct_unit_once(monkeypatch):
    """Whole-model planning of the 2.4T MoE at M=1024 costs one plan_layout per *distinct* unit, not
    per unit (the speed itself is a benchmark: benchmarks/README.md planner table 8, not a timed test)."""
    import raggedfsdp.app.sizing.modelplan as mp

    calls = []
    real = mp.plan_layout
    monkeypatch.setattr(mp, "plan_layout", lambda *a, **k: calls.append(1) or real(*a, **k))
    units = model_units("moe-2.4t")
    plan = plan_model(units, 1024, policy="row", align=8)
    distinct = {tuple(s for _, s in u.params) for u in units}
    assert len(calls) == len(distinct) < len(units)
    assert len(plan.units) == len(units)


def test_text_report_groups_repeating_patterns_and_aligns_columns(capsys):
    """Issue 24 rough edge 9: hybrid-27b's 64 layers (3 linear-attention + 1 attention, 16 times) are one
    group of two rows, not 32 rows; every table row has the header's width (long names widen the
    column). The reference: the ``--json`` plan of the same command, unit by unit."""
    import json as _json

    from raggedfsdp.app.cli import main as cli

    argv = ["plan", "--model", "hybrid-27b", "--world-size", "64"]
    assert cli(argv) == 0
    text = capsys.readouterr().out.splitlines()
    assert cli([*argv, "--json"]) == 0
    units = _json.loads(capsys.readouterr().out)["units"]
    header = next(i for i, ln in enumerate(text) if ln.startswith("unit "))
    end = next(i for i, ln in enumerate(text) if ln.startswith("total padding"))
    table = text[header + 1 : end]
    rows = [ln for ln in table if "rows below" not in ln]
    assert len(rows) == 4, table  # embed, the 2 rows of the pattern, head
    assert "layers.0 .. layers.63: 16 x the 2 rows below" in table
    assert all(len(ln) == len(text[header]) for ln in rows), table
    assert len(units) == 66 and sum(u["name"].startswith("layers.") for u in units) == 64
