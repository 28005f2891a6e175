"""The rng state of a Linen scope: read, restored, and written as data.

Checked with flax 0.12.6–0.12.8. A `flax.core.scope.Scope` holds one
`flax.core.scope.LazyRng` per stream (`rng`: a key, `suffix`: the names folded in
lazily) in `Scope.rngs`, and in `Scope.rng_counters` how many keys it has drawn per
stream, plus the counter dicts of the child scopes it has pushed, keyed
`(flax.core.scope.child_rng_token, name)` and reused when a child is pushed again.
Restoring all three reproduces `make_rng` exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import flax.linen as nn

from flaxlens._compat import Internal

LAZY_RNG = Internal("flax.core.scope", "LazyRng")
CHILD_RNG_TOKEN = Internal("flax.core.scope", "child_rng_token")

RngSnapshot = tuple[dict[str, Any], dict[str, tuple], dict]  # (keys, suffixes, counters)


def rng_snapshot(module: nn.Module) -> RngSnapshot:
  """The rng state of a bound module's scope: `(keys, suffixes, counters)`."""
  lazy = LAZY_RNG()
  keys, suffixes = {}, {}
  for name, rng in module.scope.rngs.items():
    keys[name] = rng.rng if isinstance(rng, lazy) else rng
    suffixes[name] = tuple(rng.suffix) if isinstance(rng, lazy) else ()
  return keys, suffixes, copy_counters(module.scope.rng_counters)


def lazy_rngs(keys: dict[str, Any], suffixes: dict[str, tuple]) -> dict[str, Any]:
  """The `rngs` of a scope whose streams hold `keys` with `suffixes` still to fold in."""
  lazy = LAZY_RNG()
  return {name: lazy(keys[name], tuple(suffixes[name])) for name in keys}


def restore_counters(scope: Any, counters: dict) -> None:
  """Sets a scope's rng counters to a copy of `counters` (from `rng_snapshot`)."""
  scope.rng_counters = copy_counters(counters)


def restore_pushed(parent: Any, scope: Any, name: str, snapshot: RngSnapshot) -> None:
  """Gives `scope`, pushed from `parent` as `name`, the rng state of `snapshot`.

  The parent's counters keep the child's, as `Scope.push` would have left them.
  """
  keys, suffixes, counters = snapshot
  scope.rngs = lazy_rngs(keys, suffixes)
  restore_counters(scope, counters)
  parent.rng_counters[(CHILD_RNG_TOKEN(), name)] = scope.rng_counters


def counters_to_data(counters: dict) -> list:
  """Scope rng counters as JSON-able data: `[[name, count] | ["child", name, [...]]]`."""
  token = CHILD_RNG_TOKEN()
  data = []
  for key, value in counters.items():
    if isinstance(key, tuple) and key and key[0] is token:
      data.append(["child", key[1], counters_to_data(value)])
    else:
      data.append([key, value])
  return data


def counters_from_data(data: list) -> dict:
  """Inverse of `counters_to_data`."""
  counters: dict = {}
  for entry in data:
    if entry[0] == "child" and len(entry) == 3:
      counters[(CHILD_RNG_TOKEN(), entry[1])] = counters_from_data(entry[2])
    else:
      counters[entry[0]] = entry[1]
  return counters


def copy_counters(counters: dict) -> dict:
  """A deep copy of scope rng counters that keeps Flax's child token itself."""
  token = CHILD_RNG_TOKEN()
  return copy.deepcopy(counters, memo={id(token): token})
