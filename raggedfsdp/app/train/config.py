"""Training configuration: loading it from defaults, TOML files / presets and command-line overrides.

Precedence: command line > ``--config FILE.toml|PRESET`` > the defaults (the dataclasses of
:mod:`raggedfsdp.app.train.config_schema`, re-exported here: ``from raggedfsdp.app.train.config import
TrainConfig`` is the public path).

Every field can be set in TOML under its section (``[training] steps = 100``) and on the command
line as ``--section.key VALUE`` (``--training.steps 100``); the common ones also have a short flag
(``--steps 100``). Unknown sections and keys are a ``ValueError`` naming the valid ones, so typos do
not go unnoticed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import typing
from typing import Any

from raggedfsdp.app.train.config_schema import (
    CheckpointConfig,
    DataConfig,
    DebugConfig,
    FSDPConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    TrainingConfig,
)

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
    "add_config_args",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "override_argv",
    "overrides_from_args",
]


# -- schema helpers ----------------------------------------------------------------------------


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _section_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _base_type(tp: Any) -> tuple[type, bool]:
    """``(type, optional)`` of a field annotation such as ``int`` or ``int | None``."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return inner, True
    return tp, False


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert a TOML value (or a command-line string) to the field's type."""
    base, optional = _base_type(tp)
    if isinstance(value, str) and base is not str:
        return _parse_str(value, base, where)
    if base is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be a boolean, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp} for {where}")


def _parse_str(text: str, base: type, where: str) -> Any:
    try:
        if base is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(text.replace("_", ""))
        if base is float:
            return float(text)
    except ValueError:
        kind = {bool: "a boolean (true/false)", int: "an integer", float: "a number"}[base]
        raise ValueError(f"{where} must be {kind}, got {text!r}") from None
    raise AssertionError(f"unsupported config type {base} for {where}")


def config_from_dict(data: dict[str, Any], *, source: str = "config") -> TrainConfig:
    """Build a ``TrainConfig`` from nested ``{section: {key: value}}``; strict about names and types."""
    sections = _sections()
    cfg = TrainConfig()
    for sec_name, values in data.items():
        if sec_name not in sections:
            raise ValueError(f"unknown section [{sec_name}] in {source}; valid sections: {sorted(sections)}")
        if not isinstance(values, dict):
            raise ValueError(f"[{sec_name}] in {source} must be a table, got {values!r}")
        fields_ = _section_fields(sections[sec_name])
        section = getattr(cfg, sec_name)
        for key, value in values.items():
            if key not in fields_:
                raise ValueError(
                    f"unknown key {key!r} in [{sec_name}] of {source}; valid keys: {sorted(fields_)}"
                )
            setattr(section, key, _coerce(value, fields_[key][1], f"{sec_name}.{key}"))
    return cfg


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Apply ``{"section.key": value}`` (values may be strings from the command line) in place."""
    sections = _sections()
    for path, value in overrides.items():
        sec_name, _, key = path.partition(".")
        if sec_name not in sections or not key:
            raise ValueError(f"unknown config option {path!r}; valid sections: {sorted(sections)}")
        fields_ = _section_fields(sections[sec_name])
        if key not in fields_:
            raise ValueError(f"unknown config option {path!r}; valid keys of [{sec_name}]: {sorted(fields_)}")
        setattr(getattr(cfg, sec_name), key, _coerce(value, fields_[key][1], path))
    return cfg


def load_config(
    path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None, *, validate: bool = True
) -> TrainConfig:
    """Defaults, then the TOML file at ``path`` or the preset of that name (if any; see
    :mod:`raggedfsdp.app.train.presets`), then ``overrides``; validated (no world size) unless
    ``validate=False`` (the launcher and the worker validate once, for the world size, in
    ``train.run_dir.prepare``)."""
    if path:
        from raggedfsdp.app.train.presets import PRESETS, trainable_config

        if str(path) in PRESETS and not os.path.exists(path):
            cfg = config_from_dict(trainable_config(str(path)), source=f"preset {path!r}")
        else:
            try:
                with open(path, "rb") as fh:
                    data = tomllib.load(fh)
            except FileNotFoundError:
                raise ValueError(
                    f"config file not found: {path} (and not a preset: {', '.join(PRESETS)}; "
                    "see --config list)"
                ) from None
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"invalid TOML in {path}: {e}") from None
            cfg = config_from_dict(data, source=str(path))
    else:
        cfg = TrainConfig()
    apply_overrides(cfg, overrides or {})
    if validate:
        cfg.validate()
    return cfg


# -- command line ------------------------------------------------------------------------------


class _ConfigAction(argparse.Action):
    """``--config list`` prints the presets and exits; anything else is stored."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values == "list":
            from raggedfsdp.app.train.presets import format_presets

            print(format_presets())
            parser.exit(0)
        setattr(namespace, self.dest, values)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one ``--section.key`` option per field (plus the short aliases)."""
    parser.add_argument(
        "--config",
        metavar="FILE.toml|NAME",
        default=None,
        action=_ConfigAction,
        help="TOML config file or a shipped preset (debug, llama-tiny, hybrid-tiny, moe-tiny, llama3-8b; "
        "'--config list' describes them)",
    )
    for sec_name, sec_cls in _sections().items():
        group = parser.add_argument_group(f"[{sec_name}]") if sec_name != "debug" else parser
        defaults = sec_cls()
        for key, (fld, tp) in _section_fields(sec_cls).items():
            base, _ = _base_type(tp)
            flags = [f"--{sec_name}.{key}"]
            if fld.metadata.get("flag"):
                flags.insert(0, fld.metadata["flag"])
            if fld.metadata.get("hidden"):
                help_ = argparse.SUPPRESS
            else:
                help_ = f"{fld.metadata['help']} (default: {getattr(defaults, key)!r})"
            metavar = {bool: "BOOL", int: "N", float: "X", str: "STR"}[base]
            group.add_argument(*flags, dest=f"{sec_name}.{key}", default=None, metavar=metavar, help=help_)


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The ``{"section.key": raw string}`` options given on the command line."""
    out = {}
    for sec_name, sec_cls in _sections().items():
        for key in _section_fields(sec_cls):
            value = getattr(args, f"{sec_name}.{key}", None)
            if value is not None:
                out[f"{sec_name}.{key}"] = value
    return out


def override_argv(config_path: str | None, overrides: dict[str, Any]) -> list[str]:
    """Command-line arguments that reproduce ``config_path`` + ``overrides`` (for the worker)."""
    argv = ["--config", str(config_path)] if config_path else []
    for path, value in overrides.items():
        argv.append(f"--{path}={value}")
    return argv
