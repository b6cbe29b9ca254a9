"""What an attacker who can write into a checkpoint's folder plants (docs/reliability.md, "Trust"): a pickled
object whose unpickling runs a command that creates a marker file, as ``.metadata`` or as an item's value."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


class RunsACommand:
    """Unpickled by ``pickle.load`` or ``torch.load(weights_only=False)``, it runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_metadata(folder: Path, marker: Path) -> None:
    """Replace ``folder/.metadata`` by a pickle that runs a command when it is read."""
    (Path(folder) / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))


def move_storage(folder: Path, relative: str) -> None:
    """Point every item of ``folder/.metadata`` at ``relative`` (a path that may leave the folder), rewritten with
    DCP's own types only."""
    path = Path(folder) / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # written by this test: trusted
    for info in metadata.storage_data.values():
        info.relative_path = relative
    path.write_bytes(pickle.dumps(metadata))
