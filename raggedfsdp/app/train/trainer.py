"""The training loop: build (data, model, FSDP, optimizer), ``train_step``, ``evaluate``, ``train``.

Its helpers, one role each: ``train/build.py`` builds the sharded model (meshes, TP / EP, compile,
FSDP), ``train/run_checkpoints.py`` holds the checkpoint hooks (which step to resume, load, save),
``train/guard.py`` the step's checks, ``train/metrics.py`` the step line.

One code path for any world size, including 1 (a single process still gets a gloo process group
and a 1-rank mesh, so FSDP is applied the same way).

Loss normalisation: every micro-batch has the same number of tokens, so each rank's loss is the
mean over its tokens divided by ``grad_accum``; FSDP's reduce-scatter averages over ranks. The
gradient is therefore the gradient of the mean loss over the global batch, whatever the world size.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from raggedfsdp.app.checkpoint.dcp import config_hash
from raggedfsdp.app.models import aux_loss
from raggedfsdp.app.train import run_dir
from raggedfsdp.app.train.build import build_parallel_model
from raggedfsdp.app.train.config import TrainConfig
from raggedfsdp.app.train.data import (
    BatchSampler,
    batch_checksums,
    batch_id,
    check_batch,
    check_same_data,
    check_split,
    eval_windows,
    load_corpus,
    windows,
)
from raggedfsdp.app.train.data_identity import check_same_corpus, fingerprint, reference_fingerprint
from raggedfsdp.app.train.faults import FaultPlan, install
from raggedfsdp.app.train.guard import (
    StepGuard,
    check_params,
    check_saveable,
    gather_signals,
    nonfinite_detail,
    out_of_memory,
    signal_name,
)
from raggedfsdp.app.train.hooks import Hooks
from raggedfsdp.app.train.lr_schedule import lr_at
from raggedfsdp.app.train.metrics import MetricsLogger, model_flops_per_token, peak_flops, peak_memory_bytes
from raggedfsdp.app.train.optimizers import build_optimizer
from raggedfsdp.app.train.run_checkpoints import load_run_checkpoint, pick_resume, save_run_checkpoint
from raggedfsdp.app.train.straggler import StragglerProbe, describe, named
from raggedfsdp.app.train.watchdog import Interrupted, NoWatchdog

logger = logging.getLogger(__name__)

__all__ = ["Interrupted", "Trainer"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Trainer:
    """Owns everything of one run. Needs an initialised default process group.

    ``watchdog`` / ``interrupts``: from ``train.watchdog`` (the worker passes them); without them
    there is no hang detection and signals keep their default action. ``run``: what
    ``train.run_dir.prepare`` found in this process (the worker passes it); without it the Trainer
    prepares the run itself (rank 0 checks, every rank learns the outcome)."""

    def __init__(
        self, cfg: TrainConfig, *, device: torch.device, watchdog=None, interrupts=None,
        run: run_dir.PreparedRun | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # data parallel = the ranks of one tp group share a batch (--parallel.tp; global rank = dp * tp + t)
        self.tp = cfg.parallel.tp
        self.dp_size, self.dp_rank = self.world_size // self.tp, self.rank // self.tp
        if run is None:  # not prepared in this process (a Trainer built directly)
            cfg.validate(world_size=self.world_size)
            run = self._on_rank0(
                lambda: run_dir.prepare(cfg, self.world_size, validate=False, check_data=False)
            )
            cfg.job.out = str(run.out)  # rank 0's choice when --out was empty
        self.run = run
        self._lock = run.lock if self.rank == 0 else None
        self.out_dir = Path(cfg.job.out)
        self.watchdog = watchdog or NoWatchdog()
        self.interrupts = interrupts
        # what code outside the step may observe or change (train/hooks.py): here the test-only faults
        self.hooks = Hooks()
        self.faults = FaultPlan.from_env(self.rank, cfg.debug)
        install(self)
        t = cfg.training
        self.guard = StepGuard(
            rank=self.rank,
            world_size=self.world_size,
            device=device,
            policy=t.on_nonfinite,
            max_consecutive_skips=t.max_consecutive_skips,
            divergence_ratio=t.divergence_ratio,
        )
        self.ckpt_folder = Path(cfg.checkpoint.resolved_folder(cfg.job.out))
        try:
            self._build()
        except BaseException:
            self.close()  # release OUT/.lock: a refused start leaves --out usable
            raise

    def _build(self) -> None:
        cfg, device, t = self.cfg, self.device, self.cfg.training
        self.run_id = self._setup_run()

        # Data.
        self.corpus = load_corpus(
            cfg.data.path, max_bytes=cfg.data.max_bytes, val_fraction=cfg.data.val_fraction
        )
        # Both splits fit a window now, not only at the final evaluation.
        check_split(
            len(self.corpus.train),
            len(self.corpus.val),
            seq_len=t.seq_len,
            source=repr(self.corpus.source),
            val_fraction=cfg.data.val_fraction,
        )
        if self.hooks:
            self.corpus = self.hooks.pipe("corpus", self.corpus)
        # every rank reads the corpus the pre-launch check saw (one all_gather)
        check_same_corpus(fingerprint(self.corpus), device, reference_fingerprint())
        self.sampler = BatchSampler(
            self.corpus.train,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            world_size=self.dp_size,
            rank=self.dp_rank,
            grad_accum=t.grad_accum,
            seed=cfg.job.seed,
        )

        # Model + FSDP (the meshes of --parallel.*, TP / EP / compile, then fully_shard per unit).
        model, self.model_cfg = build_parallel_model(cfg, device, self.world_size)
        self.model = model
        # per-rank non-finite flags of the gradients before each unit's reduce-scatter (raggedfsdp backend)
        self._grad_probe: list | None = None
        if hasattr(model, "set_nonfinite_grad_probe"):
            self._grad_probe = []
            model.set_nonfinite_grad_probe(self._grad_probe)

        # Straggler attribution: per-rank own time between the step's collectives, reported at log steps.
        self.straggler = StragglerProbe(model, self.world_size, self.rank)
        self.hooks.fire("built")

        # Optimizer (train/optimizer_table.py): decay matrices and embeddings, not norm gains.
        self.optimizer = build_optimizer(cfg.optimizer, model)

        # Checkpoint / resume.
        c = cfg.checkpoint
        self.config_hash = config_hash(cfg.to_dict())
        self.start_step = 0  # the last completed step (0: a fresh run)
        self.resumed_from: Path | None = None
        resume = self._resolve_resume()
        if resume is not None:
            self._load(resume)
        elif c.resume == "auto":
            logger.info("--resume auto: no checkpoint under %s, starting from step 0", self.ckpt_folder)
        self.metrics = MetricsLogger(
            self.out_dir,
            enabled=self.rank == 0,
            jsonl=cfg.metrics.jsonl,
            total_steps=t.steps,
            resume_step=self.start_step if self.resumed_from is not None else None,
            flops_per_token=model_flops_per_token(self.model_cfg, t.seq_len),
            peak_flops=peak_flops(device, cfg.fsdp.param_dtype, cfg.job.peak_tflops),
            tensorboard=cfg.metrics.tensorboard,
        )

    # -- checkpoints -------------------------------------------------------------------------

    def _on_rank0(self, fn):
        """Run ``fn`` on rank 0 and broadcast its result (or re-raise its ValueError on every rank)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = fn()
            except ValueError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def close(self) -> None:
        """Release ``OUT/.lock``, the metrics file (the process exiting does it too) and the hooks."""
        if hasattr(self, "hooks"):
            self.hooks.fire("close")
        if hasattr(self, "straggler"):
            self.straggler.remove()
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()
        if hasattr(self, "metrics"):
            self.metrics.close()

    def _setup_run(self) -> str:
        """The run id; rank 0 writes ``OUT/run.json`` (the run was prepared: ``train/run_dir.py``)."""
        return self._on_rank0(lambda: run_dir.start_run(self.cfg, self.run))

    def _resolve_resume(self) -> Path | None:
        """Rank 0 picks the step folder (so that every rank loads the same one), others follow."""
        with self.watchdog.paused("verifying checkpoints"):
            return self._on_rank0(lambda: pick_resume(self.cfg, self.run, self.ckpt_folder, self.run_id))

    def _load(self, path: Path) -> None:
        with self.watchdog.paused("loading a checkpoint"):
            self.start_step = load_run_checkpoint(
                path, self.cfg, model=self.model, optimizer=self.optimizer,
                config_hash=self.config_hash, world_size=self.world_size,
            )  # fmt: skip
        self.resumed_from = path

    def save(self, step: int, lr: float) -> Path:
        """Collective. Refuses (``FaultError``) to write a checkpoint with non-finite state."""
        check_saveable(step, self.model, self.optimizer, self.device)
        with self.watchdog.watching("save", f"saving step {step}"):  # a rank frozen in it is named
            return self._save(step, lr)

    def _save(self, step: int, lr: float) -> Path:
        return save_run_checkpoint(
            self.ckpt_folder, step, lr, self.cfg, model=self.model, optimizer=self.optimizer,
            config_hash=self.config_hash, world_size=self.world_size, run_id=self.run_id,
            writer_factory=self.hooks.first("save_writer", step),
        )  # fmt: skip

    # -- steps -------------------------------------------------------------------------------

    def lr(self, step: int) -> float:
        o = self.cfg.optimizer
        return lr_at(
            step,
            lr=o.lr,
            total_steps=self.cfg.training.steps,
            warmup_steps=o.warmup_steps,
            schedule=o.schedule,
            min_lr_ratio=o.min_lr_ratio,
        )

    def batch_ids(self, step: int, micro: int = 0) -> dict[int, str]:
        """``{rank: batch id}`` of a micro-step (a pure function of the step: no communication)."""
        return {r: batch_id(self.sampler, step, micro, r // self.tp) for r in range(self.world_size)}

    def _batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.sampler.get(step, micro)  # (b, T), (b, T)
        if self.hooks:
            inputs, targets = self.hooks.pipe("batch", (inputs, targets), step, micro)
        check_batch(
            inputs,
            targets,
            sampler=self.sampler,
            step=step,
            micro=micro,
            vocab_size=self.model_cfg.vocab_size,
        )
        return inputs.to(self.device), targets.to(self.device)

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step. Returns (mean loss over ranks (0-d), global grad norm (0-d), lr).

        Non-finite losses/gradients and interrupts are decided in one fused all-reduce
        (``guard.StepGuard``) before the optimizer step; ``self.last_stats`` holds its result and
        ``self.last_applied`` whether the update was applied (False: skipped, policy ``skip``)."""
        t = self.cfg.training
        self.watchdog.progress(f"step {step} start", step, phase="train")
        if self._grad_probe is not None:
            self._grad_probe.clear()
        self.straggler.start_step()
        if self.hooks:
            self.hooks.fire("step_begin", step)
        accum = t.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        self.aux_loss_sum = None  # this step's auxiliary loss (mean over micro-batches), if the model has one
        sync_toggle = accum > 1 and hasattr(self.model, "set_requires_gradient_sync")
        for micro in range(accum):
            self.watchdog.progress(f"step {step} micro-step {micro}", step)
            inputs, targets = self._batch(step, micro)
            if sync_toggle:  # reduce-scatter gradients only after the last micro-batch
                self.model.set_requires_gradient_sync(micro == accum - 1)
            logits = self.model(inputs)  # (b, T, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / accum
            if self.hooks:
                self.hooks.fire("logits", logits, step, micro)
                loss = self.hooks.pipe("loss", loss, step, micro)
            aux = aux_loss(self.model)  # e.g. MoE load balancing (weighted, in the graph); None: dense
            (loss if aux is None else loss + aux / accum).backward()
            loss_sum += loss.detach()
            if aux is not None:
                prev = self.aux_loss_sum if self.aux_loss_sum is not None else 0.0
                self.aux_loss_sum = prev + aux.detach().float() / accum
        self.straggler.after_backward()
        self.watchdog.progress(f"step {step} optimizer", step)
        params = [p for p in self.model.parameters() if p.grad is not None]
        signum = self.interrupts.signum if self.interrupts is not None else 0
        probe = self._grad_probe
        grad_bad = torch.stack([f for _, f in probe]).any() if probe else None
        with self.straggler.grad_reduce():
            stats = self.guard.reduce(
                [p.grad for p in params], loss_sum, signum=signum, grad_nonfinite=grad_bad,
                params=list(self.model.parameters()), data=batch_checksums(self.sampler, step, self.dp_rank),
            )  # fmt: skip
        self.last_stats = stats
        check_same_data(step, stats.data, self.tp, self.batch_ids(step), self.corpus.source)
        self.last_applied = self.guard.check(step, stats, self.batch_ids(step), detail=self._nonfinite_detail)
        lr = self.lr(step)
        if self.last_applied:
            max_norm = t.max_norm if t.max_norm > 0 else math.inf
            coef = max_norm / (stats.grad_norm + 1e-6)
            if coef < 1.0:  # what clip_grad_norm_ does, with the norm of the fused reduction
                torch._foreach_mul_([_local(p.grad) for p in params], coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self.hooks:
                self.hooks.fire("after_optimizer", step)
        self.optimizer.zero_grad(set_to_none=True)
        self.straggler.end_step()
        dev = self.device  # fill kernels, not host-to-device copies: the host need not wait for the step
        return torch.full((), stats.loss, device=dev), torch.full((), stats.grad_norm, device=dev), lr

    def _nonfinite_detail(self, what: str) -> str:
        """Local, on a failure only: this rank's non-finite tensors (``what``: parameters / gradients)."""
        return nonfinite_detail(self.model, self._grad_probe, what)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over a fixed set of held-out windows (the same at any world size)."""
        t = self.cfg.training
        count = self.cfg.metrics.eval_batches * t.global_batch_size
        offsets = eval_windows(len(self.corpus.val), seq_len=t.seq_len, count=count)
        per_rank = count // self.dp_size
        mine = offsets[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        b = self.sampler.micro_batch_size
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, token count)
        for i in range(0, per_rank, b):  # same number of forwards on every rank (FSDP collectives)
            self.watchdog.progress(f"evaluation batch {i // b}", phase="eval")
            inputs, targets = windows(self.corpus.val, mine[i : i + b], t.seq_len)
            logits = self.model(inputs.to(self.device))  # (b, T, V)
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), targets.to(self.device).flatten(), reduction="sum"
            )
            total[0] += loss.double()
            total[1] += targets.numel()
        self.model.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def _interrupted(self, step: int, signals: dict[int, int], saved_step: int) -> None:
        """Every rank, at the boundary after ``step``: save (``checkpoint.on_interrupt``), raise."""
        signum = min(signals.values())
        name = signal_name(signum)
        c = self.cfg.checkpoint
        if c.on_interrupt and c.interval > 0 and saved_step != step:
            path = self.save(step, self.lr(step))
            what = f"saved {path}; continue with --resume auto --out {self.cfg.job.out}"
        elif saved_step == step:
            what = f"step {step} was just saved"
        else:
            what = "no checkpoint saved (checkpointing is off: --checkpoint-interval N)"
        ranks = sorted(signals)
        raise Interrupted(signum, f"interrupted by {name} (rank(s) {ranks}) after step {step}: {what}", ranks)

    # -- loop --------------------------------------------------------------------------------

    def write_config(self) -> None:
        if self.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        import raggedfsdp

        resolved = self.cfg.to_dict()
        resolved["resolved"] = {
            "world_size": self.world_size,
            "micro_batch_size": self.sampler.micro_batch_size,
            "tokens_per_step": self.cfg.training.global_batch_size * self.cfg.training.seq_len,
            "model": self.model_cfg.to_dict(),
            "num_params": self.model_cfg.num_params(),
            "data": {
                "source": self.corpus.source,
                "num_files": self.corpus.num_files,
                "train_tokens": len(self.corpus.train),
                "val_tokens": len(self.corpus.val),
            },
            "device": str(self.device),
            "torch_version": torch.__version__,
            "raggedfsdp_version": raggedfsdp.__version__,
            "num_threads": torch.get_num_threads(),
            "checkpoint_folder": str(self.ckpt_folder),
            "resumed_from": str(self.resumed_from) if self.resumed_from is not None else None,
            "resumed_at_step": self.start_step,
            "config_hash": self.config_hash,
        }
        with open(self.out_dir / "config.json", "w") as fh:
            json.dump(resolved, fh, indent=2)

    def train(self) -> dict[str, Any]:
        """Run all steps, log, evaluate at the end. Returns a summary (the same on every rank)."""
        cfg, t, m = self.cfg, self.cfg.training, self.cfg.metrics
        self.write_config()
        logger.info(
            "model %s/%s: %s params | data: %s (%d files, %d train / %d val bytes) | world size %d, "
            "micro-batch %d x %d, grad_accum %d | fsdp backend %s, param %s, reduce %s | optimizer %s",
            cfg.model.name,
            cfg.model.flavor,
            f"{self.model_cfg.num_params():,}",
            self.corpus.source,
            self.corpus.num_files,
            len(self.corpus.train),
            len(self.corpus.val),
            self.world_size,
            self.sampler.micro_batch_size,
            t.seq_len,
            t.grad_accum,
            cfg.fsdp.backend,
            cfg.fsdp.param_dtype,
            cfg.fsdp.reduce_dtype
            + (f", all-gather {cfg.fsdp.all_gather_dtype}" if cfg.fsdp.all_gather_dtype != "none" else "")
            + (
                f", gradient wire {cfg.fsdp.reduce_scatter_wire_dtype}"
                if cfg.fsdp.reduce_scatter_wire_dtype != "none"
                else ""
            ),
            type(self.optimizer).__name__,
        )
        tokens_per_step = t.global_batch_size * t.seq_len
        start = time.perf_counter()
        first = self.start_step + 1
        mark, mark_step = start, self.start_step
        first_loss = last_loss = eval_loss = float("nan")
        interval = cfg.checkpoint.interval
        saved_step = self.start_step if self.resumed_from is not None else -1
        if first > t.steps:
            logger.warning(
                "checkpoint step %d >= training.steps=%d: nothing to train, evaluating only",
                self.start_step,
                t.steps,
            )
            eval_loss = self.evaluate()
            self.metrics.log({"step": self.start_step, "eval_loss": eval_loss, "elapsed_s": 0.0})
        self.model.train()
        self.watchdog.arm()
        for step in range(first, t.steps + 1):
            try:
                _, _, lr = self.train_step(step)
            except (RuntimeError, MemoryError) as e:  # out of memory: one line naming rank, step, batch
                oom = out_of_memory(e, step, self.rank, self.device, self.batch_ids(step))
                if oom is e:
                    raise
                raise oom from e
            st = self.last_stats  # global loss and grad norm, from the step's fused all-reduce
            is_last = step == t.steps
            # an interrupted step keeps its record (the interrupt is raised after the log)
            if step == first or step % m.log_every == 0 or is_last or st.signals:
                loss_val, grad_val = st.loss, st.grad_norm
                extra = {}
                if self.aux_loss_sum is not None:  # mean over ranks of the aux loss (log steps only)
                    aux_t = self.aux_loss_sum.detach().clone().to(self.device)
                    dist.all_reduce(aux_t)
                    extra = {"aux_loss": aux_t.item() / self.world_size}
                # the largest rank's peak and every rank's straggler row (log steps only, one all-reduce)
                peak = torch.tensor(
                    [float(peak_memory_bytes(self.device)), *self.straggler.row()],
                    dtype=torch.float64,
                    device=self.device,
                )
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                slow = self.straggler.report(peak[1:].tolist())
                if slow is not None:
                    extra["straggler"] = {**slow, "named": named(slow)}
                    if named(slow):
                        logger.info("step %d: %s", step, describe(slow))
                now = time.perf_counter()
                n = step - mark_step
                dt = (now - mark) / n
                self.metrics.log(
                    {
                        "step": step,
                        "loss": loss_val,
                        "grad_norm": grad_val,
                        **extra,
                        "lr": lr,
                        "tokens_per_s": tokens_per_step / dt,
                        "tokens_per_s_per_rank": tokens_per_step / dt / self.world_size,
                        "step_time_s": dt,
                        "tokens_seen": step * tokens_per_step,
                        "elapsed_s": now - start,
                        "peak_memory_bytes": int(peak[0].item()),
                        "peak_memory_source": "cuda" if self.device.type == "cuda" else "rss",
                        **({"skipped_steps": self.guard.skipped_steps} if self.guard.skipped_steps else {}),
                    }
                )
                if step == first:
                    first_loss = loss_val
                last_loss = loss_val
                mark, mark_step = time.perf_counter(), step
            if st.signals:
                self._interrupted(step, st.signals, saved_step)
            if (m.eval_every and step % m.eval_every == 0) or is_last:
                eval_loss = self.evaluate()
                self.metrics.log(
                    {"step": step, "eval_loss": eval_loss, "elapsed_s": time.perf_counter() - start}
                )
                mark = time.perf_counter()  # exclude eval time from the next throughput figure
            if interval > 0 and (step % interval == 0 or is_last):
                path = self.save(step, lr)
                saved_step = step
                if self.interrupts is not None and not is_last:  # a signal during the save: stop now
                    signals = gather_signals(self.interrupts.signum, self.device)
                    if signals:
                        raise Interrupted(min(signals.values()), (
                            f"interrupted by {signal_name(min(signals.values()))} (rank(s) {sorted(signals)}) "
                            f"during the save of step {step}, which completed: saved {path}; continue with "
                            f"--resume auto --out {cfg.job.out}"), signals)  # fmt: skip
                mark = time.perf_counter()  # exclude checkpoint time too
        if t.steps >= first:
            check_params(
                t.steps, self.model, self._grad_probe, self.device
            )  # the last update; earlier: the guard
        elapsed = time.perf_counter() - start
        self.straggler.pause()  # no thread of ours left running after the last step
        self.watchdog.progress("done")
        summary = {
            "steps": t.steps,
            "start_step": self.start_step,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "last_checkpoint_step": saved_step,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "eval_loss": eval_loss,
            "train_time_s": elapsed,
        }
        resumed = f" (resumed at step {self.start_step})" if self.resumed_from is not None else ""
        if self.rank == 0:
            print(
                f"done: {t.steps} steps{resumed} in {elapsed:.1f}s | loss {first_loss:.4f} -> {last_loss:.4f} | "
                f"eval_loss {eval_loss:.4f} | metrics: {self.out_dir / 'metrics.jsonl'}",
                flush=True,
            )
        self.metrics.close()
        return summary
