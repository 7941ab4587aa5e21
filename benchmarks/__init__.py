"""Benchmarks: run each as ``python -m benchmarks.<name>`` from the repository root.

Each benchmark keeps its measuring part in a function that returns plain dicts and
lists (``results`` in most; ``simulated`` and ``measured_times`` in bench_bapp;
``measure`` and ``CHECKS`` in bench_closed_forms), and its ``main`` prints a table from
them. ``python -m benchmarks.reproduce`` calls the same functions and gathers every
comparison with a published figure into one table.
"""
