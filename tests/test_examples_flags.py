"""The examples' flags: each has a help string with its default, and a bad
value is a clear error (argparse's exit 2), before anything runs.
"""

import re

import pytest

from example_runner import load_script

EXAMPLES = (
  "lstm_exploding",
  "adaptive_spikes",
  "nnx_quickstart",
  "spikes",
  "which_layer",
  "dp_sgd",
  "dp_transformer",
)


def _load(name):
  return load_script(f"examples/{name}.py")


def _help(module, capsys):
  with pytest.raises(SystemExit) as exit_info:
    module.parse_args(["--help"])
  assert exit_info.value.code == 0
  return capsys.readouterr().out


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_flag_has_help_with_its_default(name, capsys):
  text = _help(_load(name), capsys)
  usage, options = text.split("options:", 1)
  flags = set(re.findall(r"\[(--[a-z0-9-]+)", usage))
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
  (
    "which_layer",
    ["--bad-layer", "12"],
    "argument --bad-layer: must be below --layers (12); got 12",
  ),
  (
    "dp_sgd",
    ["--l2-clip", "0"],
    "argument --l2-clip: must be a number > 0; got '0'",
  ),
  (
    "dp_sgd",
    ["--examples", "100"],
    "--examples (100) must be at least one batch",
  ),
  (
    "dp_transformer",
    ["--target-quantile", "1.5"],
    "argument --target-quantile: must be a number >= 0 and <= 1; got '1.5'",
  ),
  (
    "dp_transformer",
    ["--batch-size", "4"],
    "--batch-size must exceed 10 * --noise-multiplier (5)",
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
  assert (args.epochs if name == "dp_sgd" else args.steps) >= 1
