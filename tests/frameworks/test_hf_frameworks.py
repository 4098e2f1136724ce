"""HF Trainer, accelerate's FSDP2 plugin and PEFT LoRA switched to raggedfsdp by the README's one line,
``raggedfsdp.patch_torch()``, against the same script run with torch's own ``fully_shard`` (issue 39
item 7).

One spawn of 2 gloo CPU ranks runs every scenario twice in the same processes: first with torch's
``fully_shard`` (unpatched), then inside ``with raggedfsdp.patch_torch():`` (accelerate and the Trainer
look ``torch.distributed.fsdp.fully_shard`` up inside their functions, so the patch reaches them; its
``undo()`` on exit is checked too). Tiny ``LlamaConfig`` models built from config (no downloads,
``HF_HUB_OFFLINE=1``), fp32, a few steps; losses must equal torch's to 1e-5 relative, and every FSDP
unit of the patched run must be raggedfsdp's (so the test cannot pass by running torch twice).

* Trainer: ``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2, "activation_checkpointing": True}``
  (accelerate's ``checkpoint_wrapper`` + ``fully_shard`` on the wrapped blocks, checked present).
* PEFT: ``get_peft_model(LoraConfig(r=4, q/v_proj))`` trained by the same Trainer setup.
* accelerate: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
  cpu_ram_efficient_loading=True, state_dict_type="SHARDED_STATE_DICT", ...))``: prepare, 2 steps,
  ``save_state``, 2 steps, ``load_state``, the same 2 steps again (== the first time); the raggedfsdp
  run also loads the checkpoint torch's run saved and retrains those 2 steps (== torch's).

CPU shim (tests/frameworks/_shims.py, identical for both runs): accelerate takes its FSDP branch only
for accelerator device types, so ``AcceleratorState`` is set to ``DistributedType.FSDP`` with the plugin
it was given on CPU ranks. Full tier (no ``core`` mark); skipped when transformers, accelerate or peft
is absent (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
import os
import traceback

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from _dist import run_distributed  # noqa: E402

WS = 2
RTOL = 1e-5
VOCAB, SEQ = 64, 16


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _tokens(n: int):
    import torch

    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))


def _fsdp_owners(model) -> list[str]:
    """Who sharded each FSDP unit: "raggedfsdp" (its ``FSDPModule`` subclasses torch's) or "torch"."""
    from torch.distributed.fsdp import FSDPModule

    import raggedfsdp

    return sorted(
        {
            "raggedfsdp" if isinstance(m, raggedfsdp.FSDPModule) else "torch"
            for m in model.modules()
            if isinstance(m, FSDPModule)
        }
    )


def _has_checkpoint_wrapper(model) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def _trainer_run(out: str, lora: bool) -> dict:
    from transformers import Trainer, TrainingArguments

    model = _tiny_llama()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        )
    data = [{"input_ids": t, "labels": t} for t in _tokens(16)]
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        learning_rate=1e-2,
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "activation_checkpointing": True},
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "owners": _fsdp_owners(trainer.model_wrapped),
        "checkpoint_wrapper": _has_checkpoint_wrapper(trainer.model_wrapped),
    }


def _accelerate_run(out: str, backend: str) -> dict:
    import torch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
        reshard_after_forward=True,
        cpu_ram_efficient_loading=True,
    )
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    model = _tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    batches = _tokens(8 * WS).view(8, WS, SEQ)[:, acc.process_index].unflatten(0, (4, 2))  # 4 x (2, SEQ)

    def step(batch) -> float:
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return acc.reduce(loss.detach(), reduction="mean").item()

    res = {"first": [step(b) for b in batches[:2]]}
    acc.save_state(os.path.join(out, f"acc-{backend}"))
    res["after_save"] = [step(b) for b in batches[2:]]
    acc.load_state(os.path.join(out, f"acc-{backend}"))
    res["after_load"] = [step(b) for b in batches[2:]]
    if backend == "ragged":  # torch's checkpoint loaded by raggedfsdp
        acc.load_state(os.path.join(out, "acc-torch"))
        res["after_load_torch_ckpt"] = [step(b) for b in batches[2:]]
    res["owners"] = _fsdp_owners(model)
    return res


def _hf_worker(rank: int, world_size: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # read by accelerate's env checks; the process group already exists
        HF_HUB_OFFLINE="1",
    )
    import torch.distributed.fsdp as torch_fsdp

    import raggedfsdp
    from _shims import accelerate_fsdp_on_cpu

    accelerate_fsdp_on_cpu()
    torch_fully_shard = torch_fsdp.fully_shard
    results: dict = {}
    for backend in ("torch", "ragged"):
        patch = raggedfsdp.patch_torch() if backend == "ragged" else None
        try:
            runs = {
                "trainer": lambda: _trainer_run(os.path.join(out, f"trainer-{backend}"), lora=False),
                "peft": lambda: _trainer_run(os.path.join(out, f"peft-{backend}"), lora=True),
                "accelerate": lambda: _accelerate_run(out, backend),
            }
            for name, run in runs.items():
                try:
                    results[f"{name}/{backend}"] = run()
                except Exception:  # noqa: BLE001 - reported per scenario by the tests below
                    results[f"{name}/{backend}"] = {"error": traceback.format_exc()}
        finally:
            if patch is not None:
                patch.undo()
    results["restored"] = torch_fsdp.fully_shard is torch_fully_shard
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_frameworks"))
    run_distributed(_hf_worker, WS, out, timeout=600)
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _ok(results: dict, key: str) -> dict:
    res = results[key]
    assert "error" not in res, f"{key} failed:\n{res['error']}"
    return res


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) > 0, (what, got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"{what}: step {i}: raggedfsdp {g!r} vs torch {w!r}"


@pytest.mark.parametrize("name", ["trainer", "peft"])
def test_trainer_fsdp2_activation_checkpointing(hf_results, name):
    """HF Trainer (``fsdp_version`` 2 + activation checkpointing; ``peft``: a LoRA model) with
    ``patch_torch()``: raggedfsdp's units, accelerate's checkpoint wrappers, torch's losses."""
    ref, got = _ok(hf_results, f"{name}/torch"), _ok(hf_results, f"{name}/ragged")
    assert ref["owners"] == ["torch"] and got["owners"] == ["raggedfsdp"], (ref["owners"], got["owners"])
    assert ref["checkpoint_wrapper"] and got["checkpoint_wrapper"]
    assert len(set(ref["losses"])) > 1, "the losses must move for the comparison to mean anything"
    _close(got["losses"], ref["losses"], name)


def test_accelerate_fsdp2_plugin_save_load(hf_results):
    """accelerate's FSDP2 plugin (``cpu_ram_efficient_loading``, sharded ``save_state``/``load_state``)
    with ``patch_torch()``: torch's losses before and after a save, after a load of its own checkpoint
    and after a load of torch's; ``patch_torch()``'s ``undo()`` restores torch's ``fully_shard``."""
    ref, got = _ok(hf_results, "accelerate/torch"), _ok(hf_results, "accelerate/ragged")
    assert ref["owners"] == ["torch"] and got["owners"] == ["raggedfsdp"], (ref["owners"], got["owners"])
    _close(ref["after_load"], ref["after_save"], "torch: resumed vs continued")
    for key in ("first", "after_save", "after_load"):
        _close(got[key], ref[key], key)
    _close(got["after_load_torch_ckpt"], ref["after_save"], "raggedfsdp resumed from torch's checkpoint")
    assert hf_results["restored"]
