"""What a user runs: benchmarks and backend comparison, as modules from the repository root.

    python -m scripts.bench_export ...        # GPU export benchmark (tables + PNG)
    python -m scripts.bench_save ...          # the save path side by side (torchrun); plot_bench_save: its PNG
    python -m scripts.compare_backends ...    # PortableFusedAdam vs TE's FusedAdam, every configuration

``python -m`` puts the repository root on ``sys.path``, so the scripts import ``optim_factory``, ``recipes``
and each other as packages (no ``sys.path`` edits). ``bash scripts/gpu_validate.sh`` and ``scripts/slurm/``
are shell entry points. One-off probes behind published measurements: benchmarks/probes/; fault injection, which
kills the recipe's trainers, is test infrastructure: tests/fault/.
"""
