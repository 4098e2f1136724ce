"""Processes: the per-rank entry point under torchrun (``worker``), one-line errors and the root-cause
rank of a failed job (``failures``), cores per rank and the default out folder (``env``), and the
collective shutdown of a process group (``teardown``)."""
