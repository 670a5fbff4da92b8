"""The sharding tests' harness: trees placed on a mesh, and clippers run side
by side on one device and under ``shard_map`` in one program each.
"""

import functools

import jax
from jax.sharding import NamedSharding
import numpy as np

from fast_compile import run_fast


def put(tree, mesh, specs):
  """``tree``'s leaves placed on ``mesh`` by the matching ``specs``."""
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )


def one_device_and_mapped(run, mesh, specs, out_specs, grads, params):
  """``(got, want)``: ``run(grads, params, mapped=...)`` under ``shard_map``
  over ``mesh`` (``grads`` and ``params`` placed by ``specs``), and on one
  device. ``run`` returns ``{name: (updates, ...)}``; each program is compiled
  once, with ``fast_compile``.
  """
  want = run_fast(functools.partial(run, mapped=False), grads, params)
  mapped = jax.shard_map(
    functools.partial(run, mapped=True),
    mesh=mesh,
    in_specs=(specs, specs),
    out_specs=out_specs,
  )
  got = run_fast(mapped, put(grads, mesh, specs), put(params, mesh, specs))
  return got, want


def assert_updates_close(got, want, keys, tol):
  """Each case's updates (``[name][0][key]``) within ``tol`` of ``want``'s."""
  for name in want:
    for key in keys:
      np.testing.assert_allclose(
        got[name][0][key],
        want[name][0][key],
        rtol=tol,
        atol=tol,
        err_msg=f"{name}: {key}",
      )
