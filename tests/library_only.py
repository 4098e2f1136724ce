"""The library alone: ``import raggedfsdp`` and a 2-rank ``fully_shard`` training run where only torch
is installed (no numpy, no transformers, no ``raggedfsdp.app``).

CI runs it in a venv that holds torch and nothing else (``.ci/run``); the suite runs it with
``--block-imports``, which makes ``raggedfsdp.app`` unimportable in every process
(tests/unit/test_layering.py; numpy cannot be blocked there: torch imports it when it is installed,
so the venv is what proves the library runs without it). Each rank trains a sharded copy of a small
model for 3 AdamW steps and compares its losses and ``full_tensor()`` parameters with a plain
single-process copy trained on the same batches (the reference). Prints ``library only: ok`` on
success; exits non-zero otherwise.

    python tests/library_only.py [--block-imports]
"""

from __future__ import annotations

import copy
import importlib.abc
import os
import socket
import sys

BLOCKED = ("raggedfsdp.app",)


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"{name} is blocked: the library must not need it")
        return None


def _block_imports() -> None:
    sys.meta_path.insert(0, _Blocker())
    os.environ["RAGGEDFSDP_TEST_BLOCK_IMPORTS"] = "1"  # spawned ranks block too


def _rank(rank: int, world: int, port: int) -> None:
    if os.environ.get("RAGGEDFSDP_TEST_BLOCK_IMPORTS"):
        _block_imports()
    import torch
    import torch.distributed as dist
    from torch import nn

    import raggedfsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 13), nn.GELU(), nn.Linear(13, 5, bias=False), nn.LayerNorm(5))
    model = copy.deepcopy(ref)
    for block in (model[0], model[2]):
        raggedfsdp.fully_shard(block)
    raggedfsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(world * 4, 8, generator=gen)
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(x[rank * 4 : (rank + 1) * 4]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            p.full_tensor(), q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )
    leaked = [m for m in BLOCKED if m in sys.modules]
    assert not leaked, f"the library imported {leaked}"
    raggedfsdp.shutdown_process_group()


def main() -> None:
    if "--block-imports" in sys.argv:
        _block_imports()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port), nprocs=2, join=True)
    print("library only: ok")


if __name__ == "__main__":
    main()
