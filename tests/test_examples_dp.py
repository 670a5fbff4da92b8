"""examples/dp_sgd.py and dp_transformer.py run end to end at a tiny size
(in a subprocess); their flags are checked in test_examples_flags.py.
"""

import pathlib
import re

import pytest

from example_runner import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dp_sgd_example_runs_and_adapts_the_clip_norm():
  stdout = run_script(
    "examples/dp_sgd.py",
    "--epochs",
    "2",
    "--examples",
    "512",
    "--batch-size",
    "64",
    "--l2-clip",
    "0.5",
    cwd=ROOT,
    timeout=300,
  )
  epochs = re.findall(
    r"epoch +(\d+) +test loss ([\d.]+) +clip norm ([\d.]+) +clipped ([\d.]+)",
    stdout,
  )
  assert [int(e[0]) for e in epochs] == [1, 2], stdout
  for _, loss, clip_norm, clipped in epochs:
    assert 0 < float(loss) < 10
    assert float(clip_norm) != 0.5  # the clip norm adapts from its start.
    assert 0 <= float(clipped) <= 1
  assert "No privacy accounting" in stdout


@pytest.mark.slow
def test_dp_transformer_example_runs_tiny():
  out = run_script(
    "examples/dp_transformer.py",
    "--size",
    "tiny",
    "--steps",
    "6",
    "--batch-size",
    "16",
    "--log-every",
    "3",
    cwd=ROOT,
    timeout=300,
  )
  assert "exact fallback for 0\n" in out, out
  memory = re.search(r"ghost ([\d.]+) MiB, vmap ([\d.]+) MiB", out)
  assert memory and float(memory[1]) > 0 and float(memory[2]) > 0, out
  steps = re.findall(
    r"step +(\d+) +test loss ([\d.]+) +clip norm ([\d.]+) +clipped ([\d.]+)",
    out,
  )
  assert [int(s[0]) for s in steps] == [3, 6], out
  first = float(re.search(r"step +0 +test loss ([\d.]+)", out)[1])
  for _, loss, clip_norm, clipped in steps:
    assert 0 < float(loss) < 2 * first
    assert float(clip_norm) > 0 and 0 <= float(clipped) <= 1
  assert "No privacy accounting" in out
