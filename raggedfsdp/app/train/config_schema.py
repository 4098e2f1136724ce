"""Training configuration, the schema: one dataclass per ``[section]`` and ``TrainConfig``'s checks.

Every field carries its help text (and optional short flag) in its metadata; ``train/config.py``
maps TOML files and ``--section.key`` command-line options onto these classes. ``TrainConfig.validate``
holds the cross-field checks (each a ``ValueError`` naming the key, the value and a fix).

Batch semantics: ``training.global_batch_size`` counts sequences per optimizer step over all ranks
and accumulation micro-steps, so the same config gives the same optimisation at any world size.
Each rank processes ``global_batch_size // (world_size * grad_accum)`` sequences per micro-step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from raggedfsdp.app.train.optimizer_table import OPTIMIZER_NAMES, optimizer_help

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DebugConfig",
    "FSDPConfig",
    "JobConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainingConfig",
]


def _f(default: Any, help: str, *, flag: str | None = None, hidden: bool = False) -> Any:
    """A dataclass field with its help text (and optional short command-line flag)."""
    return field(default=default, metadata={"help": help, "flag": flag, "hidden": hidden})


@dataclass(kw_only=True)
class JobConfig:
    out: str = _f(
        "",
        "output folder (metrics.jsonl, config.json, run.json, checkpoints/); empty: a fresh "
        "outputs/run-YYYYmmdd-HHMMSS per run",
        flag="--out",
    )
    overwrite: bool = _f(False, "start a fresh run in an --out that already holds one (its files are kept)")
    seed: int = _f(0, "seed for the model init and the data order", flag="--seed")
    device: str = _f("auto", "auto | cpu | cuda (auto: cuda with nccl if available, else cpu with gloo)")
    pg_timeout_s: float = _f(
        120.0, "process-group timeout in seconds: a stuck collective errors out after this long"
    )
    hang_timeout_s: float = _f(
        60.0,
        "a rank that makes no progress for this long outside a collective is named as hung and the "
        "job stops; the most: once steps were seen, max(30 s, 20 x the slowest recent step), and always "
        "0.6 x job.pg_timeout_s or less (0: off; see train/watchdog.py)",
    )
    peak_tflops: float = _f(
        0.0, "peak TFLOP/s of one device for the MFU figure (0: from the GPU name; none on CPU)"
    )


@dataclass(kw_only=True)
class ModelConfig:
    name: str = _f("llama", "model family: llama | moe | hybrid (Gated DeltaNet + full attention)")
    flavor: str = _f(
        "tiny",
        "named size: debug | tiny | small | base (moe: moe-debug | moe-tiny | ...; hybrid: debug | tiny | small)",
        flag="--model",
    )
    dim: int | None = _f(None, "override the flavor's model dim")
    n_layers: int | None = _f(None, "override the flavor's number of blocks")
    n_heads: int | None = _f(None, "override the flavor's query heads")
    n_kv_heads: int | None = _f(None, "override the flavor's key/value heads (GQA)")
    ffn_dim: int | None = _f(None, "override the flavor's SwiGLU hidden dim (0: 8/3 * dim)")
    tie_embeddings: bool | None = _f(None, "tie the output projection to the input embedding")
    experts: str | None = _f(
        None, "moe: expert storage, separate (many small tensors) | fused ((X, D, F) stacks)"
    )
    n_experts: int | None = _f(None, "moe: override the flavor's routed experts per block")
    top_k: int | None = _f(None, "moe: override the flavor's experts per token")
    aux_loss_coef: float | None = _f(None, "moe: weight of the load-balancing loss added to the LM loss")
    vocab_size: int | None = _f(
        None,
        "override the vocabulary size (default: the flavor's, or a tokenized .bin's sidecar vocabulary when larger)",
    )
    init_device: str = _f("cpu", "cpu: init the full model then shard; meta: shard on meta, to_empty, init")
    init_from: str = _f(
        "",
        "start from a Hugging Face safetensors folder (llama; e.g. written by raggedfsdp convert); "
        "each rank reads only its own pieces",
    )


@dataclass(kw_only=True)
class DataConfig:
    path: str = _f(
        "",
        "text file or folder of text files, or a pre-tokenized .bin (raggedfsdp tokenize); empty: the "
        "Python stdlib's .py sources",
        flag="--data",
    )
    max_bytes: int = _f(4_000_000, "use at most this many bytes of the corpus (0: no cap)")
    val_fraction: float = _f(0.05, "fraction of the corpus (its tail) held out for evaluation")


@dataclass(kw_only=True)
class TrainingConfig:
    steps: int = _f(600, "optimizer steps", flag="--steps")
    global_batch_size: int = _f(
        16, "sequences per optimizer step, summed over ranks and micro-steps", flag="--batch-size"
    )
    seq_len: int = _f(128, "tokens (bytes) per sequence", flag="--seq-len")
    grad_accum: int = _f(1, "gradient-accumulation micro-steps per optimizer step", flag="--grad-accum")
    max_norm: float = _f(1.0, "clip the global gradient norm to this (0: no clipping, norm still logged)")
    on_nonfinite: str = _f(
        "stop", "a NaN/Inf loss or gradient on any rank: stop (exit 1, nothing saved) | skip (the update)"
    )
    max_consecutive_skips: int = _f(5, "on_nonfinite=skip: stop after more non-finite steps in a row")
    divergence_ratio: float = _f(3.0, "stop when the loss exceeds this times the run's first loss (0: off)")
    compile: bool = _f(
        False,
        "torch.compile each block (fullgraph=True) before fully_shard; the hooks stay eager",
        flag="--compile",
    )


@dataclass(kw_only=True)
class OptimizerConfig:
    name: str = _f(
        "adamw",
        optimizer_help(),
        flag="--optim",
    )
    lr: float = _f(3e-3, "peak learning rate", flag="--lr")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW eps")
    weight_decay: float = _f(0.1, "decoupled weight decay, applied to matrices and embeddings only")
    schedule: str = _f("cosine", "cosine (linear warmup, cosine decay) | constant (warmup, then flat)")
    warmup_steps: int = _f(20, "linear warmup steps")
    min_lr_ratio: float = _f(0.1, "cosine decays to lr * min_lr_ratio at the last step")


@dataclass(kw_only=True)
class FSDPConfig:
    backend: str = _f(
        "ragged", "ragged (raggedfsdp.fully_shard) | torch (torch FSDP2, reference)", flag="--backend"
    )
    param_dtype: str = _f("fp32", "compute dtype of all-gathered params: fp32 | bf16", flag="--param-dtype")
    reduce_dtype: str = _f("fp32", "gradient reduce-scatter dtype: fp32 | bf16", flag="--reduce-dtype")
    reshard_after_forward: bool = _f(True, "free gathered block params after forward (ZeRO-3)")
    all_gather_dtype: str = _f(
        "none",
        "quantized parameter all-gather (ragged backend): fp8_e4m3 | int8 (8-bit codes + fp32 scale per "
        "32x32 block, ~0.5x bf16's wire bytes; docs/quantized_comm.md) | none",
    )
    reduce_scatter_wire_dtype: str = _f(
        "none",
        "gradient wire dtype (ragged backend): bf16 (bf16 pieces over an all-to-all, summed in reduce_dtype; "
        "half an fp32 reduce-scatter's bytes) | none (the reduce-scatter in reduce_dtype)",
    )
    unit: str = _f(
        "layer",
        "FSDP unit: layer (one per block) | superblock (hybrid models: one per 3 linear + 1 full "
        "attention layers) | layers:K (K blocks per unit); compare them with raggedfsdp wrap-bench",
    )


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = _f(1, "tensor-parallel degree: attention heads and SwiGLU split column/row-wise (llama only)")
    dp_replicate: int = _f(
        1, "HSDP replicas: the dp ranks are dp_replicate x dp_shard (dp_shard = nproc / (dp_replicate * tp))"
    )

    def dp_shard(self, world_size: int) -> int:
        return world_size // (self.tp * self.dp_replicate)

    ep: int = _f(
        1,
        "expert-parallel size (moe): each MoE layer's routed experts split over this many ranks, tokens "
        "exchanged by all-to-all, experts FSDP-sharded over world/ep ranks; implies --model.experts fused",
    )


@dataclass(kw_only=True)
class MetricsConfig:
    log_every: int = _f(
        25, "print and record metrics every N steps (and at the last step)", flag="--log-every"
    )
    eval_every: int = _f(0, "evaluate on the held-out split every N steps (0: only at the end)")
    eval_batches: int = _f(4, "evaluation size, in global batches of the held-out split")
    jsonl: bool = _f(True, "write OUT/metrics.jsonl on rank 0")
    tensorboard: bool = _f(True, "also write TensorBoard event files to OUT/tb (if tensorboard is installed)")


@dataclass(kw_only=True)
class CheckpointConfig:
    interval: int = _f(
        0,
        "save a DCP checkpoint every N steps, and at the last step (0: no checkpoints)",
        flag="--checkpoint-interval",
    )
    folder: str = _f("", "where step-N/ checkpoint folders go (empty: OUT/checkpoints)")
    keep_latest: int = _f(2, "keep only the newest K step-N/ folders (0: keep all)")
    resume: str = _f(
        "",
        "resume from a step-N/ folder, a folder of them (its newest), or 'auto' (the newest under "
        "checkpoint.folder, else start fresh); any world size",
        flag="--resume",
    )
    verify: bool = _f(True, "verify a checkpoint's manifest (sizes + SHA-256) before loading it")
    allow_partial: bool = _f(
        False, "load only the keys that match the model (fine-tuning); default: any mismatch is an error"
    )
    on_interrupt: bool = _f(
        True, "on SIGINT/SIGTERM/SIGHUP save a checkpoint at the next step boundary (if interval > 0)"
    )

    def resolved_folder(self, out: str) -> str:
        return self.folder or os.path.join(out, "checkpoints")


@dataclass(kw_only=True)
class DebugConfig:
    fail_rank: int = _f(-1, "raise on this rank (testing failure handling)", hidden=True)
    fail_step: int = _f(-1, "... at this step", hidden=True)
    fail_mode: str = _f(
        "raise", "raise (exception) | exit (os._exit(3)) | hang (sleep forever) | savehang (sleep forever inside "
        "the checkpoint save of fail_step)", hidden=True,
    )  # fmt: skip
    slow_rank: int = _f(
        -1, "make this rank a straggler: sleep debug.slow_s every step (tests the report)", hidden=True
    )
    slow_s: float = _f(0.2, "... seconds per step", hidden=True)
    slow_unit: str = _f(
        "", "... before this FSDP unit's forward (e.g. layers.1; empty: at the step's start)", hidden=True
    )


@dataclass(kw_only=True)
class TrainConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def model_overrides(self) -> dict[str, Any]:
        """The ``[model]`` fields that replace the flavor's values (those that are set)."""
        out = {k: getattr(self.model, k) for k in _MODEL_OVERRIDE_KEYS if getattr(self.model, k) is not None}
        if (
            self.model.vocab_size is None
            and self.data.path.endswith(".bin")
            and os.path.isfile(self.data.path)
        ):
            # a tokenized .bin's sidecar records its tokenizer's vocabulary: use it when the flavor's is smaller
            from raggedfsdp.app.models import build_model_config
            from raggedfsdp.app.train.data import token_bin_info

            vocab = token_bin_info(self.data.path).vocab_size
            if (
                vocab is not None
                and vocab > build_model_config(self.model.name, self.model.flavor, **out).vocab_size
            ):
                out["vocab_size"] = vocab
        if self.parallel.ep > 1 and self.model.experts is None:
            out["experts"] = "fused"  # expert parallelism splits fused (X, D, F) stacks (same numbers)
        return out

    def validate(self, world_size: int | None = None) -> None:
        """Cross-field checks; with ``world_size`` also the batch split. Raises ``ValueError``."""
        t, o, f, m = self.training, self.optimizer, self.fsdp, self.metrics
        # NaN passes every `value < 0` check below and reached the ranks (--lr nan: torch's error from
        # each rank after the launch; --training.max_norm nan: silently no clipping): refuse it here.
        for section in dataclasses.fields(self):
            for fld in dataclasses.fields(getattr(self, section.name)):
                value = getattr(getattr(self, section.name), fld.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(
                        f"{section.name}.{fld.name} must be a finite number, got {value}; "
                        f"pass a number such as --{section.name}.{fld.name} {fld.default}"
                    )
        for key, value in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{key} must be in [0, 1), got {value}; e.g. --{key} 0.9")
        positive = {
            "training.steps": t.steps,
            "training.global_batch_size": t.global_batch_size,
            "training.seq_len": t.seq_len,
            "training.grad_accum": t.grad_accum,
            "metrics.log_every": m.log_every,
            "metrics.eval_batches": m.eval_batches,
        }
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        nonneg = {
            "training.max_norm": t.max_norm,
            "optimizer.lr": o.lr,
            "optimizer.eps": o.eps,
            "optimizer.warmup_steps": o.warmup_steps,
            "optimizer.weight_decay": o.weight_decay,
            "metrics.eval_every": m.eval_every,
            "data.max_bytes": self.data.max_bytes,
            "checkpoint.interval": self.checkpoint.interval,
            "checkpoint.keep_latest": self.checkpoint.keep_latest,
        }
        for key, value in nonneg.items():
            if value < 0:
                raise ValueError(f"{key} must be >= 0, got {value}")
        if not 0.0 < self.data.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.data.val_fraction}")
        if not 0.0 <= o.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
        choices = {
            "optimizer.name": (o.name, OPTIMIZER_NAMES),
            "optimizer.schedule": (o.schedule, ("cosine", "constant")),
            "fsdp.backend": (f.backend, ("ragged", "torch")),
            "fsdp.param_dtype": (f.param_dtype, ("fp32", "bf16")),
            "fsdp.reduce_dtype": (f.reduce_dtype, ("fp32", "bf16")),
            "fsdp.all_gather_dtype": (f.all_gather_dtype, ("none", "fp8_e4m3", "int8")),
            "fsdp.reduce_scatter_wire_dtype": (f.reduce_scatter_wire_dtype, ("none", "bf16")),
            "model.init_device": (self.model.init_device, ("cpu", "meta")),
            "job.device": (self.job.device, ("auto", "cpu", "cuda")),
            "debug.fail_mode": (self.debug.fail_mode, ("raise", "exit", "hang", "savehang")),
            "training.on_nonfinite": (t.on_nonfinite, ("stop", "skip")),
        }
        from raggedfsdp.app.models.parallelize import parse_unit

        parse_unit(f.unit)  # the one unit vocabulary: layer | superblock | layers:K
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
        if self.job.hang_timeout_s < 0 or t.max_consecutive_skips < 0 or t.divergence_ratio < 0:
            raise ValueError(
                "job.hang_timeout_s, training.max_consecutive_skips and training.divergence_ratio must "
                f"be >= 0, got {self.job.hang_timeout_s}, {t.max_consecutive_skips}, {t.divergence_ratio}"
            )
        if self.checkpoint.resume == "auto" and not self.job.out and not self.checkpoint.folder:
            raise ValueError(
                "--resume auto needs --out (the default --out is a fresh folder per run, so there is "
                "nothing to resume in it); e.g. --out outputs/myrun --resume auto"
            )
        if self.job.device == "cuda":  # before the launch: torch's own error comes from every rank, later
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n == 0:
                raise ValueError(
                    f"job.device='cuda' but torch {torch.__version__} sees no CUDA device (a CPU-only wheel, or "
                    "no GPU visible); use --job.device cpu (or auto), or install a CUDA build of torch"
                )
            if world_size is not None and world_size > n:
                raise ValueError(
                    f"job.device='cuda' with {world_size} ranks but only {n} CUDA device(s) are visible; "
                    f"use --nproc {n} or fewer"
                )
        seed = self.job.seed
        if not 0 <= seed < 2**63:  # numpy's generator refused a negative seed on every rank, after the launch
            raise ValueError(
                f"job.seed (--seed) must be in [0, 2**63), got {seed}; use a non-negative seed, e.g. --seed 0"
            )
        if self.job.pg_timeout_s <= 0:
            raise ValueError(f"job.pg_timeout_s must be > 0, got {self.job.pg_timeout_s}")
        for key, value in (
            ("fsdp.all_gather_dtype", f.all_gather_dtype),
            ("fsdp.reduce_scatter_wire_dtype", f.reduce_scatter_wire_dtype),
        ):
            if value != "none" and f.backend != "ragged":
                raise ValueError(
                    f"{key}={value!r} is a raggedfsdp extension (torch's fully_shard has no quantized "
                    f"all-gather or bf16-wire reduce-scatter): use fsdp.backend='ragged' (got {f.backend!r}), "
                    f"or {key}='none'"
                )
        if o.name != "adamw" and f.backend != "ragged":
            raise ValueError(
                f"optimizer.name={o.name!r} needs RaggedShard parameters: use fsdp.backend='ragged' "
                f"(got {f.backend!r}), or optimizer.name='adamw'"
            )
        # Model: builds the flavor with the overrides (raises on bad names or shapes).
        mcfg = self._model_config()
        if self.model.name.startswith("hf:") and self.model.init_device == "meta":
            raise ValueError(
                f"model.name={self.model.name!r}: hf models initialise on the CPU; use --model.init_device cpu"
            )
        if self.model.init_from and self.model.name != "llama":
            raise ValueError(
                "model.init_from loads Hugging Face LLaMA weights; "
                f"model.name={self.model.name!r} is not llama"
            )
        if f.unit == "superblock" and not getattr(mcfg, "full_attention_interval", 0):
            raise ValueError(
                f"fsdp.unit='superblock' needs a hybrid model (super-blocks of linear + full attention); "
                f"model.name={self.model.name!r} has plain layers: use --fsdp.unit layer or "
                "--model.name hybrid"
            )
        ep = self.parallel.ep
        if ep < 1:
            raise ValueError(f"parallel.ep must be >= 1, got {ep}")
        if ep > 1:
            if self.model.name != "moe":
                raise ValueError(
                    f"parallel.ep={ep} needs a MoE model (--model.name moe), got {self.model.name!r}"
                )
            if mcfg.experts != "fused":
                raise ValueError(
                    f"parallel.ep={ep} splits fused expert stacks; drop --model.experts {mcfg.experts} "
                    "(or give --model.experts fused)"
                )
            if mcfg.n_experts % ep:
                raise ValueError(
                    f"parallel.ep={ep} must divide the {mcfg.n_experts} experts per layer "
                    f"(--model.n_experts); use one of "
                    f"{[d for d in range(1, mcfg.n_experts + 1) if mcfg.n_experts % d == 0]}"
                )
            if world_size is not None and world_size % ep:
                raise ValueError(
                    f"parallel.ep={ep} must divide the number of ranks ({world_size}, --nproc): the world is "
                    f"(nproc/ep) x ep; use --nproc {ep * max(1, world_size // ep)}"
                )
            if self.model.init_device == "meta":
                raise ValueError(
                    f"parallel.ep={ep}: use --model.init_device cpu (meta init with EP is not supported yet)"
                )
        if t.seq_len > mcfg.max_seq_len:
            raise ValueError(
                f"training.seq_len={t.seq_len} exceeds the model's max_seq_len={mcfg.max_seq_len} "
                f"(flavor {self.model.flavor!r})"
            )
        par = self.parallel
        if par.tp < 1 or par.dp_replicate < 1:
            raise ValueError(
                f"parallel.tp={par.tp} and parallel.dp_replicate={par.dp_replicate} must be >= 1"
            )
        if par.ep > 1 and par.tp > 1:
            raise ValueError(
                f"parallel.ep={par.ep} with parallel.tp={par.tp}: EP x TP is not supported (apply_tp is the dense "
                "Llama's plan, with no tensor-parallel split of experts or router); train the MoE with "
                "--parallel.ep and --parallel.tp 1, or a dense model with --parallel.tp"
            )
        if par.ep > 1 and par.dp_replicate > 1:
            raise ValueError(
                f"parallel.ep={par.ep} with parallel.dp_replicate={par.dp_replicate}: EP x HSDP is not supported "
                "in the job yet; use --parallel.dp_replicate 1 (FSDP over dp x ep)"
            )
        if world_size is not None and world_size % (par.tp * par.dp_replicate):
            raise ValueError(
                f"parallel.dp_replicate * parallel.tp = {par.dp_replicate} * {par.tp} does not divide "
                f"--nproc {world_size}: the mesh is dp_replicate x dp_shard x tp = nproc ranks"
            )
        if par.tp > 1:
            from raggedfsdp.app.models.parallelize import tp_plan_errors

            if self.model.name != "llama":
                raise ValueError(
                    f"parallel.tp={par.tp} has a TP plan for model.name='llama' only, "
                    f"got {self.model.name!r}; use --parallel.tp 1"
                )
            errs = tp_plan_errors(mcfg, par.tp)
            if errs:
                raise ValueError(
                    f"parallel.tp={par.tp}: " + "; ".join(errs) + " (pick a tp that divides them)"
                )
        if world_size is not None:
            world_size //= par.tp  # data-parallel ranks: the tp ranks of a group share one batch
            denom = world_size * t.grad_accum
            if t.global_batch_size % denom != 0:
                raise ValueError(
                    f"training.global_batch_size={t.global_batch_size} must be divisible by "
                    f"world_size * grad_accum = {world_size} * {t.grad_accum} = {denom}; "
                    + _batch_fix(t.global_batch_size, world_size, t.grad_accum)
                )

    def _model_config(self):
        """The model config of ``[model]`` (the flavor with the overrides); ``ValueError`` naming the
        ``--model.*`` options for a size < 1 or shapes that do not fit together."""
        from raggedfsdp.app.models import build_model_config

        m = self.model
        sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "n_experts", "top_k", "vocab_size")
        for key, least in (*((k, 1) for k in sizes), ("ffn_dim", 0)):
            value = getattr(m, key)
            if value is not None and value < least:
                note = "0 means 8/3 * dim" if key == "ffn_dim" else _flavor_value(m, key)
                raise ValueError(
                    f"--model.{key} must be >= {least}, got {value}; give a larger value or drop "
                    f"--model.{key} to keep the flavor's" + (f" ({note})" if note else "")
                )
        if m.aux_loss_coef is not None and m.aux_loss_coef < 0:
            raise ValueError(f"--model.aux_loss_coef must be >= 0, got {m.aux_loss_coef}; e.g. 0.01")
        try:
            return build_model_config(m.name, m.flavor, **self.model_overrides())
        except ValueError as e:
            # the model classes name their fields (dim=32, n_heads=5): say which of them the user set
            msg = str(e)
            given = [
                k for k in _MODEL_OVERRIDE_KEYS if getattr(m, k) is not None and re.search(rf"\b{k}\b", msg)
            ]
            if given:
                flags = ", ".join(f"--model.{k} {getattr(m, k)}" for k in given)
                msg += f" (given: {flags}; the other sizes are the {m.flavor!r} flavor's)"
            raise ValueError(msg) from None

    def check_data(self) -> int:
        """Pre-launch check of ``[data]`` against ``training.seq_len``, without loading the corpus.

        Raises ``ValueError`` naming the path and the cause (missing, empty, no readable text files,
        too small for the held-out split; see :func:`raggedfsdp.app.train.data.check_data`), or the
        ``--model.vocab_size`` that cannot hold the data's token ids (a byte-level corpus: 256; a
        ``.bin``: its sidecar's vocabulary, when it records one), or a ``.bin`` whose CRC-32 differs
        from its sidecar's or that holds an id outside the model's vocabulary
        (:func:`raggedfsdp.app.train.tokens.verify_token_bin`). Returns the corpus size in bytes.
        Cheap: file sizes only (no tokenization); a ``.bin`` is read once (~50 ms per 100 MB cached).
        """
        from raggedfsdp.app.models import build_model_config
        from raggedfsdp.app.train.data import check_data, is_token_bin, token_bin_info, verify_token_bin

        d = self.data
        mv = build_model_config(self.model.name, self.model.flavor, **self.model_overrides()).vocab_size
        if is_token_bin(d.path):
            vocab = token_bin_info(d.path).vocab_size
            if vocab is not None and vocab > mv:
                raise ValueError(
                    f"data {d.path!r} was tokenized with a vocabulary of {vocab:,} but the model has "
                    f"vocab_size={mv:,}; pass --model.vocab_size {vocab}"
                )
            # its CRC-32 and every id against the model's vocabulary (one pass); the
            # launcher warns about an old sidecar, its ranks do not again
            from raggedfsdp.app.train.data_identity import REFERENCE_ENV

            warn = REFERENCE_ENV not in os.environ and os.environ.get("RANK", "0") == "0"
            verify_token_bin(d.path, mv, warn=warn)
        elif mv < _BYTE_VOCAB:  # bytes are token ids 0..255: a smaller vocabulary failed at step 1, per rank
            what = (
                f"--model.vocab_size {mv}"
                if self.model.vocab_size is not None
                else f"the model's vocab_size={mv}"
            )
            raise ValueError(
                f"{what} is too small for the byte-level corpus ({d.path or 'the Python stdlib'}: token ids "
                f"0..{_BYTE_VOCAB - 1}); use --model.vocab_size {_BYTE_VOCAB} or more, or train on a "
                "pre-tokenized .bin of that vocabulary (raggedfsdp tokenize)"
            )
        return check_data(
            d.path, max_bytes=d.max_bytes, val_fraction=d.val_fraction, seq_len=self.training.seq_len
        )


