"""Benchmarks: detctx against the tools users would pick instead.

Run them all with ``python benchmarks/run_all.py --out benchmarks/RESULTS.md``.
Each scenario lives in its own module and returns table rows; a scenario whose
API is missing from this build reports "not available" instead of failing.
"""
