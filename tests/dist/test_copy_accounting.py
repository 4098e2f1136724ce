"""Copy accounting around the collectives, measured with a TorchDispatchMode that records every
copy-like kernel (copy_, _to_copy, cat, split_with_sizes_copy, _chunk_cat, _foreach_copy_, and
torch FSDP2's fsdp::* copy ops) during one forward + backward.

The same model runs unsharded (baseline: copies the model itself makes), under raggedfsdp and under
torch's fully_shard; "overhead" is a run's copied bytes minus the baseline's. raggedfsdp must show
zero extra copies in fp32 and exactly one fused cast per collective with param_dtype=bf16, while
FSDP2's copy-in / copy-out shows up in the same measurement.
"""

from __future__ import annotations

import torch

from _dist import run_distributed
from _toy_models import ToyLM, batches, lm_loss, shard_model
from raggedfsdp.fsdp.copy_accounting import CopyCounter

def _count(model, tok, tgt):
    lm_loss(model, tok, tgt).backward()  # warm-up: lazy init, first allocations
    for p in model.parameters():
        p.grad = None
    with CopyCounter() as c:
        lm_loss(model, tok, tgt).backward()
    return c


def _accounting(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import raggedfsdp

    mesh = init_device_mesh("cpu", (ws,))
    tok, tgt = batches(1, 2)[0]
    torch.manual_seed(0)
    init = ToyLM().state_dict()

    def build(fs=None, **kw):
        m = ToyLM()
        m.load_state_dict(init)
        return shard_model(m, fs, mesh, **kw) if fs is not None else m

    base = sum(_count(build(), tok, tgt).bytes.values())
    results = {}
    for name, fs, kw in (
        ("ragged fp32", raggedfsdp.fully_shard, {}),
        ("torch fp32", torch_fully_shard, {}),
        ("ragged bf16", raggedfsdp.fully_shard,
         dict(mp_policy=raggedfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
        ("torch bf16", torch_fully_shard,
         dict(mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
    ):
        results[name] = _count(build(fs, **kw), tok, tgt)
    if rank == 0:
        for name, c in results.items():
            print(f"{name:12s} copied bytes {sum(c.bytes.values()):8d} (baseline {base}; gloo-internal "
                  f"{c.backend_bytes}) {dict(c.calls)}")
    # fp32: raggedfsdp adds no copy at all; FSDP2 copies in and out around its collectives
    assert sum(results["ragged fp32"].bytes.values()) == base, results["ragged fp32"].bytes
    assert sum(results["torch fp32"].bytes.values()) > base
    # bf16: per unit, one cast of the fp32 shard into the bf16 all-gather buffer (forward unshard and
    # backward re-unshard for non-root units) and one cast of the bf16 grad buffer to fp32 before the
    # reduce-scatter; the model's own fp32 casts (logits.float()) are in both runs
    rag = results["ragged bf16"]
    n_units, n_nonroot = 4, 3
    expected_casts = n_units + n_nonroot + n_units
    assert rag.calls["aten.copy_"] == expected_casts, dict(rag.calls)
    assert set(rag.calls) <= {"aten.copy_", "aten._to_copy"}  # casts only (the _to_copy is logits.float())
    assert sum(results["torch bf16"].calls.values()) > sum(rag.calls.values())
    assert sum(results["torch bf16"].bytes.values()) > sum(rag.bytes.values())


def test_zero_copy_collectives_vs_fsdp2():
    run_distributed(_accounting, 2)
