"""The numerics' caches: what each keys on, and that none leaks or goes stale.

Three caches live in ``optaxclip._numerics``: the dtype facts of
``floats._bits_of`` and ``floats._exp_range_of`` (``functools.cache``), the
pieces that ``packing.split_parts`` cut (``packing._PIECES``, keyed by
``id``) and the leaves taken from packed vectors within
``layouts.handing_over`` (``layouts._handed``, thread-local, keyed by
``id``). Each test here fails if its cache hands a value of one trace to
another, keeps entries past their arrays, or answers for another dtype.
"""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics import floats
from optaxclip._numerics import layouts
from optaxclip._numerics import packing


def test_dtype_facts_are_keyed_on_the_dtype():
  for dtype, bits, mant in (
    (np.float32, np.int32, 23),
    (np.float64, np.int64, 52),
  ):
    assert floats._bits_of(np.dtype(dtype))[:2] == (bits, mant)
  # Spellings of one dtype share an entry; the answers differ by dtype.
  floats._bits_of.cache_clear()
  for spelling in (np.float32, jnp.float32, "float32", np.dtype("float32")):
    floats.pow2(np.int32(3), spelling)
  assert floats._bits_of.cache_info().currsize == 1
  assert floats.exp_range(jnp.float32) == (-126, 126)
  assert floats.exp_range(np.float64) == (-1022, 1022)


def test_dtype_facts_hold_across_traces_of_either_dtype():
  # A power of two beyond each dtype's range, applied in normal steps.
  f = jax.jit(floats.ldexp)
  y = f(np.float32(1.5 * 2.0**100), np.int32(-200))
  assert y.dtype == np.float32 and float(y) == 1.5 * 2.0**-100
  with jax.enable_x64():
    y = f(np.float64(1.5 * 2.0**1000), np.int32(-2000))
    assert y.dtype == np.float64 and float(y) == 1.5 * 2.0**-1000
  y = f(np.float32(1.5 * 2.0**-100), np.int32(200))
  assert y.dtype == np.float32 and float(y) == 1.5 * 2.0**100


def _split_and_join(v, sizes):
  """``v`` cut by split_parts and joined by flat_concat; also whether the
  join was the cached vector itself (no concatenation).
  """
  like = [jnp.zeros(n, v.dtype) for n in sizes]
  parts = packing.split_parts(v, like)
  joined = packing.flat_concat(parts)
  return joined, joined is v, parts


def test_pieces_are_forgotten_with_their_trace():
  gc.collect()
  before = len(packing._PIECES)
  seen = []

  def f(v):
    joined, whole, _ = _split_and_join(v, (3, v.shape[0] - 3))
    seen.append(whole)
    return joined * 2

  for n in (8, 11):  # a retrace after a shape change
    np.testing.assert_array_equal(
      jax.jit(f)(jnp.arange(n, dtype=jnp.float32)), 2 * np.arange(n)
    )
  assert seen == [True, True]
  gc.collect()
  assert len(packing._PIECES) == before


def test_pieces_of_another_trace_are_not_joined():
  kept = []

  def first(v):
    _, _, parts = _split_and_join(v, (2, 2))
    kept.append(parts)  # the pieces outlive their trace
    return v

  jax.jit(first)(jnp.arange(4.0))

  def second(v):
    mine = packing.split_parts(v, [jnp.zeros(2), jnp.zeros(2)])
    # A piece of the earlier trace with one of this trace's: no vector holds
    # both in this order, so they are concatenated, not looked up.
    assert packing._whole_of([kept[0][0], mine[1]]) is None
    return packing.flat_concat([mine[1], mine[0]])

  np.testing.assert_array_equal(
    jax.jit(second)(jnp.arange(4.0) + 10), [12, 13, 10, 11]
  )


def test_a_reused_id_does_not_find_a_stale_piece():
  x = jnp.arange(3.0)
  other = jnp.arange(3.0)
  stale = jnp.arange(10.0, 13.0)
  # As if ``x`` were a new array at the address of a collected piece.
  packing._PIECES[id(x)] = (weakref.ref(other), stale, 0)
  try:
    assert packing._whole_of([x]) is None
    np.testing.assert_array_equal(packing.flat_concat([x]), [0, 1, 2])
  finally:
    packing._PIECES.pop(id(x), None)


def _handed_runs():
  return getattr(layouts._handed, "runs", None)


def test_hand_over_is_scoped_to_its_block():
  assert _handed_runs() is None
  flat = jnp.arange(6.0, dtype=jnp.float32)
  like = [jnp.zeros((3,), jnp.float32)] * 2
  with layouts.handing_over():
    leaves = layouts.take_leaves(flat, like)
    run = layouts.handed_run(leaves)
    assert run is not None
    np.testing.assert_array_equal(run, np.arange(6.0))
    with layouts.handing_over():  # a nested block starts empty ...
      assert layouts.handed_run(leaves) is None
    # ... and gives the outer one back.
    assert layouts.handed_run(leaves) is not None
  assert _handed_runs() is None
  # Outside a block, nothing is remembered.
  assert layouts.handed_run(layouts.take_leaves(flat, like)) is None
  assert _handed_runs() is None


def test_hand_over_does_not_carry_into_another_trace_or_thread():
  kept = []

  def stage(v):
    with layouts.handing_over():
      leaves = layouts.take_leaves(v, [jnp.zeros((2,), v.dtype)] * 2)
      kept.append(leaves)
      assert layouts.handed_run(leaves) is not None
      return layouts.handed_run(leaves) + 1

  for n in (4, 6):  # a retrace after a shape change
    out = jax.jit(stage)(jnp.arange(n, dtype=jnp.float32))
    np.testing.assert_array_equal(out, np.arange(4) + 1)
  with layouts.handing_over():
    # Leaves of the earlier traces are not this block's.
    assert layouts.handed_run(kept[0]) is None
    flat = jnp.arange(4.0)
    leaves = layouts.take_leaves(flat, [jnp.zeros(2)] * 2)
    other = []
    t = threading.Thread(
      target=lambda: other.append(layouts.handed_run(leaves))
    )
    t.start()
    t.join()
    assert other == [None]  # another thread sees no runs of this one
    assert layouts.handed_run(leaves) is not None
