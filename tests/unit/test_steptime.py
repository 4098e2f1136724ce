"""The step-time model (raggedfsdp.app.sizing.steptime) against closed-form timelines and independent
counts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from raggedfsdp.app.sizing.archs import load_config, model_units
from raggedfsdp.app.sizing.memory_estimate import estimate_memory
from raggedfsdp.app.sizing.modelplan import fsdp2_padding
from raggedfsdp.app.sizing.steptime import CLUSTERS, Parallel, _coll, estimate_time
from raggedfsdp.app.sizing.steptime_search import rank_configs

H100 = CLUSTERS["h100"]


def _llama(layers=4):
    cfg = load_config("llama3-8b")
    cfg["num_hidden_layers"] = layers
    return cfg, model_units(cfg)


def test_no_communication_is_compute_host_optimizer():
    """One rank: nothing to all-gather; the step is compute + host + the optimizer, exactly."""
    cfg, units = _llama()
    st = estimate_time(units, cfg, cluster="h100", parallel=Parallel(1), batch=1, seq_len=4096)
    assert st.ag_s == st.rs_s == 0
    assert st.step_s == pytest.approx(st.compute_s + st.host_s + st.copy_s + st.optim_s, rel=1e-12)
    # compute = 3 x forward; forward = tokens x FLOPs / speed (closed form from the config)
    H, V, inter, L = 4096, 128256, 14336, 4
    kv = 8 * 128
    per_layer = 2 * (H * H + 2 * kv * H + H * H + 3 * H * inter) + 2 * 4096 * 32 * 128
    fwd_flops = 4096 * (L * per_layer + 2 * V * H)
    assert st.compute_s == pytest.approx(3 * fwd_flops / (H100.peak_flops * H100.mfu), rel=1e-9)


def test_flops_match_6n_rule():
    """Training FLOPs per token = 6 x non-embedding params + causal attention (Kaplan / PaLM)."""
    cfg, units = _llama(32)
    seq = 8192
    st = estimate_time(units, cfg, cluster="h100", parallel=Parallel(1), batch=1, seq_len=seq)
    n = sum(math.prod(s) for u in units for nm, s in u.params if "embed" not in nm and len(s) >= 2)
    ref = seq * (6 * n + 6 * 32 * 4096 * seq)  # 12 L d seq halved for causal
    assert st.mfu * st.step_s * H100.peak_flops == pytest.approx(ref, rel=1e-9)


def test_comm_bound_step_is_the_serial_network():
    """Compute and host ~free: the step is the network's serial sum (all-gathers twice, reduce-scatters)."""
    cfg, units = _llama()
    fast = replace(H100, peak_flops=1e30, host_s_per_unit=0.0, hbm_bw=1e30)
    st = estimate_time(units, cfg, cluster=fast, parallel=Parallel(8), batch=1, seq_len=128)
    # forward all-gathers every unit, backward all but the last (kept unsharded), then every reduce-scatter
    first = estimate_time(units[:1], cfg, cluster=fast, parallel=Parallel(8), batch=1, seq_len=128)
    last = estimate_time(units[-1:], cfg, cluster=fast, parallel=Parallel(8), batch=1, seq_len=128)
    assert st.step_s == pytest.approx(2 * st.ag_s - last.ag_s + st.rs_s, rel=1e-9)
    assert first.step_s == pytest.approx(first.ag_s + first.rs_s, rel=1e-9)


def test_compute_bound_exposes_only_the_edges():
    """Collectives far smaller than compute: only what no compute can hide shows (FSDP2's schedule)."""
    cfg, units = _llama()
    slow = replace(H100, peak_flops=1e12, host_s_per_unit=0.0, hbm_bw=1e30)
    st = estimate_time(units, cfg, cluster=slow, parallel=Parallel(8), batch=4, seq_len=4096)
    one = [estimate_time([u], cfg, cluster=slow, parallel=Parallel(8), batch=4, seq_len=4096) for u in units]
    exposed = st.step_s - st.compute_s - st.optim_s
    # the embedding unit computes nothing: the first layer's all-gather and its reduce-scatter
    # (issued after the last matmul of backward) cannot hide either
    hidden_none = one[0].ag_s + one[1].ag_s + one[0].rs_s + one[1].rs_s
    assert exposed == pytest.approx(hidden_none, rel=1e-9)


def test_ring_cost():
    assert _coll(8e9, 8, 1e9, 0.0) == pytest.approx(7.0)
    assert _coll(1.0, 1, 1e9, 1.0) == 0.0
    assert _coll(0.0, 4, 1e9, 1e-3) == 0.0
    assert _coll(4e9, 4, 1e9, 1e-3) == pytest.approx(3.0 + 3e-3)


