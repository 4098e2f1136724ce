"""tests/gpu: CUDA + NCCL checks of the FSDP runtime (issue 8 item 5). Skipped without CUDA.

Every test spawns one process per visible GPU (``torch.cuda.set_device(rank)``, NCCL), so the
world size is ``torch.cuda.device_count()`` (1 works; the overlap check needs >= 2). Run them from
the source tree with ``PYTHONPATH=. python -m pytest tests/gpu`` or through ``benchmarks/gpu/run.sh``.
Set ``RAGGEDFSDP_GPU_RESULTS=<dir>`` to have each test write its measurements there as JSON.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu run on a GPU machine; see benchmarks/gpu/run.sh)")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
