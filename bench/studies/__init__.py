"""One-off studies: each answered one question, and its result and exact command are recorded in docs/studies.md.

They are kept here while they still run (``python -m bench.studies.NAME``; tests/test_bench.py checks that each
imports and that docs/studies.md has its section); a study that can no longer run is deleted, and docs/studies.md
names the commit it ran at.  The maintained benchmarks are the modules of :mod:`bench` itself.
"""
