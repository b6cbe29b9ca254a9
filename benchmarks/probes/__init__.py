"""One-off probes behind measurements in benchmarks/results/ (benchmarks/probes/README.md): run as modules from
the repository root (``python -m benchmarks.probes.<name> ...``). They are not part of the product or its tests."""
