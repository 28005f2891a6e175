"""Many runs of one program that differ in a few inputs each, sharing what they share.

A sweep runs one program (a patched forward and its metric) once per unit, each unit
changing the inputs of one *owner* (a site) away from their base values. Every value the
program computes that does not depend on a unit's owner's inputs is the value it has in
the base run (the program with every input at its base value). `mapped_over_units`
traces the program once, finds by dataflow which owners each of its equations depends
on, and cuts it into pieces of consecutive equations: the base run is computed once, and
then, unit by unit (`jax.lax.map`), each piece either runs (when it depends on the unit's
owner) or hands on its values from the base run (`jax.lax.cond`), so XLA runs, for each
unit, only what comes after its owner. In a sweep over L blocks in execution order, that
is about (L + 1) / 2 blocks per patched forward instead of L.

The pieces, the base run and the loop are one program, compiled once; the arithmetic of
each unit's run is that of the single patched program, at its shapes (units are not
batched together). The jaxpr is read and cut through `_compat/jaxprs.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens._compat import jaxprs

# A piece is cut where the set of owners its equations depend on changes; pieces past
# this many (per owner) are merged with their neighbours, each cond costing a dispatch.
_PIECES_PER_OWNER = 4


@dataclasses.dataclass(frozen=True)
class _Piece:
  eqns: tuple[Any, ...]
  owners: frozenset[int]  # the owners whose units run this piece
  inputs: tuple[Any, ...]  # variables read, defined before the piece
  outputs: tuple[Any, ...]  # variables defined here and read after it


def _dependencies(jaxpr: Any, owner_of_input: Sequence[int]) -> list[frozenset[int]]:
  """For each equation of `jaxpr`, the owners whose inputs its outputs depend on."""
  owners: dict[Any, frozenset[int]] = {
    v: frozenset((o,)) for v, o in zip(jaxpr.invars, owner_of_input, strict=True)
  }
  none: frozenset[int] = frozenset()
  out = []
  for eqn in jaxpr.eqns:
    found = none.union(*(owners.get(a, none) for a in eqn.invars if not jaxprs.is_literal(a)))
    for v in eqn.outvars:
      owners[v] = found
    out.append(found)
  return out


def _pieces(jaxpr: Any, depends: list[frozenset[int]], count: int) -> list[_Piece]:
  """The pieces of `jaxpr` the units run: consecutive equations depending on owners (an
  equation depending on none runs in the base run only)."""
  groups = []
  for eqn, owners in zip(jaxpr.eqns, depends, strict=True):
    if not owners:
      continue
    if groups and owners <= groups[-1][1]:
      groups[-1][0].append(eqn)
    else:
      groups.append(([eqn], owners))
  limit = _PIECES_PER_OWNER * count + 2
  while len(groups) > limit:  # merge the smallest neighbours
    i = min(range(len(groups) - 1), key=lambda j: len(groups[j][0]) + len(groups[j + 1][0]))
    (a, oa), (b, ob) = groups[i], groups[i + 1]
    groups[i : i + 2] = [(a + b, oa | ob)]
  last_read: dict[Any, int] = {}  # the last group reading each variable
  for i, (eqns, _) in enumerate(groups):
    for eqn in eqns:
      last_read.update((a, i) for a in eqn.invars if not jaxprs.is_literal(a))
  last_read.update((v, len(groups)) for v in jaxpr.outvars if not jaxprs.is_literal(v))
  pieces = []
  for i, (eqns, owners) in enumerate(groups):
    defined = {v for e in eqns for v in e.outvars}
    inputs, seen = [], set()
    for e in eqns:
      for a in e.invars:
        if not jaxprs.is_literal(a) and a not in defined and a not in seen:
          seen.add(a)
          inputs.append(a)
    outputs = [v for e in eqns for v in e.outvars if last_read.get(v, -1) > i]
    pieces.append(_Piece(tuple(eqns), frozenset(owners), tuple(inputs), tuple(outputs)))
  return pieces


def mapped_over_units(
  fun: Callable[..., Any],
  base: Sequence[Any],
  owner_of_input: Sequence[int],
  units: Sequence[Any],
  unit_owner: Any,
  owners: int,
) -> tuple[Any, Any]:
  """`fun(*inputs)` at the base inputs and at each unit's, sharing what the units share.

  Args:
    fun: a function of scalar arrays returning a pytree of arrays.
    base: its base inputs.
    owner_of_input: for each input, the owner (in `range(owners)`) it belongs to.
    units: for each input, its value in every unit (arrays with a leading unit axis); a
      unit gives every input not of its owner its base value.
    unit_owner: each unit's owner (an int array with the unit axis).
    owners: how many owners there are.

  Returns:
    `(fun(*base), stacked)`: the base run's output and every unit's, stacked along a
    leading axis.
  """
  closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*base)
  jaxpr, consts = closed.jaxpr, closed.consts
  out_tree = jax.tree_util.tree_structure(shapes)
  depends = _dependencies(jaxpr, owner_of_input)
  pieces = _pieces(jaxpr, depends, owners)
  keep: list[Any] = []  # base-run values the units read or hand on
  kept: set[Any] = set()
  outside = set(jaxpr.invars) | set(jaxpr.constvars)
  for p in pieces:
    for v in (*p.inputs, *p.outputs):
      if v not in kept and v not in outside:
        kept.add(v)
        keep.append(v)
  for v in jaxpr.outvars:
    if not jaxprs.is_literal(v) and v not in kept and v not in outside:
      kept.add(v)
      keep.append(v)
  everything = [*jaxpr.constvars, *jaxpr.invars]
  run_base = jaxprs.piece(jaxpr, everything, [*jaxpr.outvars, *keep], jaxpr.eqns)
  values = run_base(*consts, *base)
  base_output = values[: len(jaxpr.outvars)]
  base_values = dict(zip(keep, values[len(jaxpr.outvars) :], strict=True))
  runs = [
    (jaxprs.piece(jaxpr, p.inputs, p.outputs, p.eqns), _membership(p.owners, owners))
    for p in pieces
  ]

  def one_unit(unit: tuple[Any, Any]) -> list[Any]:
    owner, inputs = unit
    env = dict(base_values)
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, inputs, strict=True))
    for piece, (run, member) in zip(pieces, runs, strict=True):
      handed_on = [base_values[v] for v in piece.outputs]
      args = [env[v] for v in piece.inputs]
      out = jax.lax.cond(
        member[owner], lambda a, run=run: run(*a), lambda a, h=handed_on: list(h), args
      )
      env.update(zip(piece.outputs, out, strict=True))
    return [_value(env, v) for v in jaxpr.outvars]

  stacked = jax.lax.map(one_unit, (unit_owner, tuple(units)))
  return (
    jax.tree_util.tree_unflatten(out_tree, base_output),
    jax.tree_util.tree_unflatten(out_tree, stacked),
  )


def _membership(members: frozenset[int], owners: int) -> Any:
  """A table, by owner, of whether that owner's units run a piece."""
  table = np.zeros(owners, bool)
  table[list(members)] = True
  return jnp.asarray(table)


def _value(env: dict[Any, Any], atom: Any) -> Any:
  if jaxprs.is_literal(atom):
    return jnp.asarray(jaxprs.literal_value(atom))
  return env[atom]
