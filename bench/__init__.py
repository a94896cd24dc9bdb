"""Benchmarks. Run each from the repository root as a module, e.g. `python -m bench.convert --size small`;
they import streamoe like any user and write JSON results to bench/results/."""
