"""Collectives in the compiled HLO of clippers on 8 devices, FSDP-style.

Counts the all-reduce and all-gather instructions XLA emits for one
``update`` of a clipper on a tree sharded over 8 host CPU devices, on a mesh
with Auto axis types and one with Explicit axis types. "entry" counts the
instructions of the ordinary path; the rest sit in the rarely taken branch
that rescales on overflow or underflow.

    python benchmarks/sharding_hlo.py [--leaves 24]
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
  filter(
    None,
    (
      os.environ.get("XLA_FLAGS", ""),
      "--xla_force_host_platform_device_count=8",
    ),
  )
)

import argparse
import re

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optaxclip


def fsdp_tree(mesh, n_layers):
  """Per layer: a kernel split on its rows, a bias split, a replicated scale."""
  rng = np.random.default_rng(0)
  tree, specs = {}, {}
  for i in range(n_layers):
    tree[f"layer{i}"] = {
      "kernel": rng.normal(size=(64, 32)),
      "bias": rng.normal(size=(32,)),
      "scale": rng.normal(size=(3,)),
    }
    specs[f"layer{i}"] = {"kernel": P("d", None), "bias": P("d"), "scale": P()}
  return jax.tree.map(
    lambda x, s: jax.device_put(x.astype(np.float32), NamedSharding(mesh, s)),
    tree,
    specs,
  )


def count(hlo):
  reduces = re.findall(r"= (\S+|\([^)]*\)) all-reduce(?:-start)?\(", hlo)
  gathers = re.findall(r" all-gather(?:-start)?\(", hlo)
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  entry_reduces = re.findall(
    r"= (\S+|\([^)]*\)) all-reduce(?:-start)?\(", entry
  )
  return (
    len(reduces),
    len(entry_reduces),
    _elements(entry_reduces),
    len(gathers),
  )


def _elements(types):
  """Arrays and elements the all-reduces carry, from their result types."""
  arrays = elements = 0
  for t in types:
    for dims in re.findall(r"\w+\[([\d,]*)\]", t):
      arrays += 1
      elements += int(np.prod([int(d) for d in dims.split(",") if d]))
  return arrays, elements


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--layers", type=int, default=8, help="layers of 3 leaves each"
  )
  args = parser.parse_args()
  meshes = {
    "Auto": jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",)),
    "Explicit": jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,)),
  }
  clippers = {
    "optaxclip.clip_global": lambda: optaxclip.clip_global(1.0),
    "optaxclip.clip_global(ord=inf)": lambda: optaxclip.clip_global(
      1.0, ord="inf"
    ),
    "optaxclip.clip_norm": lambda: optaxclip.clip_norm(1.0),
    "optaxclip.clip_unitwise": lambda: optaxclip.clip_unitwise(0.01),
    "optax.clip_by_global_norm": lambda: optax.clip_by_global_norm(1.0),
    "optax.adaptive_grad_clip": lambda: optax.adaptive_grad_clip(0.01),
  }
  print(
    f"{args.layers * 3} leaves ({args.layers} kernels 64x32 and biases "
    "split over 8 devices, scales replicated)"
  )
  print(
    f"{'clipper':32s} {'mesh':9s} all-reduce (entry) all-gather  "
    "carried by the entry all-reduces"
  )
  for name, make in clippers.items():
    for kind, mesh in meshes.items():
      tx = make()
      grads = fsdp_tree(mesh, args.layers)
      try:
        with jax.set_mesh(mesh):
          hlo = (
            jax.jit(tx.update)
            .lower(grads, tx.init(grads), grads)
            .compile()
            .as_text()
          )
      except Exception as err:  # noqa: BLE001 (a row says which fail)
        print(f"{name:32s} {kind:9s} fails: {type(err).__name__}")
        continue
      n, n_entry, (arrays, elements), gathers = count(hlo)
      print(
        f"{name:32s} {kind:9s} {n:10d} ({n_entry}) {gathers:10d}  "
        f"{arrays} arrays, {elements} floats"
      )


if __name__ == "__main__":
  main()
