"""The examples' flags: each has a help string with its default, and a bad
value is a clear error (argparse's exit 2), before anything runs.
"""

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ("lstm_exploding", "adaptive_spikes", "nnx_quickstart", "spikes")


def _load(name):
  path = ROOT / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  saved = list(sys.path)
  sys.path.insert(0, str(path.parent))
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module


def _help(module, capsys):
  with pytest.raises(SystemExit) as exit_info:
    module.parse_args(["--help"])
  assert exit_info.value.code == 0
  return capsys.readouterr().out


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_flag_has_help_with_its_default(name, capsys):
  text = _help(_load(name), capsys)
  usage, options = text.split("options:", 1)
  flags = set(re.findall(r"\[(--[a-z-]+)", usage))
  assert flags, text
  # One entry per flag (argparse indents continuation lines further).
  entries = {}
  for line in options.splitlines():
    if line.startswith("  -"):
      current = line.split()[0].rstrip(",")
      entries[current] = line
    elif line.strip():
      entries[current] += " " + line.strip()
  for flag in flags:
    assert flag in entries, (flag, text)
    entry = entries[flag]
    assert "(default: " in entry, entry
    assert len(entry.split("(default:")[0].split()) > 2, f"no help: {entry}"


BAD = [
  (
    "lstm_exploding",
    ["--steps", "0"],
    "argument --steps: must be a whole number >= 1; got '0'",
  ),
  (
    "lstm_exploding",
    ["--seq-len", "1"],
    "argument --seq-len: must be a whole number >= 2; got '1'",
  ),
  (
    "lstm_exploding",
    ["--lr", "nan"],
    "argument --lr: must be a number > 0; got 'nan'",
  ),
  (
    "lstm_exploding",
    ["--init-scale", "-1"],
    "argument --init-scale: must be a number > 0; got '-1'",
  ),
  (
    "lstm_exploding",
    ["--seed", "-1"],
    ("argument --seed: must be a whole number >= 0 and < 4294967296; got '-1'"),
  ),
  (
    "lstm_exploding",
    ["--variants", "clip_global,nope"],
    "argument --variants: unknown ['nope']",
  ),
  (
    "lstm_exploding",
    ["--variants", ","],
    "argument --variants: unknown none given",
  ),
  (
    "adaptive_spikes",
    ["--steps", "ten"],
    "argument --steps: must be a whole number >= 1; got 'ten'",
  ),
  (
    "spikes",
    ["--variants", "spam,adamw"],
    "argument --variants: unknown ['adamw']",
  ),
  (
    "spikes",
    ["--dim", "5", "--heads", "2"],
    "argument --dim: must be a multiple of --heads; got 5",
  ),
  (
    "spikes",
    ["--steps", "3"],
    "argument --steps: must be a whole number >= 10; got '3'",
  ),
  (
    "nnx_quickstart",
    ["--lr", "0"],
    "argument --lr: must be a number > 0; got '0'",
  ),
  (
    "nnx_quickstart",
    ["--seq-len", "1.5"],
    "argument --seq-len: must be a whole number >= 2; got '1.5'",
  ),
]


@pytest.mark.parametrize("name, argv, message", BAD)
def test_bad_values_are_clear_errors(name, argv, message, capsys):
  module = _load(name)
  with pytest.raises(SystemExit) as exit_info:
    module.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", EXAMPLES)
def test_defaults_parse(name):
  args = _load(name).parse_args([])
  assert args.steps >= 1
