"""The per-step loops of the gradient path over a unit's params, named, each beside its plain-Python
reference.

Per step the gradient path visits every parameter of a unit (an MoE layer holds hundreds). These
helpers run that visit as C-level ``map`` / ``operator`` / ``itertools`` chains: no Python frame or
bytecode per parameter. Each ``name`` has a ``name_reference`` in plain Python that says what it
computes; ``tests/unit/test_fsdp_loops.py`` checks on random inputs that both return the same.
Identity, never ``==``, compares params and tensors (``FSDPParam.__eq__`` and ``Tensor.__eq__``
compare values; on a DTensor each is a dispatch). Local, no tensor op.
"""

from __future__ import annotations

import itertools
import operator

_NONE = itertools.repeat(None)


def same_objects(a: list, b: list) -> bool:
    """``a`` and ``b`` hold the same objects in the same order (by identity)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def same_objects_reference(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def pairs_to_fold(fps: list, grads: list, views: list | None = None) -> list[tuple]:
    """``(fp, grad)`` for each ``fp`` whose ``grad`` is not ``None`` and, with ``views`` given, is not
    ``fp``'s pre-set view of the flat grad buffer (a gradient autograd kept as its own tensor: the
    fold copies it in). In unit order."""
    keep = map(operator.is_not, grads, _NONE)
    if views is not None:
        keep = map(operator.and_, keep, map(operator.is_not, grads, views))
    keep = list(keep)
    return list(zip(itertools.compress(fps, keep), itertools.compress(grads, keep)))


def pairs_to_fold_reference(fps: list, grads: list, views: list | None = None) -> list[tuple]:
    out = []
    for i, (fp, g) in enumerate(zip(fps, grads)):
        if g is not None and (views is None or g is not views[i]):
            out.append((fp, g))
    return out


def to_attach(fps: list, used: list, held: list) -> list:
    """The params of ``fps`` that some rank used (``used[i]``) or that already hold a sharded ``.grad``
    (``held[i]`` not ``None``): those whose ``.grad`` the end of backward sets. In order."""
    return list(itertools.compress(fps, map(operator.or_, used, map(operator.is_not, held, _NONE))))


def to_attach_reference(fps: list, used: list, held: list) -> list:
    return [fp for fp, u, h in zip(fps, used, held) if u or h is not None]


def unique_by_id(groups: list) -> list:
    """The objects of the lists in ``groups``, each once (by identity), in order of first appearance."""
    flat = list(itertools.chain.from_iterable(groups))
    return list(dict(zip(map(id, flat), flat)).values())  # a key keeps its first position


def unique_by_id_reference(groups: list) -> list:
    seen, out = set(), []
    for g in groups:
        for x in g:
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
    return out


def or_into(acc: dict, keys: list, flags) -> None:
    """``acc[k] = acc.get(k, False) or bool(f)`` for each key ``k`` and flag ``f`` (keys distinct)."""
    acc.update(zip(keys, map(operator.or_, map(acc.get, keys, itertools.repeat(False)), map(bool, flags))))


def or_into_reference(acc: dict, keys: list, flags) -> None:
    for k, f in zip(keys, flags):
        acc[k] = acc.get(k, False) or bool(f)
