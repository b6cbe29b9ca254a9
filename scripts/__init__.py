"""Benchmarks, probes and fault injection, run as modules from the repository root.

    python -m scripts.bench_export ...        # GPU export benchmark (tables + PNG)
    python -m scripts.probe_host_memory ...   # host memory costs behind the export modes
    python -m scripts.fault_injection ...     # kill -9 trials against checkpoint/resume

``python -m`` puts the repository root on ``sys.path``, so the scripts import ``optim_factory``, ``recipes``
and each other as packages (no ``sys.path`` edits). ``bash scripts/gpu_validate.sh`` and ``scripts/slurm/``
are shell entry points.
"""
