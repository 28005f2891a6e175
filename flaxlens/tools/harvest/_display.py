"""`fl.harvest`'s progress bar (batches, examples, tokens/s, bytes written) on stderr, drawn
by rich; apart from the harvest's state, which only reports to it. No Flax internals here.
"""

from __future__ import annotations

import sys
import time


class Display:
  """A rich progress bar (batches, examples, tokens/s, bytes written) or nothing."""

  def __init__(self, show: bool, total: int | None, committed: int):
    self._progress = None
    self._start = time.perf_counter()
    self._tokens = 0
    if not show:
      return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    self._progress = Progress(
      TextColumn("harvest"),
      BarColumn(),
      TextColumn("{task.completed}/{task.total} batches" if total else "{task.completed} batches"),
      TextColumn("{task.fields[examples]} examples"),
      TextColumn("{task.fields[rate]} tok/s"),
      TextColumn("{task.fields[size]}"),
      TimeElapsedColumn(),
      console=Console(file=sys.stderr),
    )
    self._task = self._progress.add_task(
      "harvest", total=total, completed=committed, examples=0, rate="-", size="0 B"
    )
    self._progress.start()

  def update(self, batches: int, examples: int, tokens: int, size: int) -> None:
    """Shows `batches` and `examples` done, `tokens` more and `size` bytes written."""
    if self._progress is None:
      return
    self._tokens += tokens
    rate = self._tokens / max(time.perf_counter() - self._start, 1e-9)
    self._progress.update(
      self._task, completed=batches, examples=examples, rate=f"{rate:,.0f}", size=_bytes_text(size)
    )

  def close(self) -> None:
    """Stops the bar (it stays on the terminal as it last was)."""
    if self._progress is not None:
      self._progress.stop()


def _bytes_text(size: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if size < 1024 or unit == "GiB":
      return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
    size /= 1024
  return f"{size:.1f} TiB"
