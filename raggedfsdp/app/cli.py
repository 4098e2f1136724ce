"""Console script ``raggedfsdp``: the argparse root over ``raggedfsdp/app/commands/*``.

Each subcommand lives in its own module of :mod:`raggedfsdp.app.commands` exposing
``add_parser(subparsers)``, which registers the subparser and sets ``func`` (called with the parsed
namespace, returning an exit code); they are registered from the one list ``COMMANDS``.
``--version`` and ``--help`` import no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from raggedfsdp.app.commands import COMMANDS


def _version() -> str:
    """The installed distribution's version, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raggedfsdp")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE; see PROG --help``
    (argparse prints the whole usage first, ~100 lines for ``train``). Exits with code 2, as argparse.
    Subparsers inherit the class (``add_subparsers`` uses ``type(self)``)."""

    def error(self, message: str):
        hint = f"see {self.prog} --help"
        if hint not in message:
            message = f"{message}; {hint}"
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="raggedfsdp",
        description="raggedfsdp: FSDP on RaggedShard DTensors with a structure-aware planner and DBuffers",
    )
    parser.add_argument("--version", action="version", version=f"raggedfsdp {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"raggedfsdp.app.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_ = sys.argv[1:] if argv is None else argv
    if args_[:1] == ["--version"]:  # answered before the subcommands (and torch) are imported
        print(f"raggedfsdp {_version()}")
        return 0
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_flags(parser, args.command, extras)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:
        if e.name != "numpy":
            raise
        # the library needs torch alone; the application (data, sizing) needs numpy too
        print(
            f"raggedfsdp {args.command}: error: the raggedfsdp application needs numpy, which is not "
            "installed here: pip install numpy (or pip install -e . without --no-deps)",
            file=sys.stderr,
        )
        return 2


def _unknown_flags(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> None:
    """argparse's "unrecognized arguments" error, with the closest flags of the subcommand as a hint,
    as one line (no usage block). Exits with code 2 (argparse's)."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    known = [o for o in sub._option_string_actions if o.startswith("--")]
    hints = []
    for flag in extras:
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=3, cutoff=0.6)
            if close:
                hints.append(f"{flag.split('=', 1)[0]}: did you mean {' or '.join(close)}?")
    msg = "unrecognized arguments: " + " ".join(extras)
    if hints:
        msg += " (" + "; ".join(hints) + ")"
    sub.error(msg)


if __name__ == "__main__":
    sys.exit(main())
