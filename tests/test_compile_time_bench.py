"""benchmarks/compile_time.py measures every clipper and writes a sane table
(so that it never rots); the timings themselves belong to the benchmarks.
"""

import re

from example_runner import load_script


def _module():
  return load_script("benchmarks/compile_time.py")


def test_measures_each_clipper_and_tabulates_ratios():
  ct = _module()
  assert set(ct.CLIPPERS) >= {
    "adam",
    "clip_global",
    "clip_norm",
    "clip_block_rms",
    "clip_unitwise",
    "clip_zscore(scope=leaf)",
    "clip_percentile(scope=leaf)",
    "clip_relative",
  }
  seconds = ct.measure(["clip_norm"], 3, rounds=2)
  assert list(seconds) == ["adam", "clip_norm"]
  assert all(len(s) == 2 and min(s) > 0 for s in seconds.values())
  lines = ct.table({3: seconds}, "mixed")
  rows = {
    line.split("|")[1].strip(): line
    for line in lines
    if line.startswith("| ") and "clipper" not in line
  }
  assert set(rows) == {"adam", "clip_norm"}
  assert re.search(r"\d+\.\d\d \(1\.00x\)", rows["adam"])
  assert re.search(r"\| (yes|no) \|$", rows["clip_norm"])


def test_whole_optimizers_are_compiled_as_they_are():
  ct = _module()
  assert {"guard(adam)", "guard(adam, scope=leaf)", "stable_spam"} <= set(
    ct.OPTIMIZERS
  )
  seconds = ct.measure(["guard(adam, scope=leaf)"], 3, rounds=1)
  assert list(seconds) == ["adam", "guard(adam, scope=leaf)"]
  assert all(len(s) == 1 and min(s) > 0 for s in seconds.values())


def test_kernel_counts_see_leaves_of_one_shape_share_a_kernel():
  """--kernels: adam's step on 10 leaves of 5 shapes is 3 fusions a leaf
  (its two moments and the parameters) and, as each shape's leaves share
  their bodies, as many distinct kernels as on 5 leaves; a clipper's step
  holds more of both. The table has one row per clipper, three counts a
  size.
  """
  ct = _module()
  trees = {
    n: (ct.make_tree(n, seed=0, scale=0.02), ct.make_tree(n, seed=1))
    for n in (5, 10)
  }
  adam = {
    n: ct.kernel_counts(ct.CLIPPERS["adam"], *t) for n, t in trees.items()
  }
  assert adam[10]["fusions"] >= 30
  assert adam[10]["distinct"] == adam[5]["distinct"] < adam[10]["fusions"]
  assert adam[10]["instructions"] > adam[5]["instructions"] > 0
  clipped = ct.kernel_counts(ct.CLIPPERS["clip_norm"], *trees[10])
  assert clipped["instructions"] > adam[10]["instructions"]
  assert clipped["distinct"] > adam[10]["distinct"]
  lines = ct.kernel_table(["clip_norm"], [5], "mixed")
  rows = [
    line for line in lines if line.startswith("| ") and "clipper" not in line
  ]
  assert [r.split("|")[1].strip() for r in rows] == ["adam", "clip_norm"]
  assert all(re.fullmatch(r"\| \S+ \| \d+ / \d+ / \d+ \|", r) for r in rows)
