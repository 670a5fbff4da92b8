"""examples/dp_sgd.py runs end to end at a tiny size (in a subprocess)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dp_sgd_example_runs_and_adapts_the_clip_norm():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, (str(ROOT), env.get("PYTHONPATH")))
  )
  result = subprocess.run(
    [
      sys.executable,
      str(ROOT / "examples" / "dp_sgd.py"),
      "--epochs",
      "2",
      "--examples",
      "512",
      "--batch-size",
      "64",
      "--l2-clip",
      "0.5",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  epochs = re.findall(
    r"epoch +(\d+) +test loss ([\d.]+) +clip norm ([\d.]+) +clipped ([\d.]+)",
    result.stdout,
  )
  assert [int(e[0]) for e in epochs] == [1, 2], result.stdout
  for _, loss, clip_norm, clipped in epochs:
    assert 0 < float(loss) < 10
    assert float(clip_norm) != 0.5  # the clip norm adapts from its start.
    assert 0 <= float(clipped) <= 1
  assert "No privacy accounting" in result.stdout


def test_dp_sgd_example_explains_bad_flags():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, (str(ROOT), env.get("PYTHONPATH")))
  )
  script = str(ROOT / "examples" / "dp_sgd.py")
  result = subprocess.run(
    [sys.executable, script, "--examples", "100"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert "--examples (100) must be at least one batch" in result.stderr
  assert "Traceback" not in result.stderr
  result = subprocess.run(
    [sys.executable, script, "--help"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  for flag in (
    "--epochs",
    "--examples",
    "--batch-size",
    "--dim",
    "--l2-clip",
    "--noise-multiplier",
    "--target-quantile",
    "--learning-rate",
    "--seed",
  ):
    options = result.stdout[result.stdout.index("options:") :]
    entry = options[options.index(flag) :].split("(default")[0]
    assert len(entry.split()) > 2, flag  # a help string, then its default
    assert "\n  --" not in entry, flag
  assert result.stdout.count("(default:") >= 9


def test_dp_transformer_example_runs_tiny():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, (str(ROOT), env.get("PYTHONPATH")))
  )
  result = subprocess.run(
    [
      sys.executable,
      str(ROOT / "examples" / "dp_transformer.py"),
      "--size",
      "tiny",
      "--steps",
      "6",
      "--batch-size",
      "16",
      "--log-every",
      "3",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
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
