"""``raggedfsdp convert CKPT --to safetensors|torch OUT``: a DCP training checkpoint to Hugging Face
safetensors (with ``config.json``) or a ``torch.save`` state dict; see :mod:`raggedfsdp.app.checkpoint.hf`.

The checkpoint is checked as ``train --resume PATH`` checks it (``checkpoint.dcp.open_step_folder``:
every file against the step folder's ``manifest.json`` SHA-256, an unfinished ``step-N.tmp`` refused),
so a corrupt or partial save is one line naming the file, never weights converted from it;
``--no-verify`` reads a DCP folder without a manifest (not written by ``raggedfsdp train``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_DESCRIPTION = (
    "Hugging Face out: write a DCP training checkpoint as a safetensors folder (model.safetensors +\n"
    "config.json) for the LLaMA model (as MixtralForCausalLM for the MoE), or as a torch.save state\n"
    "dict. convert only writes: the other way (safetensors -> training) is train --model.init_from DIR."
)


def add_parser(subparsers):
    p = subparsers.add_parser(
        "convert",
        help="convert a DCP training checkpoint to Hugging Face safetensors or a torch.save file",
        description=_DESCRIPTION,
        epilog="examples:\n  raggedfsdp convert outputs/run/checkpoints --to safetensors outputs/hf\n"
        "  raggedfsdp convert outputs/run/checkpoints/step-600 --to torch model.pt\n\n"
        "the reverse direction (LLaMA; each rank reads only its own pieces):\n"
        "  raggedfsdp train --model.init_from outputs/hf --out outputs/finetune",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a step-N DCP folder, or a folder of them (the newest is used)")
    p.add_argument("--to", required=True, choices=("safetensors", "torch"), help="output format")
    p.add_argument("out", help="output folder (safetensors) or .pt file (torch)")
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the check of every file against the checkpoint's manifest.json (SHA-256), as train's "
        "--checkpoint.verify false; for a DCP folder not written by raggedfsdp train",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="the run's config.json (default: found above the checkpoint) or name:flavor (llama:tiny)",
    )
    p.set_defaults(func=run)
    return p


def _model_config(args, step_dir: Path):
    from raggedfsdp.app.checkpoint.hf import find_run_config
    from raggedfsdp.app.models import build_model_config

    spec = args.model_config
    if spec and ":" in spec and not Path(spec).exists():
        name, _, flavor = spec.partition(":")
        return name, build_model_config(name, flavor)
    path = Path(spec) if spec else find_run_config(step_dir)
    if path is None:
        raise ValueError(
            f"no run config.json found above {str(step_dir)!r}; pass --model-config OUT/config.json or "
            "--model-config llama:FLAVOR"
        )
    try:
        run_cfg = json.loads(path.read_text())
        name = run_cfg["model"]["name"]
        from raggedfsdp.app.models import MODELS

        return name, MODELS[name][0](**run_cfg["resolved"]["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--model-config {str(path)!r}: not a raggedfsdp run config.json ({e})") from None


def run(args) -> int:
    import torch

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from raggedfsdp.app.checkpoint.dcp import open_step_folder, short_error
    from raggedfsdp.app.checkpoint.hf import read_dcp_model, write_safetensors

    def error(msg: str) -> int:
        print(f"raggedfsdp convert: error: {msg}", file=sys.stderr)
        return 2

    try:
        step_dir = open_step_folder(
            args.checkpoint, verify=args.verify, unchecked="--no-verify", train_state=False
        )
    except ValueError as e:
        return error(str(e))
    try:
        state = read_dcp_model(step_dir)
    except ValueError as e:
        return error(str(e))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's read errors (--no-verify)
        how = "check it without --no-verify" if not args.verify else "it verified: please report this"
        return error(f"cannot read checkpoint {step_dir}: {short_error(e)[:300]} ({how})")
    if args.to == "torch":
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, out)
        except (OSError, RuntimeError) as e:  # torch.save's writer raises RuntimeError for an open failure
            why = getattr(e, "strerror", None) or str(e).strip().splitlines()[-1][-200:]
            return error(f"cannot write {out}: {why} (choose a path this user can write)")
        print(
            f"wrote {len(state)} tensors ({sum(t.numel() for t in state.values()):,} params) from "
            f"{step_dir} to {out}"
        )
        return 0
    try:
        name, cfg = _model_config(args, step_dir)
    except ValueError as e:
        return error(str(e))
    if name not in ("llama", "moe"):
        return error(
            "--to safetensors supports the llama (HF LlamaForCausalLM) and moe (HF MixtralForCausalLM) "
            f"models; this checkpoint is {name!r}: use --to torch"
        )
    try:
        if (
            name == "moe"
        ):  # MixtralForCausalLM (also expert-parallel checkpoints: DCP holds the global stacks)
            from raggedfsdp.app.checkpoint.hf_moe import write_moe_safetensors

            out = write_moe_safetensors(args.out, state, cfg)
        else:
            out = write_safetensors(args.out, state, cfg)
    except ImportError:
        return error("--to safetensors needs the safetensors package: pip install 'raggedfsdp[hf]'")
    except (KeyError, ValueError) as e:
        return error(str(e))
    except OSError as e:
        return error(f"cannot write {args.out}: {e.strerror or e} (choose a path this user can write)")
    print(f"wrote {out / 'model.safetensors'} and config.json ({cfg.num_params():,} params) from {step_dir}")
    return 0
