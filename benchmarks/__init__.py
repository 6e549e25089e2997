"""Measurements: the side-by-side benchmark (runner, worker, report, plots), the network testbed,
the LoCo quality check and micro-benchmarks. ``benchmarks/modes.py`` holds the one mode table."""
