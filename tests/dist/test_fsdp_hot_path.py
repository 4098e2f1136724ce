"""The FSDP runtime's Python work per training step must not scale with the number of parameters
(issue 22 item 4: an MoE with 128 separate experts is thousands of small tensors per step).

Counted, not timed: ``sys.setprofile`` counts the Python function calls (``call`` events, generator
resumptions included) made inside ``raggedfsdp`` (the model's own code excluded) during one training
step (forward, backward, AdamW step) of the MoE ``moe-debug`` with 4 and with 20 separate experts per
block, on torch's fake process group (world size 2, one process). The difference divided by the
extra parameters is the per-parameter Python cost of the hot path (hooks, unshard / reshard, grad
fold, reduce-scatter prep, sharded ``.grad`` install). torch's own ``fully_shard`` is counted the same
way (its ``torch/distributed/fsdp`` and DTensor code) as the reference it is compared against.

Calls miss loops: a list comprehension over the unit's params is one call however many params it
visits. So the same step is also traced with ``sys.settrace`` counting ``line`` events (each
Python line executed, loop iterations included) inside the runtime: per extra parameter that is the
per-parameter Python the interpreter runs, where C-level loops (``map`` over ``operator`` getters,
``fsdp/_common.py: ParamTensors``) count nothing.
"""

from __future__ import annotations

import collections
import sys

from _memory import run_fake_rank

# per extra parameter and step: nothing (Note [grad hooks] in fsdp/_grads.py: the gradient pre-hook sits on
# at most 8 params per unit); measured 0.0 at 2026-12-02 (torch's fully_shard: 68). Until then every param
# had the pre-hook (a C partial of UnitGrads.on_grad) and the early-free poll: 2 calls per parameter.
BUDGET_PER_PARAM = 0.25


def _count_step(backend: str, n_experts: int, events: str = "call"):
    import torch

    from raggedfsdp.app.models import apply_fsdp, build_model

    torch.manual_seed(0)
    model = build_model("moe", "moe-debug", n_experts=n_experts)
    model.init_weights(0)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    apply_fsdp(model, mesh, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tok = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))

    def step():
        logits = model(tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())
        (loss + model.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()  # warm: lazy init, optimizer state, sharded grad buffers exist
    where = "/raggedfsdp/" if backend == "ragged" else "/torch/distributed/"
    calls: collections.Counter = collections.Counter()

    def ours(frame) -> bool:
        f = frame.f_code.co_filename
        return where in f and "/models/" not in f and "/tests/" not in f

    def key(frame) -> str:
        f = frame.f_code.co_filename
        return f"{f.rsplit('/', 2)[-2]}/{f.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"

    def prof(frame, event, _arg):
        if event == "call" and ours(frame):
            calls[key(frame)] += 1

    def lines(frame, event, _arg):
        if event == "line":
            calls[key(frame)] += 1
        return lines

    def trace(frame, event, _arg):  # a local tracer only in the runtime's own frames
        return lines if event == "call" and ours(frame) else None

    if events == "call":
        sys.setprofile(prof)
    else:
        sys.settrace(trace)
    try:
        step()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return sum(1 for _ in model.parameters()), calls


def _per_param(rank, ws, events="call"):
    out = {}
    for backend in ("ragged", "torch"):
        (p1, c1), (p2, c2) = _count_step(backend, 4, events), _count_step(backend, 20, events)
        extra = {k: (c2[k] - c1[k]) / (p2 - p1) for k in c2 if c2[k] > c1[k]}
        out[backend] = ((sum(c2.values()) - sum(c1.values())) / (p2 - p1), extra, p2 - p1)
    return out


def test_fsdp_python_calls_per_step_do_not_scale_with_parameters():
    res = run_fake_rank(_per_param, 2, 0)
    ours, ours_by_fn, extra_params = res["ragged"]
    torch_per_param = res["torch"][0]
    assert extra_params > 90  # 16 more experts x 3 linears x 2 blocks
    top = sorted(ours_by_fn.items(), key=lambda kv: -kv[1])[:8]
    assert ours <= BUDGET_PER_PARAM, (
        f"raggedfsdp makes {ours:.1f} Python calls per parameter per step (budget {BUDGET_PER_PARAM}; "
        f"torch's fully_shard {torch_per_param:.1f}): a per-parameter loop is back in the hot path: {top}"
    )
    # the reference: torch's FSDP2 does per-parameter Python work in its copy-in / copy-out / reduce prep
    assert torch_per_param > 4 * ours, (ours, torch_per_param)


# per extra parameter and step: measured 0.0 (torch's fully_shard: 289) once the gradient pre-hook went to at
# most 8 params per unit (Note [grad hooks]); 8 with it on every param (its lines and the early-free poll's),
# and 112 before the C-level loops (main at d10ca2f, 2026-12-02).
LINE_BUDGET_PER_PARAM = 0.5


def test_fsdp_python_lines_per_step_do_not_scale_with_parameters():
    res = run_fake_rank(_per_param, 2, 0, "line")
    ours, ours_by_fn, _ = res["ragged"]
    torch_per_param = res["torch"][0]
    top = sorted(ours_by_fn.items(), key=lambda kv: -kv[1])[:8]
    assert ours <= LINE_BUDGET_PER_PARAM, (
        f"raggedfsdp runs {ours:.1f} Python lines per parameter per step (budget {LINE_BUDGET_PER_PARAM}; "
        f"torch's fully_shard {torch_per_param:.1f}): a per-parameter Python loop is back: {top}"
    )
    assert torch_per_param > 4 * ours, (ours, torch_per_param)
