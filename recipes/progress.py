"""Console progress for the recipe: a tqdm bar when tqdm is installed, the log lines alone otherwise.

tqdm is optional (the ``dev`` extra installs it; the base install does not). Without it the recipe runs the
same; ``trainer.progress=true`` then logs one warning saying so, and the loop's log lines (every
``trainer.log_every`` steps) are the progress. By default (``trainer.progress=null``) the bar is shown only
when stderr is a terminal, so that output piped to a file holds log lines, not bar frames.
"""

from __future__ import annotations

import logging
import sys

try:
    from tqdm import tqdm
except ImportError:  # not installed (or made unimportable): no bar
    tqdm = None

log = logging.getLogger("recipes.train")


class ConsoleHandler(logging.StreamHandler):
    """Console logging (stderr) that does not tear the rank-0 progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        if tqdm is None:
            super().emit(record)
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001
            self.handleError(record)


class NoBar:
    """What :func:`progress_bar` returns without tqdm: the bar's methods that the loop calls, doing nothing."""

    def set_postfix(self, **values) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(*, total: int, initial: int, enabled: bool | None):
    """A tqdm bar over the steps (shown when ``enabled``; ``None``: when stderr is a terminal), or a
    :class:`NoBar` when tqdm is not installed."""
    if tqdm is None:
        if enabled:
            log.warning(
                "trainer.progress=true: no progress bar, tqdm is not installed (pip install tqdm); "
                "progress is in the log lines every trainer.log_every steps"
            )
        return NoBar()
    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", dynamic_ncols=True, file=sys.stderr)
