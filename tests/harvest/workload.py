"""The harvest a subprocess runs (and is killed in) in the resume test: run as
`python workload.py PATH FRAMEWORK`, it harvests `BATCHES` token batches of `models.build`,
slowly after the first ones, so that the test can kill it mid-run."""

from __future__ import annotations

import sys
import time

import flaxlens as fl

try:
  from . import models
except ImportError:  # run as a script
  import models

BATCHES = 12


def batches(slow_after: int | None = None):
  """The stream; from batch `slow_after` on, each takes a while to load."""
  for number, tokens in enumerate(models.token_batches(BATCHES, last=2)):
    if slow_after is not None and number >= slow_after:
      time.sleep(0.5)
    yield tokens


def harvest(path: str, framework: str, stream) -> fl.Harvest:
  model = models.build(framework)
  return fl.harvest(
    model.tree,
    stream,
    model.sites,
    path,
    positions={model.sites[0]: "all", "**": models.not_padding},
    ids=models.token_ids,
    progress=False,
  )


if __name__ == "__main__":
  harvest(sys.argv[1], sys.argv[2], batches(slow_after=3))
