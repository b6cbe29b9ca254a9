"""What one checkpoint cost: the export report, logged and written to the run's metrics (docs/recipe.md,
"Export report")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class ExportReport:
    """What one checkpoint export cost."""

    step: int
    path: str
    export_s: float
    export_bytes: int
    gpu_peak_mib: float | None
    save_s: float
    async_save: bool
    flatten: bool
    # deferred: an async save whose call returned before its background export was filled, the loop's next forward
    # and backward running beside the fill (recipes/checkpoint/save.py, Saver.defers)
    deferred: bool = False
    # Known once the save is complete (async: when it is awaited); None until then, and if it failed.
    # blocking_s: how long the training loop was held by this checkpoint (docs/recipe.md, "Export report").
    blocking_s: float | None = None
    # written_bytes: the bytes of the files DCP wrote for it (all ranks' .distcp files and .metadata, as recorded
    # by the checksumming writer); rank 0 gathers them, other ranks report None.
    written_bytes: int | None = None
    # host_bytes: the host memory the save held at its peak for what it wrote: the export's host buffers and the
    # host copies made for the write (docs/recipe.md, "Export report"); the live states are not counted.
    host_bytes: int | None = None

    @property
    def export_gbps(self) -> float:
        """The export's GB/s: its bytes over its seconds (0 where no time was measured)."""
        return self.export_bytes / self.export_s / 1e9 if self.export_s > 0 else 0.0

    def record(self) -> dict[str, Any]:
        """Every field and ``export_gbps``: the checkpoint's record in ``metrics.jsonl`` and in its manifest."""
        return {**asdict(self), "export_gbps": self.export_gbps}

    def summary(self) -> dict[str, Any]:
        """The fields of the end-of-run summary's ``checkpoints`` list."""
        return {
            "step": self.step,
            "blocking_s": self.blocking_s,
            "written_bytes": self.written_bytes,
            "host_bytes": self.host_bytes,
        }

    def line(self) -> str:
        """The log line of a finished save."""
        peak = "n/a (CPU)" if self.gpu_peak_mib is None else f"{self.gpu_peak_mib:.1f} MiB"
        written = "" if self.written_bytes is None else f", wrote {self.written_bytes / 1e6:.2f} MB"
        staging = " (async staging)" if self.async_save else ""
        staging = " (async staging, the export filled beside the next step)" if self.deferred else staging
        host = "n/a" if self.host_bytes is None else f"{self.host_bytes / 1e6:.2f} MB"
        return (
            f"checkpoint step {self.step}: optimizer export {self.export_s:.3f} s, {self.export_bytes / 1e6:.2f} MB, "
            f"{self.export_gbps:.3f} GB/s, GPU peak {peak}, host peak {host}; save {self.save_s:.3f} s{staging}; "
            f"blocked training {self.blocking_s:.3f} s{written} -> {self.path}"
        )
