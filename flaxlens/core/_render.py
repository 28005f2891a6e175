"""How treescope shows flaxlens objects; the data classes hold no rendering code.

`register_handlers()` (run when `flaxlens` is imported) adds handlers for `Struct` and
`AbstractVariable` to treescope's global handler registry, which treescope searches
along the object's class and its bases: every subclass, a user's included, renders like
the class it extends. A struct renders as a call of its class with its fields, in the
color its `treescope_color()` names, leaving out the fields its class lists in
`treescope_hidden_fields`, writing those in `treescope_short_fields` in one line
(`short_text`) and those in `treescope_expanded_fields` unfolded, one item per line
(a call's `submodule_calls`: each call it makes on its own line, however many). A
variable renders as its class with its label and value, and a `ReadOnlyDict` (the dicts
of a converted tree) as the dict it reads as. No Flax internals here.
"""

from __future__ import annotations

from typing import Any

from treescope import formatting_util, rendering_parts, repr_lib, type_registries

from flaxlens.core._readonly import ReadOnlyDict
from flaxlens.core._struct import Struct
from flaxlens.core._variables import AbstractVariable


def color_for(name: str) -> str:
  """A stable treescope background color derived from a string."""
  return formatting_util.color_from_string(name)


def short_text(value: Any) -> str:
  """One line standing for a bulky value in a rendering.

  A class shows its name, a named object (a Linen module) `Dense(name='Dense_0')`, any
  other value its repr.
  """
  if isinstance(value, type):
    return value.__name__
  if hasattr(value, "name"):
    return f"{type(value).__name__}(name={value.name!r})"
  return repr(value)


class _Text:
  """A field value shown as the given text."""

  __slots__ = ("text",)

  def __init__(self, text: str):
    self.text = text


def _render_text(node: _Text, path: str | None, subtree_renderer: Any) -> Any:
  return rendering_parts.text(node.text)


class _Unfolded:
  """A field value drawn unfolded: its outermost foldable parts start expanded."""

  __slots__ = ("value",)

  def __init__(self, value: Any):
    self.value = value


def _render_unfolded(node: _Unfolded, path: str | None, subtree_renderer: Any) -> Any:
  rendering = subtree_renderer(node.value, path=path)
  for part in rendering.renderable.foldables_in_this_part():
    part.set_expand_state(rendering_parts.ExpandState.EXPANDED)
  return rendering


def _shown_as(cls: type[Struct], name: str, value: Any) -> Any:
  if name in cls.treescope_short_fields:
    return _Text(short_text(value))
  if name in cls.treescope_expanded_fields:
    return _Unfolded(value)
  return value


def _render_struct(node: Struct, path: str | None, subtree_renderer: Any) -> Any:
  cls = type(node)
  attributes = {
    name: _shown_as(cls, name, value)
    for name, value in node.attributes_dict().items()
    if name not in cls.treescope_hidden_fields
  }
  return repr_lib.render_object_constructor(
    object_type=cls,
    attributes=attributes,
    path=path,
    subtree_renderer=subtree_renderer,
    roundtrippable=False,
    color=node.treescope_color(),
  )


def _render_variable(variable: AbstractVariable, path: str | None, subtree_renderer: Any) -> Any:
  return repr_lib.render_object_constructor(
    object_type=type(variable),
    attributes={"label": variable.label, "value": variable.value},
    path=path,
    subtree_renderer=subtree_renderer,
    color=variable.treescope_color(),
  )


def _render_read_only_dict(node: ReadOnlyDict, path: str | None, subtree_renderer: Any) -> Any:
  return subtree_renderer(dict(node), path=path)  # Shown as the dict it reads as.


def register_handlers() -> None:
  """Registers the treescope handlers of flaxlens's base classes."""
  registry = type_registries.TREESCOPE_HANDLER_REGISTRY
  registry[Struct] = _render_struct
  registry[AbstractVariable] = _render_variable
  registry[_Text] = _render_text
  registry[_Unfolded] = _render_unfolded
  registry[ReadOnlyDict] = _render_read_only_dict
