"""Copy accounting around the collectives, measured with a TorchDispatchMode that records every
copy-like kernel (copy_, _to_copy, cat, split_with_sizes_copy, _chunk_cat, _foreach_copy_, and
torch FSDP2's fsdp::* copy ops) during one forward + backward.

The same model runs unsharded (baseline: copies the model itself makes), under raggedfsdp and under
torch's fully_shard; "overhead" is a run's copied bytes minus the baseline's. raggedfsdp must show no
copy on the parameter side (fp32: params are views of the all-gather output; bf16: one fused cast
per all-gather) and exactly one copy per gradient on the gradient side (Note [grad fold] in
``raggedfsdp/fsdp/_grads.py``: autograd's per-parameter gradient into the flat reduce-scatter input,
cast to ``reduce_dtype`` on the way), while FSDP2's copy-out *and* copy-in show up in the same
measurement.
"""

from __future__ import annotations

import torch

from _spawns import SPAWNS  # runs in the shared per-world-size spawns (tests/dist/_spawns.py)
from _toy_models import ToyLM, batches, lm_loss, shard_model
from raggedfsdp.app.bench.copy_accounting import CopyCounter


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
        (
            "ragged bf16",
            raggedfsdp.fully_shard,
            dict(
                mp_policy=raggedfsdp.MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
            ),
        ),
        (
            "torch bf16",
            torch_fully_shard,
            dict(mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        ),
    ):
        results[name] = _count(build(fs, **kw), tok, tgt)
    if rank == 0:
        for name, c in results.items():
            print(
                f"{name:12s} copied bytes {sum(c.bytes.values()):8d} (baseline {base}; gloo-internal "
                f"{c.backend_bytes}) {dict(c.calls)}"
            )
    numels = [p.numel() for p in build().parameters()]
    n_units, n_nonroot = 4, 3
    # fp32: each gradient copied once (the fold: one multi-tensor copy per unit) and nothing else; FSDP2
    # copies out after each all-gather too
    assert sum(results["ragged fp32"].bytes.values()) - base == 4 * sum(numels), results["ragged fp32"].bytes
    assert dict(results["ragged fp32"].calls) == {"aten._foreach_copy_": n_units}, dict(
        results["ragged fp32"].calls
    )
    assert sum(results["torch fp32"].bytes.values()) - base > 4 * sum(numels)
    # bf16: per unit, one cast of the fp32 shard into the bf16 all-gather buffer (forward unshard and
    # backward re-unshard for non-root units), and per gradient one cast-copy into the fp32
    # reduce-scatter input; the model's own fp32 casts (logits.float()) are in both runs
    rag = results["ragged bf16"]
    assert rag.calls["aten.copy_"] == n_units + n_nonroot, dict(rag.calls)
    assert rag.calls["aten._foreach_copy_"] == n_units, dict(rag.calls)
    assert set(rag.calls) <= {
        "aten.copy_",
        "aten._foreach_copy_",
        "aten._to_copy",
    }  # (_to_copy: logits.float())
    assert sum(results["torch bf16"].calls.values()) > sum(rag.calls.values())
    assert sum(results["torch bf16"].bytes.values()) > sum(rag.bytes.values())


def test_copies_around_collectives_vs_fsdp2():
    SPAWNS.check(2, "copy_accounting")
