"""benchmarks/device_step.py and benchmarks/watch_step.py run at a tiny
size on the CPU and report every row (so that they never rot; their
figures belong to an accelerator's run, not to a test).
"""

import re

import pytest

from example_runner import load_script
from example_runner import run_script

RATIO = re.compile(r"^\d+\.\d+x \(")


def _rows(stdout, header):
  lines = stdout.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header))
  rows = []
  for line in lines[start + 2 :]:
    if not line.startswith("|"):
      break
    rows.append([c.strip() for c in line.strip().strip("|").split("|")])
  return rows


@pytest.mark.slow
def test_device_step_runs_at_a_tiny_size(tmp_path):
  out = tmp_path / "device.md"
  stdout = run_script(
    "benchmarks/device_step.py",
    *("--params", "1e4", "--width", "32", "--vocab", "64", "--context", "16"),
    *("--rounds", "2", "--norm-repeats", "2", "--peak-gbs", "100"),
    *("--out", str(out)),
    cwd=tmp_path,
  )
  script = load_script("benchmarks/device_step.py")
  rows = _rows(stdout, "| variant ")
  assert [r[0] for r in rows] == list(script.variants())
  for name, ratio, ms, compile_s, twin in rows:
    assert ratio == "1" if name == "adamw" else RATIO.match(ratio), ratio
    assert float(ms) > 0 and float(compile_s) > 0
    assert twin == "–" or RATIO.match(twin), twin
  norms = _rows(stdout, "| norm pass")
  assert [r[0] for r in norms] == ["optaxclip.global_norm", "optax.global_norm"]
  for _, ms, gbs, peak in norms:
    assert float(ms) > 0 and float(gbs) > 0 and peak.endswith("%")
  assert out.read_text(encoding="utf-8").strip() == stdout.strip()


def test_device_step_sizes_the_tree():
  script = load_script("benchmarks/device_step.py")
  shapes, blocks = script.tree_shapes(1e9, 2048, 32000, 2048)
  n = 0
  for leaf in _leaves(shapes):
    size = 1
    for d in leaf:
      size *= d
    n += size
  assert blocks == 18 and abs(n - 1e9) / 1e9 < 0.03


def _leaves(tree):
  if isinstance(tree, dict):
    for value in tree.values():
      yield from _leaves(value)
  else:
    yield tree


@pytest.mark.slow
def test_watch_step_runs_at_a_tiny_size(tmp_path):
  stdout = run_script(
    "benchmarks/watch_step.py",
    *("--rounds", "2", "--leaves", "3", "--size", "1000"),
    cwd=tmp_path,
  )
  rows = _rows(stdout, "| step ")
  assert [r[0] for r in rows] == [
    "clip_global + plain update norm (floor)",
    "clip_global + watch",
    "clip_global + watch(leaf_stats)",
    "clip_global",
  ]
  for cells in rows[:3]:
    assert RATIO.match(cells[1]) and RATIO.match(cells[2]), cells
