"""Training config: TOML loading, strict keys, command-line overrides, validation, LR schedule."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest

from raggedfsdp.app.train.config import (
    TrainConfig,
    add_config_args,
    apply_overrides,
    config_from_dict,
    load_config,
    override_argv,
    overrides_from_args,
)
from raggedfsdp.app.train.lr_schedule import lr_at

REPO = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(argv)
    return load_config(args.config, overrides_from_args(args))


def test_defaults_are_valid():
    cfg = TrainConfig()
    cfg.validate(world_size=2)
    assert cfg.fsdp.backend == "ragged"
    assert cfg.model.flavor == "tiny" and cfg.data.path == ""


def test_toml_load(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text(
        '[model]\nflavor = "debug"\nn_layers = 3\n'
        "[training]\nsteps = 7\nglobal_batch_size = 4\nmax_norm = 2\n"
        '[fsdp]\nbackend = "torch"\nreshard_after_forward = false\n'
    )
    cfg = load_config(path)
    assert cfg.model.flavor == "debug" and cfg.model.n_layers == 3
    assert cfg.training.steps == 7 and cfg.training.global_batch_size == 4
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.fsdp.backend == "torch" and cfg.fsdp.reshard_after_forward is False
    assert cfg.model_overrides() == {"n_layers": 3}
    assert cfg.training.seq_len == TrainConfig().training.seq_len  # untouched keys keep defaults


def test_unknown_key_names_the_key_and_the_valid_keys(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nstpes = 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'stpes' in \[training\].*valid keys: .*'steps'"):
        load_config(path)
    path.write_text("[trainig]\nsteps = 3\n")
    with pytest.raises(ValueError, match=r"unknown section \[trainig\].*'training'"):
        load_config(path)
    with pytest.raises(ValueError, match="unknown config option 'training.stpes'"):
        apply_overrides(TrainConfig(), {"training.stpes": "3"})


def test_type_errors_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="training.steps must be an integer"):
        config_from_dict({"training": {"steps": "ten"}})
    with pytest.raises(ValueError, match="training.steps must be an integer"):
        config_from_dict({"training": {"steps": 1.5}})
    with pytest.raises(ValueError, match="fsdp.reshard_after_forward must be a boolean"):
        config_from_dict({"fsdp": {"reshard_after_forward": 1}})
    with pytest.raises(ValueError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "broken.toml").write_text("[training\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(tmp_path / "broken.toml")


def test_cli_overrides_beat_toml(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n")
    cfg = _parse(
        [
            "--config",
            str(path),
            "--steps",
            "9",
            "--optimizer.lr=2e-3",
            "--fsdp.reshard_after_forward",
            "false",
            "--model",
            "debug",
            "--backend",
            "torch",
            "--param-dtype",
            "bf16",
        ]
    )
    assert cfg.training.steps == 9  # CLI > TOML
    assert cfg.training.seq_len == 64  # TOML > default
    assert cfg.optimizer.lr == 2e-3
    assert cfg.fsdp.reshard_after_forward is False
    assert cfg.model.flavor == "debug" and cfg.fsdp.backend == "torch" and cfg.fsdp.param_dtype == "bf16"


def test_short_flags_cover_the_brief():
    cfg = _parse(
        [
            "--steps",
            "3",
            "--data",
            "x.txt",
            "--out",
            "o",
            "--seed",
            "4",
            "--log-every",
            "2",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--lr",
            "1e-3",
            "--grad-accum",
            "2",
            "--reduce-dtype",
            "bf16",
        ]
    )
    assert (cfg.training.steps, cfg.data.path, cfg.job.out, cfg.job.seed) == (3, "x.txt", "o", 4)
    assert (cfg.metrics.log_every, cfg.training.global_batch_size, cfg.training.seq_len) == (2, 8, 32)
    assert (cfg.optimizer.lr, cfg.training.grad_accum, cfg.fsdp.reduce_dtype) == (1e-3, 2, "bf16")


def test_override_argv_round_trip(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("[training]\nsteps = 7\n")
    overrides = {"training.seq_len": "32", "model.flavor": "debug", "debug.fail_rank": "1"}
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(override_argv(str(path), overrides))
    assert load_config(args.config, overrides_from_args(args)) == load_config(path, overrides)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"training.steps": "0"}, "training.steps must be >= 1"),
        ({"fsdp.backend": "deepspeed"}, "fsdp.backend must be one of"),
        ({"fsdp.param_dtype": "fp16"}, "fsdp.param_dtype must be one of"),
        ({"model.flavor": "huge"}, "unknown llama flavor"),
        ({"model.n_kv_heads": "3"}, "n_kv_heads must divide n_heads"),
        ({"training.seq_len": "100000"}, "exceeds the model's max_seq_len"),
        ({"data.val_fraction": "1.5"}, "val_fraction"),
        # NaN slipped past every `< 0` check: --lr nan failed on each rank after the launch and
        # --training.max_norm nan trained silently unclipped; beta/eps were torch's errors, per rank
        ({"optimizer.lr": "nan"}, r"optimizer.lr must be a finite number, got nan; .*--optimizer.lr 0.003"),
        ({"training.max_norm": "nan"}, "training.max_norm must be a finite number, got nan"),
        ({"job.hang_timeout_s": "inf"}, "job.hang_timeout_s must be a finite number, got inf"),
        ({"optimizer.beta1": "1.5"}, r"optimizer.beta1 must be in \[0, 1\), got 1.5"),
        ({"optimizer.beta2": "-0.1"}, r"optimizer.beta2 must be in \[0, 1\)"),
        ({"optimizer.eps": "-1"}, "optimizer.eps must be >= 0, got -1.0"),
        ({"model.name": "moe", "parallel.ep": "2", "parallel.tp": "2"}, "EP x TP is not supported"),
        ({"model.name": "moe", "parallel.ep": "2", "parallel.dp_replicate": "2"}, "EP x HSDP"),
        # --seed -1 launched and failed on every rank in numpy (expected non-negative integer)
        ({"job.seed": "-1"}, r"^job.seed \(--seed\) must be in \[0, 2\*\*63\), got -1; .*e.g. --seed 0$"),
        ({"job.seed": str(2**63)}, r"job.seed \(--seed\) must be in \[0, 2\*\*63\)"),
        # --model.dim 0 was a ZeroDivisionError in init_weights on every rank, after the launch
        (
            {"model.dim": "0"},
            r"^--model.dim must be >= 1, got 0; .*drop --model.dim .*\(the 'tiny' flavor has dim=128\)$",
        ),
        ({"model.n_heads": "0"}, r"^--model.n_heads must be >= 1, got 0"),
        ({"model.n_kv_heads": "0"}, r"^--model.n_kv_heads must be >= 1, got 0"),
        ({"model.n_layers": "0"}, r"^--model.n_layers must be >= 1, got 0"),
        ({"model.vocab_size": "0"}, r"^--model.vocab_size must be >= 1, got 0"),
        ({"model.ffn_dim": "-1"}, r"^--model.ffn_dim must be >= 0, got -1; .*\(0 means 8/3 \* dim\)$"),
        ({"model.name": "moe", "model.n_experts": "0"}, r"^--model.n_experts must be >= 1, got 0"),
        ({"model.name": "moe", "model.top_k": "0"}, r"^--model.top_k must be >= 1, got 0"),
        ({"model.name": "hybrid", "model.dim": "0"}, r"^--model.dim must be >= 1, got 0"),
        # the model's own check, in the user's names and with the option that was given
        (
            {"model.n_heads": "5"},
            r"^dim must be divisible by n_heads, got dim=128, n_heads=5 "
            r"\(given: --model.n_heads 5; the other sizes are the 'tiny' flavor's\)$",
        ),
    ],
)
def test_validation_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_batch_must_split_over_ranks_and_micro_steps():
    cfg = load_config(None, {"training.global_batch_size": "12", "training.grad_accum": "2"})
    cfg.validate(world_size=2)
    with pytest.raises(ValueError, match=r"divisible by world_size \* grad_accum = 4 \* 2 = 8"):
        cfg.validate(world_size=4)


@pytest.mark.parametrize(
    "batch, world_size, grad_accum, fix",
    [
        (
            16,
            3,
            1,
            "use --batch-size 15 or --batch-size 18, or a world size that divides 16 (--nproc 1, 2, 4, 8, "
            "16)",
        ),
        (16, 32, 1, "use --batch-size 32, or a world size that divides 16"),
        (16, 2, 3, "use --batch-size 12 or --batch-size 18"),
    ],
)
def test_batch_split_error_suggests_valid_batch_sizes(batch, world_size, grad_accum, fix):
    cfg = load_config(
        None, {"training.global_batch_size": str(batch), "training.grad_accum": str(grad_accum)}
    )
    with pytest.raises(ValueError) as exc:
        cfg.validate(world_size=world_size)
    assert fix in str(exc.value), str(exc.value)
    sizes = [int(v) for v in re.findall(r"--batch-size (\d+)", str(exc.value))]
    assert sizes
    for size in sizes:
        cfg.training.global_batch_size = size
        cfg.validate(world_size=world_size)  # each suggestion is valid


def test_check_data(tmp_path):
    cfg = load_config(None, {"data.path": str(tmp_path / "nope.txt")})  # validate() does not touch files
    with pytest.raises(ValueError, match=r"data path '.*nope.txt' not found"):
        cfg.check_data()
    (tmp_path / "nope.txt").write_text("abc\n" * 2000)
    assert cfg.check_data() == 8000
    cfg.training.seq_len = 500
    with pytest.raises(
        ValueError, match=r"too small \(8000 bytes\) for training.seq_len=500.*at most 399 fits"
    ):
        cfg.check_data()
    assert TrainConfig().check_data() == 4_000_000  # the default stdlib corpus, capped


def test_check_data_refuses_a_vocab_smaller_than_the_byte_corpus(tmp_path):
    # --model.vocab_size 10 launched and failed at step 1 with "token id 116 outside [0, 10)"
    text = tmp_path / "corpus.txt"
    text.write_text("abc\n" * 2000)
    for path in ("", str(text)):  # the default stdlib corpus and a text file: both byte-level
        cfg = load_config("debug", {"data.path": path, "model.vocab_size": "10"})
        with pytest.raises(
            ValueError,
            match=r"^--model.vocab_size 10 is too small for the byte-level corpus \(.*token ids 0..255\); "
            r"use --model.vocab_size 256 or more",
        ):
            cfg.check_data()
    load_config("debug", {"data.path": str(text), "model.vocab_size": "256"}).check_data()
    # a tokenized .bin brings its own vocabulary: a small one is fine there
    from raggedfsdp.app.train.data import write_token_bin

    bin_path = write_token_bin(tmp_path / "d.bin", [list(range(10)) * 400], vocab_size=10)
    load_config("debug", {"data.path": str(bin_path), "model.vocab_size": "10"}).check_data()


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path).validate(world_size=2)


def test_lr_schedule():
    kw = dict(lr=1.0, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(1, **kw) == pytest.approx(0.1)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(110, **kw) == pytest.approx(0.1)
    lrs = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lr_at(50, schedule="constant", **kw) == 1.0
    # no warmup: step s sits at progress s / total_steps of the cosine
    assert lr_at(1, lr=1.0, total_steps=5, warmup_steps=0, min_lr_ratio=0.0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 5))
    )
