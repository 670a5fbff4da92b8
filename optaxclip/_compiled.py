"""Update functions compiled once per transformation."""

from __future__ import annotations

from collections.abc import Callable
import functools

import jax


def jit_update(update_fn: Callable) -> Callable:
  """``update_fn`` under ``jax.jit``, traced once per transformation.

  Inside a user's jitted step this changes nothing: the nested ``jit`` is
  inlined into the step's program. Called eagerly (a loop without ``jit``, a
  notebook), the second call reuses the compiled program; without it, every
  call would trace and compile the norms' ``lax.cond`` branches and custom
  reductions again (0.1 to 0.4 s a call on a CPU). Extra arguments (of
  :func:`guard`) may hold functions, such as optax's line searches'
  ``value_fn``, which ``jit`` cannot take: a call with them runs as written.
  """
  jitted = jax.jit(update_fn)

  @functools.wraps(update_fn)
  def update(updates, state, params=None, **extra_args):
    if extra_args:
      return update_fn(updates, state, params, **extra_args)
    return jitted(updates, state, params)

  return update