def test_fsdp2_layout_padding_is_fsdp2s():
    """The FSDP2 layout's padding equals the planner tables' independent per-tensor dim-0 count."""
    cfg = load_config("gpt-oss-120b")
    cfg["num_hidden_layers"] = 2
    units = model_units(cfg)
    for m in (8, 256):
        st = estimate_time(
            units, cfg, cluster="h100", parallel=Parallel(m), batch=1, seq_len=128, layout="fsdp2"
        )
        numel = sum(u.numel for u in units)
        shard = sum(-(-(u.numel + fsdp2_padding([s for _, s in u.params], m)) // m) for u in units)
        assert st.padding_ratio == pytest.approx(1 - numel / (m * shard), rel=1e-12)


def test_our_layout_is_the_memory_estimate_layout():
    cfg, units = _llama()
    for m in (3, 64):
        st = estimate_time(units, cfg, cluster="h100", parallel=Parallel(m), batch=1, seq_len=128)
        est = estimate_memory(units=units, world_size=m, recipe="mixed")
        assert st.padding_ratio == pytest.approx(est.padding_numel / (m * est.shard_numel), rel=1e-12)


def test_gpt_oss_at_256_fsdp2_doubles_the_allgather_buffer():
    """The paper's observation: 128 experts on 256 ranks, FSDP2's even dim-0 split pads the expert
    stacks to 256 rows (2x); the planner's rows do not. EP 8 shrinks both."""
    cfg = load_config("gpt-oss-120b")
    units = model_units(cfg)
    kw = {"cluster": "h100", "batch": 1, "seq_len": 4096}
    ours = estimate_time(units, cfg, parallel=Parallel(256), **kw)
    f2 = estimate_time(units, cfg, parallel=Parallel(256), layout="fsdp2", **kw)
    assert 1.9 < f2.allgather_bytes / ours.allgather_bytes < 2.1
    ours8 = estimate_time(units, cfg, parallel=Parallel(256, ep=8), **kw)
    assert ours8.allgather_bytes < ours.allgather_bytes / 4


def test_tp_divides_compute_and_adds_exposed_collectives():
    cfg, units = _llama()
    a = estimate_time(units, cfg, cluster="h100", parallel=Parallel(8), batch=2, seq_len=4096)
    b = estimate_time(units, cfg, cluster="h100", parallel=Parallel(4, tp=2), batch=2, seq_len=4096)
    assert b.compute_s == pytest.approx(a.compute_s / 2, rel=1e-9)
    assert b.tp_ep_s > 0 and a.tp_ep_s == 0


def test_bad_input():
    cfg, units = _llama(1)
    with pytest.raises(ValueError, match="unknown cluster 'x'"):
        estimate_time(units, cfg, cluster="x", parallel=Parallel(2), batch=1, seq_len=8)
    with pytest.raises(ValueError, match="ep=3 must divide dp_shard=4"):
        estimate_time(units, cfg, cluster="h100", parallel=Parallel(4, ep=3), batch=1, seq_len=8)
    with pytest.raises(ValueError, match="batch=0"):
        estimate_time(units, cfg, cluster="h100", parallel=Parallel(4), batch=0, seq_len=8)
    with pytest.raises(ValueError, match="layout='x'"):
        estimate_time(units, cfg, cluster="h100", parallel=Parallel(4), batch=1, seq_len=8, layout="x")


def test_cli_world_size_zero_is_named(capsys):
    """``--world-size 0`` was read as "not given" ("give --model and --world-size")."""
    from raggedfsdp.app.cli import main

    assert main(["estimate-time", "--model", "llama:debug", "--cluster", "h100", "--world-size", "0"]) == 2
    assert "--world-size 0: must be >= 1" in capsys.readouterr().err


def test_ep_on_a_dense_model_is_refused_as_by_plan_and_estimate_memory(capsys):
    """``estimate-time --ep 2`` on a dense model printed a table; plan / estimate-memory refuse it."""
    from raggedfsdp.app.cli import main

    cfg, units = _llama(1)
    with pytest.raises(ValueError, match=r"--ep 2: the model has no routed experts to split"):
        estimate_time(units, cfg, cluster="h100", parallel=Parallel(8, ep=2), batch=1, seq_len=8)
    errors = {}
    for cmd, extra in (("estimate-time", ["--cluster", "h100"]), ("estimate-memory", []), ("plan", [])):
        assert main([cmd, "--model", "llama3-8b", "--world-size", "8", "--ep", "2", *extra]) == 2, cmd
        captured = capsys.readouterr()
        assert captured.out == "", cmd
        (line,) = captured.err.strip().splitlines()
        errors[cmd] = line.split(": error: ", 1)[1]
    assert set(errors.values()) == {
        "--ep 2: the model has no routed experts to split (a dense model: use --ep 1)"
    }
    # an MoE model still estimates with --ep
    assert (
        main(
            [
                "estimate-time",
                "--model",
                "gpt-oss-120b",
                "--cluster",
                "h100",
                "--world-size",
                "8",
                "--ep",
                "2",
            ]
        )
        == 0
    )
    assert "speed-up vs fsdp2 layout" in capsys.readouterr().out


def test_time_report_prints_tokens_per_s_in_one_format():
    """``.4g`` printed ``7.4e+04`` next to ``7.316e+04``: whole tokens with separators in both columns."""
    from raggedfsdp.app.sizing.steptime_search import format_time_report

    cfg, units = _llama(1)
    st = estimate_time(units, cfg, cluster="h100", parallel=Parallel(8), batch=1, seq_len=8)
    report = format_time_report(replace(st, tokens_per_s=74_000.0), replace(st, tokens_per_s=73_160.4))
    (line,) = [ln for ln in report.splitlines() if ln.startswith("tokens/s")]
    assert line.split() == ["tokens/s", "74,000", "73,160"], line


def test_rank_configs_sorted_and_complete():
    cfg, units = _llama(2)
    rows = rank_configs({"layer": units}, cfg, cluster="h100", world=16, batch=1, seq_len=2048)
    steps = [st.step_s for _, st in rows]
    assert steps == sorted(steps)
    dims = {(c["dp_shard"], c["dp_replicate"], c["tp"]) for c, _ in rows}
    assert (16, 1, 1) in dims and (4, 2, 2) in dims and (2, 1, 8) in dims
    assert all(c["dp_shard"] * c["dp_replicate"] * c["tp"] == 16 for c, _ in rows)


def _tensors(units) -> int:
    return sum(len(u.params) for u in units)


def test_shared_cpu_host_time_shares_its_cores_and_counts_tensors():
    """The ``cpu`` preset (one host, cores = devices): ranks beyond the cores stretch the elapsed step
    by ranks / cores, the work (a rank's CPU seconds) does not; the per-tensor host cost is paid per
    tensor in forward, backward and the optimizer step (counted here from the units)."""
    cfg, units = _llama(2)
    h = 1e-4
    cpu = replace(
        CLUSTERS["cpu"], devices_per_node=2, peak_flops=math.inf, hbm_bw=math.inf, intra_bw=math.inf,
        intra_lat=0.0, host_s_per_unit=0.0, host_s_per_tensor=h,
    )  # fmt: skip
    for world in (1, 2, 3, 4):
        st = estimate_time(units, cfg, cluster=cpu, parallel=Parallel(world), batch=1, seq_len=128)
        assert st.host_s == pytest.approx(2 * h * _tensors(units), rel=1e-12)
        assert st.optim_s == pytest.approx(h * _tensors(units), rel=1e-12)
        assert st.work_s == pytest.approx(3 * h * _tensors(units), rel=1e-12)
        assert st.step_s == pytest.approx(st.work_s * max(1, world / 2), rel=1e-12)
    # an accelerator cluster has no time-sharing: step == work
    st = estimate_time(units, cfg, cluster="h100", parallel=Parallel(16), batch=1, seq_len=128)
    assert st.step_s == st.work_s


def test_calibrate_recovers_a_known_cpu_host():
    """Steps generated by a known CPU host at 1-2 ranks (two models: dense and MoE) are fitted, and the
    fit predicts that host's 3-4-rank steps (the ground truth here) within 3 %."""
    from raggedfsdp.app.sizing.steptime_search import calibrate

    truth = replace(
        CLUSTERS["cpu"], peak_flops=4e10, hbm_bw=3e9, intra_bw=6e8, intra_lat=2e-5, host_s_per_unit=3e-4,
        host_s_per_tensor=6e-5,
    )  # fmt: skip
    models = []
    for name, layers in (("llama3-8b", 2), ("qwen3-moe-30b", 1)):
        cfg = load_config(name)
        cfg["num_hidden_layers"] = layers
        cfg["hidden_size"], cfg["intermediate_size"] = 256, 512
        cfg["moe_intermediate_size"] = 128
        cfg["vocab_size"] = 256
        models.append((cfg, model_units(cfg)))

    def sample(cfg, units, world):
        st = estimate_time(
            units, cfg, cluster=truth, parallel=Parallel(world), batch=2, seq_len=128, param_bytes=4
        )
        return dict(
            units=units, cfg=cfg, parallel=Parallel(world), batch=2, seq_len=128, measured_s=st.work_s,
            measured_opt_s=st.optim_s,
        )  # fmt: skip

    fit = calibrate([sample(c, u, w) for c, u in models for w in (1, 2)], CLUSTERS["cpu"])
    for cfg, units in models:
        for world in (3, 4):
            want = sample(cfg, units, world)["measured_s"]
            got = estimate_time(
                units, cfg, cluster=fit, parallel=Parallel(world), batch=2, seq_len=128, param_bytes=4
            ).work_s
            assert got == pytest.approx(want, rel=0.03), (cfg["model_type"], world)
