"""Explaining a call of a tree, or a conversion, that failed inside the model's own code.

When the native run of a tree raises something other than a `FlaxlensError` (an
`IndexError` from token ids of another rank, a broadcasting error from a sequence longer
than a positional table), `explain` makes the `ModelCallError` that `run_tree` raises
from it: the message names the tree's call, the innermost converted call that was running
(read from the traceback by `_calls.failed_call`), and the shapes and dtypes conversion
saw (`CallSpec`s kept on the nodes) and the call passed. Nothing is checked or recorded
while a run succeeds. An error raised by a replacement layer is the layer's own and is
not explained. A conversion whose run of the model fails on the example arguments is
explained the same way (`explain_conversion`), naming the call being converted. No Flax
internals here.
"""

from __future__ import annotations

from typing import Any

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._call_record import CallRecord
from flaxlens.core._calls import converting_call, failed_call
from flaxlens.core._node import CallNode
from flaxlens.core._spec import show_arguments, signature
from flaxlens.errors import FlaxlensError, ModelCallError, error_text, model_call_error


def explain(root: CallNode, argument: ArgsAndKwargs, error: Exception) -> ModelCallError | None:
  """The `ModelCallError` to raise from `error`, which a run of `root` raised; None to
  let `error` pass as it is (a `FlaxlensError`, or an error of a replacement layer)."""
  if isinstance(error, FlaxlensError):
    return None
  site = failed_call(error.__traceback__)
  if site is not None and site[0] == "replacement":
    return None
  try:
    message = _message(root, argument, error, site)
  except Exception:  # Describing must never hide the error itself.
    return None
  return model_call_error(type(error), message)


def explain_conversion(
  root: CallRecord, example: ArgsAndKwargs, error: Exception
) -> ModelCallError | None:
  """The `ModelCallError` to raise from `error`, which converting `root` on `example`
  raised in the model's own code; None to let `error` pass (a `FlaxlensError`)."""
  if isinstance(error, FlaxlensError):
    return None
  try:
    site = converting_call(error.__traceback__)
    now = show_arguments(signature((tuple(example.args), dict(example.kwargs))))
    text = (
      f"unflaxify({root.where()}): conversion runs the model once on the example"
      " arguments, and the model's own code failed"
      f"{f' in {site[0].where()}' if site is not None else ''} ({error_text(error)})."
      f" {root.where()} got {now}"
    )
    if site is not None:
      inner = show_arguments(signature((tuple(site[1] or ()), dict(site[2] or {}))))
      text += f", and {site[0].where()} got {inner}"
  except Exception:  # Describing must never hide the error itself.
    return None
  return model_call_error(
    type(error),
    text + ". Convert with example arguments the model accepts: check that the model itself"
    " runs on them (Linen: module.apply(variables, *args); NNX: model(*args)).",
  )


def _message(root: CallNode, argument: ArgsAndKwargs, error: Exception, site: tuple | None) -> str:
  now = signature((tuple(argument.args), dict(argument.kwargs)))
  seen = _seen(root)
  inner = site[1] if site is not None and site[1] is not root else None
  said = error_text(error)
  text = (
    f"{root.where()}: this call failed inside the model's own code"
    f"{f', in {inner.where()}' if inner is not None else ''} ({said})."
    f" {_compared(root, seen, now)}"
  )
  if inner is not None:
    inner_seen = _seen(inner)
    inner_now = signature((tuple(site[2] or ()), dict(site[3] or {})))
    text += f" {_compared(inner, inner_seen, inner_now)}"
  if seen is None:
    return text + " Call the tree with arguments the native model accepts."
  if _same(seen, now):
    return text + (
      " The tree's call has the argument shapes and dtypes conversion saw, so the model may"
      " refuse the values of its arguments or of the tree's variables (an edit of another"
      " shape or dtype): check that the native model runs on them (tree.export())."
    )
  return text + (
    " Call the tree with arguments like those at conversion, or others the native model"
    " accepts, or convert it with example arguments like these."
  )


def _seen(node: Any) -> Any:
  """The arguments conversion saw `node` called with (a `signature`), if it kept them."""
  spec = getattr(node, "own_spec", None)
  return spec.inputs if spec is not None else None


def _compared(node: Any, seen: Any, now: Any) -> str:
  if seen is None:
    return f"{node.where()} got {show_arguments(now)}."
  if _same(seen, now):
    return f"{node.where()} got {show_arguments(now)}, as at conversion."
  return f"{node.where()} got {show_arguments(now)}; at conversion it got {show_arguments(seen)}."


def _same(a: Any, b: Any) -> bool:
  try:
    return bool(a == b)
  except Exception:
    return False
