"""Two layers, one way: the library (``raggedfsdp/``: placement -> planner -> buffer -> fsdp -> optim,
plus ``_compat``, ``_release``, ``teardown``) needs torch alone and never imports the application
(``raggedfsdp/app/``: models -> checkpoint -> train/launch -> sizing/bench -> commands/cli), which
uses the library through its public names only. Inside each layer the rooms of docs/architecture.md
import their own room or lower rooms only (checked with ast, function-level imports included), and no
two files import each other in a circle at module level.

``checkpoint`` sits above ``models`` (not beside ``optim``): ``checkpoint/hf.py`` maps the LLaMA
model's names and config to Hugging Face's, and nothing below ``train`` saves checkpoints."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parents[2] / "raggedfsdp"
APP = PKG / "app"
LIBRARY_LAYER = {
    "placement": 0,
    "_compat": 0,
    "_release": 0,
    "teardown": 0,
    "planner": 1,
    "buffer": 2,
    "fsdp": 3,
    "optim": 4,
}
APP_LAYER = {
    "models": 5,
    "checkpoint": 6,
    "train": 7,
    "launch": 7,
    "sizing": 8,
    "bench": 8,
    "commands": 9,
    "cli": 9,
}
# what the library may import besides the standard library and itself
LIBRARY_THIRD_PARTY = {"torch"}


def _room(parts: list[str]) -> tuple[str, int] | None:
    """("library" | "app", layer) of a module given as its parts below ``raggedfsdp``."""
    if not parts:
        return None
    if parts[0] == "app":
        layer = APP_LAYER.get(parts[1].removesuffix(".py")) if len(parts) > 1 else None
        return ("app", layer) if layer is not None else None
    layer = LIBRARY_LAYER.get(parts[0].removesuffix(".py"))
    return ("library", layer) if layer is not None else None


def _imports(path: pathlib.Path):
    """(module, names, lineno) of every absolute import in ``path``, function-level included."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names], node.lineno


def _package_files():
    for path in sorted(PKG.rglob("*.py")):
        rel = list(path.relative_to(PKG).parts)
        if rel in (["__init__.py"], ["app", "__init__.py"]):
            continue  # the package roots re-export / describe; checked below on their own
        yield path, rel


def test_every_module_has_a_room():
    loose = [str(p.relative_to(PKG.parent)) for p, rel in _package_files() if _room(rel) is None]
    assert not loose, f"modules not assigned to a room in tests/unit/test_layering.py: {loose}"


