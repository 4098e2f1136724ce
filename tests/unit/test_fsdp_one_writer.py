"""One writer per runtime state (docs: Note [FSDP tensors] in ``raggedfsdp/fsdp/_common.py``).

Parses every module of ``raggedfsdp/fsdp`` and checks that each state field of an FSDP unit is
assigned (``x.f = ...``, ``x.f += ...``, tuple targets, ``setattr(x, "f", ...)``,
``assign_each(xs, "f", ...)``) only inside the
methods of the one class that owns it: :class:`FSDPParamGroup` (the ``ParamState`` machine and its
gather fields), :class:`UnitGrads` (the ``GradState`` machine and the gradient fields) and
:class:`FSDPState` (its ``TrainingState``). The reduce records of ``_reduce.py`` must go through the
owners' transition methods."""

from __future__ import annotations

import ast
import pathlib

import raggedfsdp.fsdp

OWNERS = {
    "FSDPParamGroup": {
        "param_state",
        "_unshard",
        "_version_guard",
        "_gathered_version",
        "post_forward_buf",
        "_post_forward_version",
        "post_forward_k",
        "post_forward_group",
        "post_forward_rank",
    },
    "UnitGrads": {"grad_state", "sg_pending", "partial_reduce", "partial_flags", "grad_fps", "got_grad"},
    "FSDPState": {"training_state", "_final_callback_queued"},
}
FIELD_OWNER = {f: cls for cls, fields in OWNERS.items() for f in fields}
# the names the fields had when three files wrote them: none may come back
RETIRED = {"_sg_pending", "_partial_reduce", "_partial_flags", "_pre_backward_done", "_post_backward_done"}


def _writes(tree: ast.AST):
    """(class name or None, field, line) for every attribute assignment in ``tree``."""
    out = []

    def targets(node):
        if isinstance(node, (ast.Tuple, ast.List)):
            for e in node.elts:
                yield from targets(e)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)
        elif isinstance(node, ast.Attribute):
            yield node.attr

    def visit(node, cls):
        if isinstance(node, ast.ClassDef):
            cls = node.name
        if isinstance(node, ast.Assign):
            for t in node.targets:
                out.extend((cls, f, node.lineno) for f in targets(t))
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            out.extend((cls, f, node.lineno) for f in targets(node.target))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "assign_each")  # assign_each(objs, "f", values): C-level setattr
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            out.append((cls, str(node.args[1].value), node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(tree, None)
    return out


def _package_writes():
    root = pathlib.Path(raggedfsdp.fsdp.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) >= 8, f"found only {files} under {root}"
    return [
        (f.name, cls, field, line) for f in files for cls, field, line in _writes(ast.parse(f.read_text()))
    ]


def test_each_unit_state_has_one_writer_class():
    writes = _package_writes()
    bad = [
        f"{name}:{line} {cls}.{field} (owner: {FIELD_OWNER[field]})"
        for name, cls, field, line in writes
        if field in FIELD_OWNER and cls != FIELD_OWNER[field]
    ]
    assert not bad, "unit state written outside its owner class:\n" + "\n".join(bad)
    seen = {field for _, _, field, _ in writes}
    assert set(FIELD_OWNER) <= seen, f"owned fields never written (renamed?): {set(FIELD_OWNER) - seen}"
    retired = [f"{name}:{line} {field}" for name, _, field, line in writes if field in RETIRED]
    assert not retired, f"retired state fields are back: {retired}"


def test_checker_sees_a_write_from_another_class():
    """The checker itself: a transition written outside the owner (as ``_reduce.py`` once did) is found."""
    src = (
        "class PendingReduce:\n    def done(self, g):\n        g.grads.grad_state, g.grads.sg_pending = "
        "1, 2\n"
    )
    found = [(cls, f) for cls, f, _ in _writes(ast.parse(src)) if f in FIELD_OWNER]
    assert found == [("PendingReduce", "grad_state"), ("PendingReduce", "sg_pending")]
