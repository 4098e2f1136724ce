"""The shared per-world-size process groups of the multi-rank tests (tests/_cases.py SharedSpawns).

One spawn per world size 1-5 runs every case below in order; each test asserts on its own case (the
failure names the case, its world size and the first rank's traceback). The core parity tests
(test_fsdp_parity, test_optim_parity, test_fsdp_requires_grad_change, test_fsdp_features) replaced 30
spawns with 5; the cases after them (frozen params, runtime mechanics, grad folding, drop-in, TP,
ragged optimizers / redistribute / clipping, MoE, HF models, the docs' compose snippets, the user cases
that recover from a detected mismatch) replaced 30 more (~90 ranks, ~4-6 CPU-seconds of process start
and ``import torch`` each on a 2-core CI box).

Cases that end the process group with an error, patch ``torch.distributed`` or measure process memory
stay in their own spawn. A case that raises and recovers (``reset_iter_state``, then a correct step that
is checked against a reference) may share: a desynchronised group would fail that check or hang the
next collective until the timeout, which fails this case and every case after it.
"""

from __future__ import annotations

from _cases import SharedSpawns

_P = "test_fsdp_parity."
_U = "test_fsdp_user_cases."
SPAWNS = SharedSpawns(
    {
        "fp32": _P + "_fp32_parity",
        "rs_path": "test_reduce_scatter_path._cases",
        "bf16": _P + "_bf16_parity",
        "hsdp": _P + "_hsdp_parity",
        "accum": _P + "_accum_parity",
        "hsdp_deferred": _P + "_hsdp_deferred_all_reduce",
        "bf16_default": _P + "_bf16_default_reduce",
        "muon_1d": "test_optim_parity._muon_1d",
        "muon_hsdp": "test_optim_parity._muon_hsdp",
        "requires_grad_change": "test_fsdp_requires_grad_change._cases",
        "features": "test_fsdp_features._features",
        "meta_init": "test_fsdp_features._meta_init",
        "divide_factor": "test_fsdp_features._divide_factor",
        "bad_input": "test_fsdp_features._bad_input",
        "int_reshard": "test_fsdp_features._int_reshard",
        "frozen": "test_fsdp_frozen._frozen_cases",
        "runtime": "test_fsdp_runtime._runtime_cases",
        "runtime_bf16_grads": "test_fsdp_runtime._bf16_grads",
        "post_acc_hooks": "test_fsdp_post_acc_hooks._case",
        "dropin": "test_fsdp_dropin._case",
        "grad_fold": "test_fsdp_grad_fold._cases_ws3",
        "grad_fold_hsdp": "test_fsdp_grad_fold._cases_hsdp",
        "ragged_optim_1d": "test_ragged_optim._optim_1d",
        "ragged_optim_hsdp": "test_ragged_optim._optim_hsdp",
        "clip_grad_norm": "test_clip_grad_norm._cases",
        "clip_grad_norm_mixed_mesh": "test_clip_grad_norm._mixed_mesh_case",
        "redistribute_1d": "test_ragged_redistribute._cases_1d",
        "redistribute_2d": "test_ragged_redistribute._cases_2d",
        "moe_parity": "test_moe_parity._moe_parity",
        "hybrid": "test_hybrid_fsdp._all",
        "hf_llama": "test_hf_llama._hf",
        "copy_accounting": "test_copy_accounting._accounting",
        "fsdp_tp": "test_fsdp_tp._run",
        "optim_tp": "test_optim_tp._run",
        "docs_compose": "test_docs_compose._snippets",
        "user_requires_grad_after_wrap": _U + "_requires_grad_after_wrap",
        "user_units_some_ranks_debug": _U + "_units_some_ranks_run",
        "user_units_some_ranks": _U + "_units_some_ranks_run_no_debug",
        "user_order_mismatch": _U + "_order_mismatch",
        "torch_save": "test_fsdp_checkpoint._torch_save_case",
    },
    {
        1: [("fp32", ()), ("muon_1d", ()), ("redistribute_1d", (False,)), ("ragged_optim_1d", ())],
        2: [("fp32", ()), ("bf16", ()), ("hsdp", ((2, 1),)), ("hsdp", ((1, 2),)), ("accum", ()),
            ("muon_1d", ()), ("requires_grad_change", ()),
            ("meta_init", ()), ("bad_input", ()),
            ("clip_grad_norm", ()), ("redistribute_1d", (False,)), ("copy_accounting", ()),
            ("user_units_some_ranks", ()), ("user_order_mismatch", ()), ("user_units_some_ranks_debug", ())],
        3: [("fp32", ()), ("rs_path", ()), ("bf16", ()), ("accum", ()), ("bf16_default", ()), ("muon_1d", ()),
            ("requires_grad_change", ()), ("features", ()), ("divide_factor", ()),
            ("frozen", ()), ("user_requires_grad_after_wrap", ()), ("runtime", ()),
            ("runtime_bf16_grads", ()), ("torch_save", ()), ("post_acc_hooks", ()), ("dropin", ()),
            ("grad_fold", ()),
            ("ragged_optim_1d", ()),
            ("clip_grad_norm", ()), ("redistribute_1d", (False,)), ("moe_parity", ()), ("hybrid", ()),
            ("hf_llama", ())],
        4: [("fp32", ()), ("hsdp", ((2, 2),)), ("hsdp_deferred", ()), ("muon_hsdp", ()), ("int_reshard", ()),
            ("grad_fold_hsdp", ()), ("ragged_optim_hsdp", ()), ("clip_grad_norm_mixed_mesh", ()),
            ("redistribute_2d", ()), ("fsdp_tp", ()), ("optim_tp", ()), ("docs_compose", ())],
        5: [("fp32", ()), ("rs_path", ()), ("bf16", ()), ("muon_1d", ()), ("requires_grad_change", ()),
            ("frozen", ()), ("clip_grad_norm", ()), ("redistribute_1d", (True,)), ("hybrid", ())],
    },
    timeout=1500,
    # the default tier's cases (tests marked core; tests/conftest.py): fsdp fp32 parity with empty
    # pieces at 3 and 5 ranks, bf16 params at 3, the structure-aware optimizers, RaggedShard redistribute
    core={3: {"fp32", "bf16", "muon_1d", "redistribute_1d"}, 5: {"fp32"}},
)  # fmt: skip

