"""``TORCH_LOGS=fsdp`` debug lines (torch's test_fully_shard_logging.py, issue 39 item 8): raggedfsdp logs
on torch's FSDP2 logger (``torch.distributed.fsdp.fully_shard``) the same labels at the same points as
torch's ``fully_shard`` -- ``FSDP::root_pre_forward``, ``FSDP::pre_forward (<fqn>)``,
``FSDP::post_forward (<fqn>)``, ``FSDP::pre_backward (<fqn>)``, ``FSDP::post_backward (<fqn>)``,
``FSDP::root_post_backward`` (no FQN for the root unit). One forward + backward of the same model on
each implementation at ws 2 and the set of lines compared, with and without a root unit's own params.
"""

from __future__ import annotations

import logging

import torch
from _dist import run_distributed
from torch import nn


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _lines(fs, root_params: bool) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(3 if root_params else 2)])
    for layer in model[:2]:
        fs(layer)
    fs(model)
    log = logging.getLogger("torch.distributed.fsdp.fully_shard")
    cap, level = _Capture(), log.level
    log.addHandler(cap)
    log.setLevel(logging.DEBUG)
    try:
        model(torch.randn(4, 4)).sum().backward()
    finally:
        log.removeHandler(cap)
        log.setLevel(level)
    return cap.lines


def _case(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_fs

    import raggedfsdp

    for root_params in (False, True):
        theirs, ours = _lines(torch_fs, root_params), _lines(raggedfsdp.fully_shard, root_params)
        fsdp = lambda lines: {ln for ln in lines if ln.startswith("FSDP::")}  # noqa: E731
        assert "FSDP::pre_forward (1)" in fsdp(theirs), theirs  # the reference logs at all
        assert fsdp(ours) == fsdp(theirs), (root_params, sorted(fsdp(ours)), sorted(fsdp(theirs)))


def test_fsdp_debug_log_lines_match_torch():
    run_distributed(_case, 2)
