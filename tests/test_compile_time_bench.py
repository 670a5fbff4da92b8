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