# The checkpoint tests: every save at world size 4 in one spawn, the loads at 3, 2 and 1 in one spawn
# each, through folders shared across the spawns (``case_tmpdir(key)``; the tests call the save first).
# Replaced 11 spawns (30 ranks) with 4 (10 ranks).
CHECKPOINTS = SharedSpawns(
    {
        "fsdp_save": "test_fsdp_checkpoint._save_shared",
        "fsdp_load": "test_fsdp_checkpoint._load_shared",
        "optim_save": "test_optim_checkpoint._save_shared",
        "optim_load": "test_optim_checkpoint._load_shared",
        "ragged_save": "test_ragged_checkpoint._save_shared",
        "ragged_load": "test_ragged_checkpoint._load_shared",
        "tp_save": "test_fsdp_tp_checkpoint._save_shared",
        "tp_load": "test_fsdp_tp_checkpoint._load_shared",
    },
    {
        4: [("fsdp_save", ()), ("optim_save", ()), ("ragged_save", ()), ("tp_save", ())],
        3: [("fsdp_load", ()), ("optim_load", ()), ("ragged_load", ())],
        2: [("tp_load", (1, 2, "dp1tp2"))],
        1: [("fsdp_load", ()), ("optim_load", ()), ("tp_load", (1, 1, "single"))],
    },
    timeout=900,
    core={4: {"fsdp_save"}, 3: {"fsdp_load"}, 1: {"fsdp_load"}},  # test_dcp_save_at_4_resume_at_3_and_1
)

# The slow 4-rank cases (still run in CI; ``-m 'not slow'`` skips them all): one spawn instead of 4.
SLOW = SharedSpawns(
    {
        "moe_ep": "test_moe_ep._ep_parity_ws4",
        "moe_ep_fsdp": "test_moe_ep_fsdp._ep_fsdp",
        "moe_ep_ckpt": "test_moe_ep_checkpoint._ckpt_shared",
        "fake_streams": "test_fake_streams._cases",
    },
    {4: [("moe_ep", ()), ("moe_ep_fsdp", ()), ("moe_ep_ckpt", ()), ("fake_streams", ())]},
    timeout=1500,
)
