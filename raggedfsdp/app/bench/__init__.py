"""``raggedfsdp bench``: raggedfsdp.fully_shard against torch's fully_shard on the same model, in one run.

- ``registry``: benchmarkable model families (``--model dense|moe``) and their wrapping policies;
- ``measure``: collectives, host syncs, padding, state bytes and peak memory (shared method);
- ``worker``: the per-rank benchmark (torchrun entry point);
- ``cli``: the ``raggedfsdp bench`` subcommand (argument checks, launch, report).
"""
