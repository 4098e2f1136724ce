"""RaggedShard DTensors through torch's HF safetensors writer and reader (``HuggingFaceStorageWriter``).

A safetensors file maps a name to one tensor, and a RaggedShard piece that is not whole rows is
several DCP chunks of one name on one rank. Saved the way torchtitan's ``last_save_in_hf`` saves
(``save_distributed=True``; consolidated by the writer, or with an ``fqn_to_index_mapping`` of two
files consolidated by ``consolidate_safetensors_files_on_every_rank``), the consolidated files must
hold exactly the full tensors (read back with ``safetensors`` in one process), and torch's
``HuggingFaceStorageReader`` must load both the consolidated and the sharded folder exactly into
other RaggedShard layouts. World sizes 3 and 5, empty pieces included; the reference is the full
tensors drawn from one seed.

Stacked weights (MoE experts, one ``(E, F, D)`` parameter, saved as ``E`` HF tensors):
``raggedfsdp.placement.unbind_ragged`` splits a RaggedShard DTensor into its slices without
communication (views), ``stack_ragged`` joins them; saved through the same writer and loaded into
the slices of another layout, the stacked result must equal the full tensor.
"""

import glob
import os

import pytest
import torch

from _dist import run_distributed

pytest.importorskip("safetensors")

SHAPES = {"a.weight": (7, 5), "b.weight": (4, 2, 3), "c.bias": (5,), "d.weight": (6, 1), "e.weight": (3, 4)}


def _fulls() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _units(n: int, ws: int, seed: int) -> tuple[int, ...]:
    """Element counts of ``ws`` contiguous pieces of ``n`` elements, one of them empty, cut at random."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, n + 1, (ws - 2,), generator=g).tolist())
    bounds = [0, *cuts, n]
    units = [b - a for a, b in zip(bounds, bounds[1:])]
    units.insert(seed % ws, 0)  # an empty piece
    return tuple(units)


def _placement(name: str, ws: int, seed: int):
    from torch.distributed.tensor import Replicate, Shard

    from raggedfsdp import RaggedShard

    shape = SHAPES[name]
    if name == "e.weight":  # torch's own placements in the same file
        return Shard(0) if seed % 2 else Replicate()
    return RaggedShard(tuple(range(len(shape))), _units(int(torch.tensor(shape).prod()), ws, seed))


def _state_dict(mesh, ws: int, seed: int, fulls) -> dict:
    from torch.distributed.tensor import distribute_tensor

    src = fulls if fulls is not None else {k: torch.zeros_like(f) for k, f in _fulls().items()}
    return {
        k: distribute_tensor(f, mesh, [_placement(k, ws, seed + i)]) for i, (k, f) in enumerate(src.items())
    }


def _check_files(folder: str, fulls) -> None:
    from safetensors import safe_open

    got = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                assert k not in got, (k, path)
                got[k] = f.get_tensor(k)
    assert got.keys() == fulls.keys(), (sorted(got), folder)
    for k, f in fulls.items():
        assert torch.equal(got[k], f), (k, got[k], f)


def _load_and_check(reader_path: str, mesh, ws: int, fulls) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sd = _state_dict(mesh, ws, 100, None)  # another layout
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(reader_path))
    for k, v in sd.items():
        assert torch.equal(v.full_tensor(), fulls[k]), (k, reader_path)


def _hf_worker(rank: int, ws: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    fulls = _fulls()
    sd = _state_dict(mesh, ws, 1, fulls)
    for k, v in sd.items():
        assert torch.equal(v.full_tensor(), fulls[k]), k

    # 1. the writer consolidates (torchtitan without an fqn_to_index_mapping)
    one = os.path.join(root, "one")
    writer = HuggingFaceStorageWriter(one, save_distributed=True, enable_consolidation=True)
    dcp.save(sd, storage_writer=writer)
    # 2. two files, consolidated on every rank afterwards (torchtitan with an fqn_to_index_mapping)
    two = os.path.join(root, "two")
    mapping = {k: 1 + i % 2 for i, k in enumerate(SHAPES)}
    dcp.save(
        sd,
        storage_writer=HuggingFaceStorageWriter(
            os.path.join(two, "sharded"), save_distributed=True, fqn_to_index_mapping=mapping
        ),
    )
    consolidate_safetensors_files_on_every_rank(os.path.join(two, "sharded"), two, mapping)
    dist.barrier()
    if rank == 0:
        _check_files(one, fulls)
        _check_files(two, fulls)
        # the non-rectangular pieces did take the path under test: extra chunks in part files
        assert glob.glob(os.path.join(one, "sharded", "*.part1.safetensors")), os.listdir(one + "/sharded")
    for folder in (one, os.path.join(one, "sharded"), two, os.path.join(two, "sharded")):
        _load_and_check(folder, mesh, ws, fulls)
    _experts_case(rank, ws, mesh, os.path.join(root, "experts"))


EXPERTS = (5, 3, 4)  # (E, F, D)


def _experts_case(rank: int, ws: int, mesh, folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.tensor import Replicate, distribute_tensor

    from raggedfsdp import RaggedShard
    from raggedfsdp.placement import stack_ragged, unbind_ragged

    full = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(11))
    n = full.numel()
    layouts = [RaggedShard((0, 1, 2), _units(n, ws, 3)), RaggedShard((0, 1), _units(15, ws, 4))]
    x = distribute_tensor(full, mesh, [layouts[0]])
    parts = unbind_ragged(x)
    assert len(parts) == EXPERTS[0]
    for e, p in enumerate(parts):  # the slices, and views of x's piece
        assert torch.equal(p.full_tensor(), full[e]), e
        assert p.to_local().numel() == 0 or p.to_local().untyped_storage().data_ptr() == (
            x.to_local().untyped_storage().data_ptr()
        )
    back = stack_ragged(parts, mesh, x.placements, x.shape)
    assert back.placements == x.placements and torch.equal(back.to_local(), x.to_local())
    sd = {f"experts.{e}.weight": p for e, p in enumerate(parts)}
    dcp.save(
        sd, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True, enable_consolidation=True)
    )
    dist.barrier()
    if rank == 0:
        _check_files(folder, {k: full[e] for e, k in enumerate(sd)})
    y = distribute_tensor(torch.zeros_like(full), mesh, [layouts[1]])  # another layout: load into its slices
    sd = {f"experts.{e}.weight": p for e, p in enumerate(unbind_ragged(y))}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(folder))
    assert torch.equal(y.full_tensor(), full)  # in place, through the views
    z = stack_ragged(list(sd.values()), mesh, y.placements, y.shape)
    assert torch.equal(z.full_tensor(), full)
    # slices in another layout are redistributed first (collective), with the same result
    w = stack_ragged([p.redistribute(mesh, [Replicate()]) for p in parts], mesh, y.placements, y.shape)
    assert torch.equal(w.full_tensor(), full)


@pytest.mark.parametrize("ws", [3, 5])
def test_hf_safetensors_save_load_ragged(tmp_path, ws):
    run_distributed(_hf_worker, ws, str(tmp_path))


def test_part_file_name():
    from raggedfsdp.placement._checkpoint import part_file_name

    assert part_file_name("shard-00001-model-00001-of-00001.safetensors", 2) == (
        "shard-00001-model-00001-of-00001.part2.safetensors"
    )
    assert part_file_name("__0_0.distcp", 1) == "__0_0.part1.distcp"
    assert part_file_name("noext", 1) == "noext.part1"
