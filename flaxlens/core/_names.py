"""Variable names: a path of keys written as one string, as RFC 6901 (JSON Pointer) does.

A variable is found by a path of keys (module names, then the variable's own name). Flax
treats each key as opaque, and some contain "/" (`nn.WeightNorm` stores
`"Dense_0/kernel/scale"` as one name), so keys are joined with "/" after writing "~" as
"~0" and "/" as "~1" inside each key. A name without "~" or "/" in its keys reads as
the plain path (`"Dense_0/kernel"`); `split_name` inverts `join_name` exactly. No Flax
internals here.
"""

from __future__ import annotations

from typing import Any

Path = tuple[Any, ...]  # A module path: attribute names, and list indices for NNX.
CallKey = tuple[int, str]  # A call within its caller: `(call_index, "Child.method")`.


def join_name(path: tuple[Any, ...]) -> str:
  """The name of the variable at `path` (keys joined by "/", "~" and "/" in keys escaped).

  Example:
    >>> from flaxlens.core._names import join_name
    >>> join_name(("Dense_0", "kernel")), join_name(("Dense_0/kernel/scale",))
    ('Dense_0/kernel', 'Dense_0~1kernel~1scale')
  """
  return "/".join(str(key).replace("~", "~0").replace("/", "~1") for key in path)


def split_name(name: str) -> tuple[str, ...]:
  """The path of keys a name written by `join_name` stands for (keys as strings).

  Example:
    >>> from flaxlens.core._names import split_name
    >>> split_name("WeightNorm_0/Dense_0~1kernel~1scale")
    ('WeightNorm_0', 'Dense_0/kernel/scale')
  """
  return tuple(key.replace("~1", "/").replace("~0", "~") for key in name.split("/"))
