"""Placeholder: the `train` subcommand (being built)."""


def add_parser(sub):
    p = sub.add_parser("train", help="train a small LLaMA-style model (not built yet)")
    p.set_defaults(func=lambda a: 1)
