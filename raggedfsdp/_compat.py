"""Version facts of the installed torch (no torch internals touched here; the patches of torch's
internals live in one module, ``raggedfsdp/placement/_patches.py``)."""

from __future__ import annotations


def torch_minor(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed ``torch.__version__``)."""
    if version is None:
        import torch

        version = torch.__version__
    v = version.split("+")[0].split(".")
    return int(v[0]), int(v[1])
