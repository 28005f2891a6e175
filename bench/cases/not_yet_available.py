"""Cases 5 and 6: targets whose flaxlens API does not exist yet, shown as such.

Capturing every intermediate and changing intervention values without recompiling need
the capture and intervention tools of issue 12; until a case module measures them, the
report lists their targets with the verdict "not yet available".
"""

from __future__ import annotations

from bench.harness import Progress
from bench.models import Sizes
from bench.report import Row
from bench.subjects import Subject
from bench.targets import TARGETS


def measure(subjects: list[Subject], sizes: Sizes, progress: Progress) -> list[Row]:
  return [
    Row(
      "5. capture everything",
      TARGETS["capture_everything"].what,
      "capture_everything",
      status="not yet available",
      note="flaxlens has no capture API yet",
    ),
    Row(
      "6. recompiles",
      TARGETS["recompiles"].what,
      "recompiles",
      status="not yet available",
      note="flaxlens has no intervention API yet",
    ),
  ]
