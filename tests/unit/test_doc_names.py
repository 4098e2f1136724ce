"""Maps that tell today's story: every file, module, class and function that the README or docs/ name
in backticks exists in the tree.

Checked forms (in backticks, anywhere in the text):
- ``path/to/file.py`` (relative to the repository, ``raggedfsdp/``, ``raggedfsdp/app/``, ``tests/``
  or ``benchmarks/``, as the docs write room-relative paths; a path whose first folder is none of
  theirs is another project's and skipped), optionally ``:Name`` or ``:Name.attr``
  after it: the file exists and defines ``Name`` (and ``attr`` inside it);
- ``raggedfsdp.module.Name`` dotted paths: the module (or package) exists and defines ``Name``.
Names are resolved with ``ast`` (defined at any level of the file: class, function, assignment,
import), so nothing is imported. A doc that names a class that was renamed fails here.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOTS = [REPO, REPO / "raggedfsdp", REPO / "raggedfsdp" / "app", REPO / "tests", REPO / "benchmarks"]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_CODE = re.compile(r"`([^`\n]+)`")
_FILE = re.compile(r"^([\w./-]+\.py)(?::([A-Za-z_][\w.]*))?")
_DOTTED = re.compile(r"^(raggedfsdp(?:\.[A-Za-z_]\w*)+)")


@functools.cache
def _defined(path: pathlib.Path) -> frozenset[str]:
    """Every name bound anywhere in ``path`` (defs, classes, assignments, imports, attributes set on
    ``self``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Dict):  # the package root's lazy public names (PEP 562 table)
            names.update(
                k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
            )
    return frozenset(names)


def _find_file(rel: str) -> pathlib.Path | None:
    for root in ROOTS:
        if (root / rel).is_file():
            return root / rel
    return None


def _module_file(dotted: str) -> tuple[pathlib.Path | None, list[str]]:
    """The longest prefix of ``dotted`` that is a module or package, and the names after it."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:k])
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand, parts[k:]
    return None, parts


def _problems(doc: pathlib.Path) -> list[str]:
    bad = []
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        for code in _CODE.findall(line):
            code = code.strip()
            where = f"{doc.name}:{lineno} `{code}`"
            first = code.split("/", 1)[0]
            if "/" in code and not any((root / first).is_dir() for root in ROOTS):
                continue  # another project's file (torch/..., torchtitan/...): not this tree
            if m := _FILE.match(code):
                if "/" not in m.group(1) and not m.group(2):
                    continue  # a bare file name (`worker.py`) is prose about its room, not a path
                path = _find_file(m.group(1))
                if path is None:
                    bad.append(f"{where}: no such file")
                elif m.group(2):
                    missing = [n for n in m.group(2).split(".") if n not in _defined(path)]
                    if missing:
                        bad.append(f"{where}: {path.relative_to(REPO)} defines no {missing}")
            elif m := _DOTTED.match(code):
                path, rest = _module_file(m.group(1))
                if path is None:
                    bad.append(f"{where}: no such module")
                elif rest and rest[0] not in _defined(path):
                    sub = path.parent / rest[0]
                    if not (sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()):
                        bad.append(f"{where}: {path.relative_to(REPO)} defines no {rest[0]!r}")
    return bad


def test_docs_name_only_what_exists():
    bad = [p for doc in DOCS for p in _problems(doc)]
    assert not bad, "the docs name what the tree does not have:\n" + "\n".join(bad)


def test_the_check_finds_a_stale_name(tmp_path):
    """The checker itself: a renamed class, a moved file and a missing module name are caught; real
    names pass."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "`fsdp/_grads.py:NoSuchClass.post_backward` and `raggedfsdp/nowhere.py` and "
        "`raggedfsdp.fsdp.NoSuchName` but `raggedfsdp/fsdp/_fully_shard.py:fully_shard` and "
        "`raggedfsdp.placement.RaggedShard` and `app/train/trainer.py`\n"
    )
    found = _problems(doc)
    assert len(found) == 3, found
