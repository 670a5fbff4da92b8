"""Update functions compiled once per configuration, not once per call.

Two layers. :func:`jit_update` puts one transformation's update under
``jax.jit``: an eager loop that reuses the transformation compiles once.
:func:`compiled_once` decorates a public factory so that every
transformation it builds with the same configuration shares one compiled
update. That matters for ``optax.inject_hyperparams``, which calls the factory
again at every update with the hyperparameters as fresh arrays: each call
built new closures, hence a new ``jax.jit`` and a new compilation of the
update at every step. With the decorator, the array arguments become
arguments of one shared jitted function, keyed on the factory and its other
(static) arguments.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
import functools
import inspect
import math
import threading
from typing import Any, Optional
import warnings

import jax
import numpy as np


def jit_update(update_fn: Callable) -> Callable:
  """``update_fn`` under ``jax.jit``, traced once per transformation.

  Inside a user's jitted step this changes nothing: the nested ``jit`` is
  inlined into the step's program. Called eagerly (a loop without ``jit``, a
  notebook), the second call reuses the compiled program; without it, every
  call would trace and compile the norms' ``lax.cond`` branches and custom
  reductions again (figures in ``docs/performance.md``). Extra arguments (of
  :func:`guard`) that are arrays or numbers, such as a loss ``value``, are
  traced arguments; some may hold functions, such as optax's line searches'
  ``value_fn``, which ``jit`` cannot take: a call with them runs as written.
  """
  jitted = jax.jit(update_fn)

  @functools.wraps(update_fn)
  def update(updates, state, params=None, **extra_args):
    if not arrays_only(extra_args):
      return update_fn(updates, state, params, **extra_args)
    return jitted(updates, state, params, **extra_args)

  return update


def arrays_only(extra_args: dict[str, Any]) -> bool:
  """Whether ``jit`` can take the extra arguments as traced arguments:
  arrays and numbers (a loss ``value``), not functions.
  """
  return all(
    isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex))
    for leaf in jax.tree.leaves(extra_args)
  )


# Shared compiled updates, least recently used last out. Each entry keeps its
# static arguments alive (a guarded optimizer, a `sharded` callable), so the
# cache is bounded.
_CACHE_SIZE = 128
_shared: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def _static_key(value: Any) -> Optional[Hashable]:
  """A hashable key that tells static argument values apart, or None.

  Containers are flattened (a list of axes keys like the tuple); a leaf's
  type is part of its key (``1`` and ``1.0`` or ``True`` compare equal but
  may trace differently), and so is the sign of a zero.
  """
  leaves, treedef = jax.tree_util.tree_flatten(value)
  parts = []
  for leaf in leaves:
    if isinstance(leaf, float):
      leaf = (leaf, math.copysign(1.0, leaf))
    parts.append((type(leaf), leaf))
  key = (treedef, tuple(parts))
  try:
    hash(key)
  except TypeError:  # an array, a dict value, any unhashable object.
    return None
  return key


# Integer arguments that take values beyond int32 (a seed of any size is
# mapped to a key); every other integer argument (steps, windows, intervals)
# is bounded to int32 by its factory's checks.
_WHOLE_NUMBERS = frozenset({"seed"})


def _beyond_int32(value: Any) -> bool:
  """Whether ``value`` is a Python int (not a bool) outside int32."""
  return (
    isinstance(value, int)
    and not isinstance(value, bool)
    and not -(2**31) <= value < 2**31
  )


def _raw_update(transformation) -> Callable:
  """The update function under :func:`jit_update`'s wrapper."""
  return getattr(transformation.update, "__wrapped__", transformation.update)


def _build_shared(factory: Callable, static: dict[str, Any]) -> Callable:
  def run(dynamic, updates, state, params, extra_args):
    # Traced hyperparameters are accepted unchecked by the factory; its
    # deprecation warnings were given when the user built it.
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      transformation = factory(**static, **dynamic)
    return _raw_update(transformation)(updates, state, params, **extra_args)

  return jax.jit(run)


def compiled_once(factory: Callable) -> Callable:
  """Decorates a factory: its transformations share one compiled update.

  The factory runs as written (its checks see the concrete arguments and its
  ``init`` is kept). Its update is replaced by one jitted function per
  factory and static configuration, to which the arguments that are JAX
  arrays -- the hyperparameters ``optax.inject_hyperparams`` passes, traced
  or not -- are passed as arguments. A configuration whose static arguments
  cannot be hashed (a pytree of ``sharded`` flags in a dict, a NumPy array)
  keeps the transformation's own compiled update.
  """
  signature = inspect.signature(factory)

  @functools.wraps(factory)
  def build(*args, **kwargs):
    transformation = factory(*args, **kwargs)
    arguments = signature.bind(*args, **kwargs).arguments
    wide = {
      name: float(value)
      for name, value in arguments.items()
      if _beyond_int32(value) and name not in _WHOLE_NUMBERS
    }
    if wide:
      # A Python int beyond int32 (2**31 as a max_norm) would become an
      # int32 array in the update and overflow: checked as given above
      # (step counts beyond int32 are rejected there), used as a float.
      arguments = {**arguments, **wide}
      transformation = factory(**arguments)
    dynamic = {
      name: value
      for name, value in arguments.items()
      if isinstance(value, jax.Array)
    }
    static = {
      name: value for name, value in arguments.items() if name not in dynamic
    }
    keys = [(name, _static_key(value)) for name, value in static.items()]
    if any(key is None for _, key in keys):
      return transformation
    cache_key = (factory, tuple(keys))
    with _lock:
      jitted = _shared.pop(cache_key, None)
      if jitted is None:
        jitted = _build_shared(factory, static)
      _shared[cache_key] = jitted
      while len(_shared) > _CACHE_SIZE:
        _shared.popitem(last=False)
    own_update = transformation.update

    @functools.wraps(_raw_update(transformation))
    def update(updates, state, params=None, **extra_args):
      if not arrays_only(extra_args):
        return own_update(updates, state, params, **extra_args)
      return jitted(dynamic, updates, state, params, extra_args)

    return transformation._replace(update=update)

  return build
