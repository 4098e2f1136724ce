"""Imports inside the package go one way: placement -> planner -> buffer -> fsdp -> optim -> models ->
checkpoint -> train/launch -> bench -> commands/cli. A module may import its own layer or lower layers
only (checked with ast)."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "raggedfsdp"
LAYER = {
    "placement": 0, "_torch_patches": 0,
    "planner": 1,
    "buffer": 2,
    "fsdp": 3,
    "optim": 4,
    "models": 5,
    "checkpoint": 6,
    "train": 7, "launch": 7,
    "sizing": 8, "bench": 8,
    "commands": 9, "cli": 9,
}


def _layer_of(parts: list[str]) -> int | None:
    return LAYER.get(parts[0].removesuffix(".py")) if parts else None


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_imports_go_one_way():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).parts
        if rel == ("__init__.py",):
            continue  # the package root re-exports the public API
        own = _layer_of(list(rel))
        assert own is not None, f"{path}: module not assigned to a layer in tests/unit/test_layering.py"
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] != "raggedfsdp" or len(parts) == 1:
                continue
            dep = _layer_of(parts[1:])
            if dep is not None and dep > own:
                bad.append(f"{path.relative_to(PKG.parent)} (layer {own}) imports {mod} (layer {dep})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_files_stay_small():
    big = [(p, n) for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 700]
    assert not big, f"files over 700 lines (split them): {big}"
