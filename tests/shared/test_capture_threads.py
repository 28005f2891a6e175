"""Captures and threads: a capturing run's interception of JAX is its own.

A capture inside a scan body needs the body to return what it captured, so while a run
captures, its lookups of `jax.lax.scan`, `jax.vmap`, `jax.checkpoint` and `jax.remat`
give wrappers. Nothing else may see them: another thread looking these names up while a
run is inside a scan body gets JAX's own functions and traces the program it would
trace without flaxlens; two threads capturing at the same time each get what a capture
alone gets (and what Flax's own capture gets); and after every run, one that raised
included, the modules `jax` and `jax.lax` are as they were.

The models call a `Gate` inside their scan body, whose first call in each thread waits
for the other threads of the test (tracing is Python, so the run is then inside the
body's trace).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import FRAMEWORKS, LINEN
from linen import corpus as linen_corpus
from nnx import corpus as nnx_corpus

import flaxlens as fl

X = jax.random.normal(jax.random.key(0), (2, 4))
XS = jnp.arange(6.0).reshape(3, 2)
JAX_FUNCTIONS = {
  (jax.lax, "scan"): jax.lax.scan,
  (jax, "vmap"): jax.vmap,
  (jax, "checkpoint"): jax.checkpoint,
  (jax, "remat"): jax.remat,
}
MODULE_CLASSES = {jax: type(jax), jax.lax: type(jax.lax)}
WAIT = 60  # seconds: a broken test fails rather than hangs


class Meeting:
  """Holds the first `Gate` call of each thread until `parties` threads met, then until
  `released` (a thread that meets without a gate calls `meet`)."""

  def __init__(self, parties: int, fail: bool = False):
    self.barrier = threading.Barrier(parties, timeout=WAIT)
    self.released = threading.Event()
    self.fail = fail
    self._met = threading.local()

  def meet(self) -> None:
    self.barrier.wait()

  def arrive(self) -> None:
    if self.fail:
      raise ValueError("the gate refuses")
    if getattr(self._met, "done", False):  # a body traced again
      return
    self._met.done = True
    self.meet()
    assert self.released.wait(WAIT)


_meeting: list[Meeting | None] = [None]


@contextmanager
def meeting(parties: int, fail: bool = False) -> Iterator[Meeting]:
  _meeting[0] = Meeting(parties, fail)
  try:
    yield _meeting[0]
  finally:
    _meeting[0].released.set()
    _meeting[0] = None


def _gate(x):
  if _meeting[0] is not None:
    _meeting[0].arrive()
  return x


class LinenGate(nn.Module):
  def __call__(self, x):
    return _gate(x)


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return LinenGate()(jnp.tanh(nn.Dense(4)(x))) + x, None


class LinenStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      LinenBlock,
      variable_axes={"params": 0, "intermediates": 0},
      split_rngs={"params": True},
      length=3,
    )
    x, _ = scan(name="layers")(x, None)
    return nn.Dense(2)(x)


class NNXGate(nnx.Module):
  def __call__(self, x):
    return _gate(x)


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.gate = NNXGate()

  def __call__(self, x):
    return self.gate(jnp.tanh(self.linear(x))) + x


class NNXStack(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NNXBlock(rngs)

    self.blocks = blocks(rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    scan = nnx.scan(lambda block, x: block(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    return self.out(scan(self.blocks, x))


def _case(fw):
  if fw is LINEN:
    module = LinenStack()
    return linen_corpus.Case("gated scan", module, dict(module.init(jax.random.key(1), X)), (X,))
  return nnx_corpus.Case("gated scan", NNXStack(nnx.Rngs(1)), (X,))


def _plain_program(xs):
  """JAX's own transforms, as code that knows nothing of flaxlens uses them."""

  def step(carry, x):
    return carry + x, carry * x

  carry, ys = jax.lax.scan(step, jnp.zeros(2), xs)
  return jax.vmap(jax.checkpoint(jnp.sin))(ys) + jax.remat(jnp.cos)(carry)


def _assert_flax_captures(fw, case, out, cache, jit):
  native_out, native = fw.native_captures(case, jit=jit)
  assert_trees_equal(out, native_out)
  inner = "layers/Dense_0" if fw is LINEN else "blocks/linear"
  native_inner = (
    ("layers", "Dense_0", "__call__") if fw is LINEN else ("blocks", "linear", "__call__")
  )
  assert cache[inner].shape == (3, 2, 4)
  assert_trees_equal(cache[inner], native[native_inner][0])


def _in_thread(target, *args):
  result: dict[str, object] = {}

  def run():
    try:
      result["value"] = target(*args)
    except BaseException as e:  # re-raised in the test's thread
      result["error"] = e

  thread = threading.Thread(target=run)
  thread.start()
  return thread, result


def _joined(thread, result):
  thread.join(WAIT)
  assert not thread.is_alive()
  if "error" in result:
    raise result["error"]
  return result["value"]


@pytest.mark.parametrize("fw", list(FRAMEWORKS.values()))
def test_another_thread_gets_jax_own_functions_while_a_run_captures_in_a_scan_body(fw):
  case = _case(fw)
  tree = fw.convert(case)
  expected_program = str(jax.make_jaxpr(_plain_program)(XS))
  expected_value = _plain_program(XS)

  def other(m):
    m.meet()  # the capturing run is inside the scan body now
    try:
      functions = {name: getattr(owner, name) is f for (owner, name), f in JAX_FUNCTIONS.items()}
      return functions, str(jax.make_jaxpr(_plain_program)(XS)), _plain_program(XS)
    finally:
      m.released.set()

  with meeting(2) as m:
    thread, result = _in_thread(other, m)
    out, cache = fl.capture(tree, X, jit=False)
  functions, program, value = _joined(thread, result)
  assert functions == dict.fromkeys(functions, True)
  assert program == expected_program
  assert_trees_equal(value, expected_value)
  _assert_flax_captures(fw, case, out, cache, jit=False)


@pytest.mark.parametrize("fw", list(FRAMEWORKS.values()))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_two_threads_capturing_in_scan_bodies_at_once_each_capture_what_flax_captures(fw, jit):
  case = _case(fw)
  alone = fl.capture(fw.convert(case), X, jit=jit)
  trees = [fw.convert(case), fw.convert(case)]
  with meeting(2) as m:
    m.released.set()  # both runs wait for each other inside their scan bodies only
    running = [_in_thread(lambda t: fl.capture(t, X, jit=jit), tree) for tree in trees]
    results = [_joined(*r) for r in running]
  for out, cache in results:
    assert sorted(cache) == sorted(alone[1])
    assert_trees_equal((out, cache), alone)
    _assert_flax_captures(fw, case, out, cache, jit=jit)


@pytest.mark.parametrize("fw", list(FRAMEWORKS.values()))
@pytest.mark.parametrize("fail", [False, True], ids=["returned", "raised"])
def test_jax_modules_are_as_before_after_a_capturing_run(fw, fail):
  tree = fw.convert(_case(fw))
  with meeting(1, fail=fail) as m:
    m.released.set()
    if fail:
      with pytest.raises(fl.ModelCallError):
        fl.capture(tree, X, jit=False)
    else:
      fl.capture(tree, X, jit=False)
  assert {m: type(m) for m in MODULE_CLASSES} == MODULE_CLASSES
  assert all(type(m) is ModuleType for m in MODULE_CLASSES)
  for (owner, name), function in JAX_FUNCTIONS.items():
    assert getattr(owner, name) is function
    assert vars(owner)[name] is function
