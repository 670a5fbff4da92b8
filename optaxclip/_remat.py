"""Rematerialisation of chosen Flax linen modules inside a loss function.

``clipped_grad(..., remat=Block)`` runs the loss with every call of a
``Block`` wrapped in ``flax.linen.remat`` (nothing saved): the backward pass
keeps each call's inputs and recomputes what happens inside the call when it
gets there, instead of keeping every intermediate of every call from the
forward pass. Under ``nn.scan`` this is per scanned layer: the residuals
stacked over the layers shrink to the layers' inputs, and one layer's
intermediates live at a time. The model's code is not changed: the calls are
rerouted with ``flax.linen.intercept_methods`` for the time of the trace, as
the ghost taps are.

The values computed are the same operations in the same order (the ghost
method stays exact); the cost is one more forward pass of the wrapped
modules per backward pass (the ghost method's two passes recompute twice).

References:
  Chen et al., `Training Deep Nets with Sublinear Memory Cost
  <https://arxiv.org/abs/1604.06174>`_, 2016 (gradient checkpointing);
  the documentation of ``jax.checkpoint`` and ``flax.linen.remat``.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import jax
import numpy as np

try:  # Flax is optional: without it there is nothing to rematerialise.
  import flax.linen as nn
except ImportError:  # pragma: no cover
  nn = None

WHO = "clipped_grad"


def check_classes(remat: Any) -> tuple:
  """``remat`` as a tuple of linen module classes (empty for ``None``).

  Raises:
    ValueError: ``remat`` is not ``None``, a ``flax.linen.Module`` subclass
      or a tuple (list) of them.
  """
  if remat is None:
    return ()
  classes = tuple(remat) if isinstance(remat, (tuple, list)) else (remat,)
  linen_module = None if nn is None else nn.Module
  if (
    not classes
    or linen_module is None
    or not all(
      isinstance(c, type) and issubclass(c, linen_module) for c in classes
    )
  ):
    raise ValueError(
      f"{WHO}: remat must be None, a flax.linen.Module subclass or a tuple "
      f"of them (e.g. the model's transformer block); got {remat!r}."
    )
  return classes


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray)) or (
    hasattr(leaf, "shape") and hasattr(leaf, "dtype")
  )


def _lifted_wrapper(module) -> bool:
  # nn.scan(Block) & co. make subclasses of Block in flax.linen.transforms:
  # rematerialising the whole scan would save nothing per layer.
  return type(module).__module__.startswith("flax.linen.transforms")


def rematerialised(loss_fn: Callable, classes: tuple) -> Callable:
  """``loss_fn`` with the ``__call__`` of every module of ``classes`` (and
  their subclasses) rematerialised (``flax.linen.remat``, nothing saved).

  Array arguments of a call are the checkpoint's inputs; any other argument
  (``None``, a flag) is passed through as it is.
  """
  if not classes:
    return loss_fn
  policy = jax.checkpoint_policies.nothing_saveable
  inside: set = set()  # ids of the copies flax's remat runs the call on

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if (
      context.method_name != "__call__"
      or not isinstance(module, classes)
      or _lifted_wrapper(module)
      or id(module) in inside
    ):
      return next_fun(*args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [_is_array(x) for x in leaves]

    def body(copy, *arrays):
      it = iter(arrays)
      full = [next(it) if d else x for x, d in zip(leaves, dynamic)]
      a, k = jax.tree.unflatten(treedef, full)
      inside.add(id(copy))
      try:
        return type(copy).__call__(copy, *a, **k)
      finally:
        inside.discard(id(copy))

    lifted = nn.remat(body, policy=policy)  # pyright: ignore[reportOptionalMemberAccess]
    return lifted(module, *[x for x, d in zip(leaves, dynamic) if d])

  @functools.wraps(loss_fn)
  def wrapped(*args, **kwargs):
    with nn.intercept_methods(intercept):  # pyright: ignore[reportOptionalMemberAccess]
      return loss_fn(*args, **kwargs)

  return wrapped
