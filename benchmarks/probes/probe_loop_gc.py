"""The generation-2 garbage collections of one recipe run, from its first save on: when each ran and how long it
held every thread (``gc.callbacks``), and when each save began (its ``on_phase`` callback).

    python -m benchmarks.probes.probe_loop_gc trainer.max_steps=400 checkpoint.every_steps=20 checkpoint.async_save=true

The overrides are the recipe's (``recipes/train.py``); the run directory is a fresh temporary one. It runs
``recipes.job.train`` in this process with the process's thread count (set ``OMP_NUM_THREADS`` to compare). It
uses the recipe's public entry points only, so the same command measures another tree (a worktree of an older
commit, this file copied in): docs/recipe.md, "Garbage collection", compares the loop with and without its
setup frozen out of the collector this way.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    from recipes.job import train
    from recipes.train import compose_config

    overrides = list(sys.argv[1:] if argv is None else argv)
    pauses: list[tuple[float, float]] = []  # (start, ms), seconds since the run began
    saves: list[float] = []
    start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2 and phase == "start":
            start[0] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append((start[0] - t0, (time.perf_counter() - start[0]) * 1e3))

    frozen: list[int] = []  # objects frozen out of the collector at each save

    def on_phase(phase: str, step: int, path) -> None:
        if phase == "export":  # the first of a save's points
            saves.append(time.perf_counter() - t0)
            frozen.append(gc.get_freeze_count())

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose_config([*overrides, f"run_dir={run_dir}", "trainer.progress=false"])
        gc.callbacks.append(on_gc)
        t0 = time.perf_counter()
        try:
            train(cfg, on_phase=on_phase)
        finally:
            gc.callbacks.remove(on_gc)
    loop = [(at, ms) for at, ms in pauses if saves and at >= saves[0]]
    print(f"saves: {len(saves)}, the first at {saves[0]:.2f} s" if saves else "saves: none")
    shown = [(round(at, 2), round(ms, 1)) for at, ms in loop]
    print("generation-2 collections from the first save on (start s, ms):", shown)
    print(f"objects frozen out of the collector at the first save: {frozen[0] if frozen else None}")


if __name__ == "__main__":
    main()
