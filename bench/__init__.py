"""prismdp's benchmarks (run ``python -m bench --help`` from the repository root)."""
