"""Offline what-if on real-size models, nothing allocated: parameter tables by FSDP unit (``archs``),
whole-model plans (``modelplan``), the unit-size search (``autounit``), the memory estimator
(``memory_estimate``), expert-parallel splits (``ep``), and ONE model resolver (``registry.resolve``)
behind ``raggedfsdp plan`` and ``raggedfsdp estimate-memory``."""
