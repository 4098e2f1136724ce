"""The shared per-world-size process groups of the core parity tests (tests/_cases.py SharedSpawns).

One spawn per world size 1-5 runs every case below in order; test_fsdp_parity, test_optim_parity,
test_fsdp_requires_grad_change and test_fsdp_features each assert on their own case. This replaced
30 spawns (84 ranks, ~3-6 s of imports each on a 2-core CI box) with 5 (15 ranks). Cases that end in
an expected error stay in their own spawn (a half-run collective would desynchronise the next case).
"""

from __future__ import annotations

from _cases import SharedSpawns

_P = "test_fsdp_parity."
SPAWNS = SharedSpawns(
    {
        "fp32": _P + "_fp32_parity",
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
    },
    {
        1: [("fp32", ()), ("muon_1d", ())],
        2: [("fp32", ()), ("bf16", ()), ("hsdp", ((2, 1),)), ("hsdp", ((1, 2),)), ("accum", ()),
            ("muon_1d", ()), ("requires_grad_change", ()),
            ("meta_init", ()), ("bad_input", ())],
        3: [("fp32", ()), ("bf16", ()), ("accum", ()), ("bf16_default", ()), ("muon_1d", ()),
            ("requires_grad_change", ()), ("features", ()), ("divide_factor", ())],
        4: [("fp32", ()), ("hsdp", ((2, 2),)), ("hsdp_deferred", ()), ("muon_hsdp", ()), ("int_reshard", ())],
        5: [("fp32", ()), ("bf16", ()), ("muon_1d", ()), ("requires_grad_change", ())],
    },
    timeout=600,
)  # fmt: skip
