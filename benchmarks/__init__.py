"""Benchmarks and profilers, run from a checkout (`python -m benchmarks.<name>`); not part of the installed package.

Each prints its table and writes a JSON document; figures live in those documents, never in tests.
"""