_BYTE_VOCAB = 256
"""Token ids of the byte-level corpus (``train/data.py``: every file is read as bytes)."""

_MODEL_OVERRIDE_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "tie_embeddings",
    "experts",
    "n_experts",
    "top_k",
    "aux_loss_coef",
    "vocab_size",
)
"""The ``[model]`` fields that override the flavor's values when set."""


def _flavor_value(m: ModelConfig, key: str) -> str:
    """``"the 'debug' flavor has dim=32"`` (empty when the flavor does not build or lacks ``key``)."""
    from raggedfsdp.app.models import build_model_config

    try:
        value = getattr(build_model_config(m.name, m.flavor), key)
    except (ValueError, AttributeError, KeyError):
        return ""
    return f"the {m.flavor!r} flavor has {key}={value}"


def _batch_fix(batch: int, world_size: int, grad_accum: int) -> str:
    """A concrete fix for a batch that does not split: the nearest valid --batch-size values (and
    world sizes that would work with this batch)."""
    denom = world_size * grad_accum
    lower = batch // denom * denom
    sizes = [v for v in (lower, lower + denom) if v >= 1]
    fix = "use " + " or ".join(f"--batch-size {v}" for v in sizes)
    if batch % grad_accum == 0:
        per_step = batch // grad_accum
        ranks = [n for n in range(1, per_step + 1) if per_step % n == 0][:8]
        fix += f", or a world size that divides {per_step} (--nproc {', '.join(map(str, ranks))})"
    return fix
