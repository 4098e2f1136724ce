"""Offline what-if on real-size models, nothing allocated: parameter tables by FSDP unit (``archs``),
whole-model plans (``modelplan``), the unit-size search (``autounit``), the memory estimator
(``memory_estimate``), expert-parallel splits (``ep``), the step-time model (``steptime``, its
cluster presets in ``clusters``), and ONE model resolver (``registry.resolve``) behind
``raggedfsdp plan``, ``raggedfsdp estimate-memory`` and ``raggedfsdp estimate-time``."""
