"""Offline what-if on real-size models: nothing allocated, no process group (memory, step time)."""
