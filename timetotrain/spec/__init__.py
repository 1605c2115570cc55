"""What a benchmark is, as declarations every layer above may read: `Benchmark`, `Tier`, `Optimizer`,
`BaseRecipe` (benchmark.py), the `Task` interface the harness calls (task.py), the facts of the official
MLPerf benchmarks (official.py) and the registry that loads a declaration by name (registry.py)."""
