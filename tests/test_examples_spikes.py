"""examples/spikes.py runs at a tiny size: its table and its PNG."""

import math
import pathlib
import re

import pytest

from example_runner import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_spikes_prints_the_table_and_writes_the_png(tmp_path):
  out = tmp_path / "plots" / "spikes.png"
  # The spike-aware optimizers and a guard (each variant compiles its own
  # training step: the others run in examples of their own).
  stdout = run_script(
    "examples/spikes.py",
    "--steps",
    "10",
    "--layers",
    "1",
    "--dim",
    "8",
    "--seq-len",
    "8",
    "--batch",
    "4",
    "--variants",
    "guard,spam,stable_spam",
    "--out",
    str(out),
    cwd=tmp_path,
  )
  assert (
    "bad batches (2 in a row) from steps 4 (scaled), 6 (labels), 8 (both)"
    in (stdout)
  )
  assert re.search(
    r"^variant +final loss +recover +skipped +cost$", stdout, re.M
  ), stdout
  for name in ("adam", "guard", "spam", "stable_spam"):
    row = re.search(
      rf"^{name} +(\S+) +(\d+|never) +(\d+) +(\S+)x$", stdout, re.M
    )
    assert row, f"no row for {name}:\n{stdout}"
    final, _, skipped, cost = row.groups()
    assert math.isfinite(float(final)) and float(final) > 0, stdout
    assert 0 <= int(skipped) <= 10 and float(cost) > 0, stdout
  assert f"plot: {out}" in stdout
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