def test_imports_go_one_way():
    bad = []
    for path, rel in _package_files():
        own = _room(rel)
        for mod, _, line in _imports(path):
            parts = mod.split(".")
            if parts[0] != "raggedfsdp" or len(parts) == 1:
                continue
            dep = _room(parts[1:])
            if dep is None:
                continue
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if own[0] == "library" and dep[0] == "app":
                bad.append(f"{where}: the library imports the application ({mod})")
            elif own[0] == dep[0] and dep[1] > own[1]:
                bad.append(f"{where} (layer {own[1]}) imports {mod} (layer {dep[1]})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_library_needs_torch_alone():
    """No numpy, no transformers: ``import raggedfsdp`` and ``fully_shard`` run where only torch is."""
    bad = []
    for path, rel in _package_files():
        if _room(rel)[0] != "library":
            continue
        for mod, _, line in _imports(path):
            top = mod.split(".")[0]
            if top not in sys.stdlib_module_names and top not in LIBRARY_THIRD_PARTY | {"raggedfsdp"}:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {mod}")
    assert not bad, "the library imports more than torch:\n" + "\n".join(bad)


def test_application_uses_public_library_names_only():
    """The application imports ``raggedfsdp.<room>`` names that do not start with ``_``, from modules
    whose path has no ``_`` segment: a private name it needs gets a public home in the library."""
    bad = []
    for path, rel in _package_files():
        if _room(rel)[0] != "app":
            continue
        for mod, names, line in _imports(path):
            parts = mod.split(".")
            if parts[0] != "raggedfsdp" or (len(parts) > 1 and parts[1] == "app"):
                continue
            private = [p for p in parts[1:] if p.startswith("_")] + [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} from {mod} import {names}")
    assert not bad, "the application uses private library names:\n" + "\n".join(bad)


def test_library_imports_and_trains_without_the_application():
    """``tests/library_only.py`` (what CI runs in a venv holding only torch) in processes where
    ``raggedfsdp.app`` cannot be imported: fully_shard trains as a plain model does."""
    script = pathlib.Path(__file__).resolve().parents[1] / "library_only.py"
    r = subprocess.run(
        [sys.executable, str(script), "--block-imports"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "library only: ok" in r.stdout, r.stdout


def _module_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_deps(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports at module level (not inside functions or TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module in modules:
                    out.add(node.module)
                out.update(
                    f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules
                )
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)

    visit(tree.body)
    return out


def test_no_import_circles_between_files():
    files = {_module_of(p): p for p in PKG.rglob("*.py")}
    deps = {m: _module_level_deps(p, set(files)) - {m} for m, p in files.items()}
    # a package's __init__ re-exporting its own submodules is not a circle between files
    for m in deps:
        deps[m] = {d for d in deps[m] if not (m == d.rsplit(".", 1)[0] or d == m.rsplit(".", 1)[0])}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def dfs(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(deps[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d] if d in stack else [m, d])
            elif d not in state:
                dfs(d, stack + [d])
        state[m] = 2

    for m in sorted(deps):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "module-level import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _all_level_deps(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere it runs: module and function level, not under
    ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
    return out


def _strongly_connected(deps: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in deps[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return out


# The one circle left, counting function-level imports too (annotation-only imports under
# TYPE_CHECKING are not run): the placement pillar's install knot, by design (the first RaggedShard
# installs the patches, which name RaggedShard).
ALLOWED_CIRCLES = [
    {"placement._foreach", "placement._ops", "placement._patches", "placement._random"}
    | {"placement._redistribute", "placement.ragged_shard", "placement._implicit", "placement._reductions"},
]


def test_import_circles_counting_function_level_imports():
    files = {_module_of(p): p for p in PKG.rglob("*.py")}
    deps = {m: _all_level_deps(p, set(files)) - {m} for m, p in files.items()}
    for m in deps:
        deps[m] = {d for d in deps[m] if not (m == d.rsplit(".", 1)[0] or d == m.rsplit(".", 1)[0])}
    found = [{m.removeprefix("raggedfsdp.") for m in c} for c in _strongly_connected(deps)]
    extra = [sorted(c) for c in found if not any(c <= allowed for allowed in ALLOWED_CIRCLES)]
    assert not extra, f"new import circles (function-level imports included): {extra}"
    assert len(found) <= 1, found


def test_files_stay_small():
    big = [(p, n) for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 700]
    assert not big, f"files over 700 lines (split them): {big}"


def test_tests_do_not_import_the_tests_folder_as_a_package():
    """``tests/`` is not a package: conftest.py puts it on ``sys.path``, so helpers are imported as
    ``from _memory import ...``. ``from tests._memory import ...`` only works when the repository root
    is on ``PYTHONPATH`` and failed CI's collection once (a clean clone runs plain ``pytest``)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            bad += [f"{where} {n}" for n in names if n.split(".")[0] == "tests"]
    assert not bad, f"import the helper by its module name (conftest puts tests/ on sys.path): {bad}"


def test_code_does_not_read_files_of_this_machine():
    """No test or library module names a path of the project's own machine (``/work/...``: the shared
    data, the venv, other checkouts). test_tokens read ``/work/shared/data/tinyshakespeare.txt``: it
    passed here and failed with FileNotFoundError on any other machine. Build inputs in ``tmp_path``."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    bad = []
    for folder in ("raggedfsdp", "tests"):
        for path in sorted((repo / folder).rglob("*.py")):
            if path == pathlib.Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "/work/" in node.value:
                    if node.value.lstrip().startswith(("/work/", "file:///work/")):
                        bad.append(f"{path.relative_to(repo)}:{node.lineno} {node.value[:60]!r}")
    for path in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:  # commands a user copies
        bad += [
            f"{path.relative_to(repo)}:{i}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if "/work/" in line
        ]
    assert not bad, f"paths that exist only on the project's machine: {bad}"


def test_code_comments_carry_no_history():
    """Issue numbers, session numbers and dates belong in git and benchmarks/README.md, not in the
    code: a comment or docstring that cites one goes stale the day it lands (an outside project's
    bug, "pytorch issue #N", is a source and allowed)."""
    import re

    pat = re.compile(r"(?<!pytorch )\bissue #?\d+|\bsession \d+\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)
    bad = [
        f"{path.relative_to(PKG.parent)}:{i}: {line.strip()[:90]}"
        for path in sorted(PKG.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pat.search(line)
    ]
    assert not bad, "history in the code (move it to the commit message):\n" + "\n".join(bad)
