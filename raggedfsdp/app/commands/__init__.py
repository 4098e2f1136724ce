"""The subcommands of the ``raggedfsdp`` console script, one module each (``add_parser(sub)``
registers the subparser and sets ``func``, called with the parsed namespace and returning an exit
code). :data:`COMMANDS` is the one list ``raggedfsdp/app/cli.py`` registers from, in ``--help`` order.
Importing a command module and its ``add_parser`` import no torch (``--help`` stays fast).
"""

COMMANDS = (
    "train",
    "plot",
    "plan",
    "bench",
    "estimate_memory",
    "estimate_time",
    "convert",
    "tokenize",
    "wrap_bench",
)
