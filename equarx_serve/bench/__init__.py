"""Benchmarks behind `equarx-serve bench` (see `allreduce.py`)."""
