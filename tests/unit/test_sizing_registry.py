"""``sizing/registry.resolve``: one resolver behind ``plan`` and ``estimate-memory`` (issue 18), and the
one unit vocabulary ``layer | superblock | layers:K`` of ``models/parallelize.py``.

References: the tables' own ``sizing.archs.model_units`` and the trainable models' ``fsdp_unit_modules``
(the units ``apply_fsdp`` makes), called directly, not through the resolver.
"""

from __future__ import annotations

import json

import pytest

from raggedfsdp.app.cli import main as cli_main
from raggedfsdp.app.sizing.archs import load_config
from raggedfsdp.app.sizing.archs import model_units as table_units
from raggedfsdp.app.sizing.memory_estimate import estimate_memory
from raggedfsdp.app.sizing.registry import resolve


def test_readme_estimate_memory_command_runs(capsys):
    """The README / --help example that failed before the resolver (hybrid-27b read as hybrid:27b)."""
    rc = cli_main(["estimate-memory", "--model", "hybrid-27b", "--world-size", "64,256", "--recipe", "muon",
                   "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    got = json.loads(out)
    units = table_units(load_config("hybrid-27b"))
    for ws, r in zip((64, 256), got):
        want = estimate_memory(units=units, world_size=ws, recipe="muon").to_dict()
        assert r == dict(want, model="hybrid-27b")
    # plan accepts the same name (it did before; both now go through one resolver)
    assert cli_main(["plan", "--model", "hybrid-27b", "--world-size", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "hybrid-27b"


def test_resolve_every_kind(tmp_path):
    from raggedfsdp.app.models import build_model, fsdp_unit_modules

    assert resolve("hybrid-27b").config == load_config("hybrid-27b")  # a preset with a table
    assert resolve("llama3-70b").config == load_config("llama3-70b")  # a table, no preset
    for name in ("hybrid:debug", "hybrid-debug"):
        s = resolve(name)
        assert (s.label, s.family, s.flavor, s.config) == ("hybrid:debug", "hybrid", "debug", None)
    s = resolve("llama-tiny")  # a preset that trains llama:tiny
    assert (s.label, s.family, s.flavor) == ("llama-tiny", "llama", "tiny")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_config("llama3-8b")))
    assert resolve(str(tmp_path)).units() == table_units(load_config("llama3-8b"))
    with pytest.raises(ValueError, match=r"unknown model 'nope'.*or a built-in model \(.*llama:FLAVOR"):
        resolve("nope")
    # a trainable model's units are the ones apply_fsdp makes, for each word of the vocabulary
    model = build_model("hybrid", "debug")
    for unit in ("layer", "superblock", "layers:3"):
        names = [u.name for u in resolve("hybrid:debug").units(unit)]
        assert names == [n for n, _ in fsdp_unit_modules(model, unit)], unit


def test_one_unit_vocabulary():
    from raggedfsdp.app.bench.registry import get_bench_model
    from raggedfsdp.app.models import build_model, fsdp_unit_modules
    from raggedfsdp.app.models.parallelize import parse_unit
    from raggedfsdp.app.sizing.archs import layers_per_unit

    assert [parse_unit(u) for u in ("layer", "superblock", "layers:1", "layers:4")] == [1, None, 1, 4]
    for bad in ("block", "layers:0", "layers:x", "layers:"):
        with pytest.raises(ValueError, match=rf"unknown FSDP unit '{bad}'.*layer \| superblock \| layers:K"):
            parse_unit(bad)
        with pytest.raises(ValueError, match="unknown FSDP unit"):
            layers_per_unit(load_config("llama3-8b"), bad)
    m = build_model("llama", "debug")
    n = len(m.layers)
    got = [n_ for n_, _ in fsdp_unit_modules(m, "layers:2")]
    assert got == [f"layers.{s}-{min(s + 2, n) - 1}" for s in range(0, n, 2)] + ["root"]
    cfg = load_config("llama3-8b")
    assert len(table_units(cfg, "layers:4")) == 32 // 4 + 2 and layers_per_unit(cfg, "layers:4") == 4
    assert list(get_bench_model("dense").wraps) == ["layer", "layers:2", "layers:4"]
