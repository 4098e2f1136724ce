"""The application on top of the library: models, checkpoints, the training job, its launcher,
offline sizing, benchmarks and the ``raggedfsdp`` command line.

The library (``raggedfsdp.placement`` / ``planner`` / ``buffer`` / ``fsdp`` / ``optim``) needs torch
alone and never imports this package; this package uses the library's public names only
(``tests/unit/test_layering.py`` checks both).
"""
