"""benchmarks/run.py --quick, floors.py and exact_recompute.py run and write
sane reports (so they never rot); run.py's command line.

Speed itself is not tested here (timings belong to benchmarks/RESULTS.md);
this checks that every row is measured and every figure is a positive number.
"""

import importlib
import math
import pathlib
import re
import sys

import pytest

from example_runner import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]

STEP_ROWS = (
  "one read pass alone (jitted sum of squares)",
  "adam + read (floor)",
  "adam + scale (floor)",
  "clip_global",
  "clip_global + stats()",
  "clip_norm",
  "clip_value",
  "clip_block_rms",
  "clip_unitwise",
  "clip_zscore",
  "clip_zscore(scope=leaf)",
  "clip_percentile",
  "clip_percentile(scope=leaf)",
  "clip_relative",
  "guard(adam)",
)
OPTAX_TWINS = {
  "clip_global": "optax.clip_by_global_norm",
  "clip_value": "optax.clip",
  "clip_block_rms": "optax.clip_by_block_rms",
  "clip_unitwise": "optax.adaptive_grad_clip",
  "guard(adam)": "optax.apply_if_finite",
}
RATIO = re.compile(r"^(\d+\.\d+)x")


def _cells(line):
  return [c.strip() for c in line.strip().strip("|").split("|")]


def _ratio(cell):
  match = RATIO.match(cell)
  assert match, f"not a ratio: {cell!r}"
  value = float(match.group(1))
  assert math.isfinite(value) and 0 < value < 100, cell
  return value


def _tables(text):
  """{section title: [cells of each body row]} for every markdown table."""
  tables, title = {}, None
  for line in text.splitlines():
    if line.startswith("### "):
      title = line[4:]
      tables[title] = []
    elif line.startswith("|") and title and not line.startswith("|---"):
      cells = _cells(line)
      if cells[0] not in ("variant", "step", "clipper"):
        tables[title].append(cells)
  return tables


@pytest.mark.slow
def test_quick_run_writes_a_sane_report(tmp_path):
  out = tmp_path / "RESULTS.md"
  stdout = run_script(
    "benchmarks/run.py", "--quick", "--out", str(out), cwd=ROOT
  )
  text = out.read_text(encoding="utf-8")
  assert text == stdout.rstrip("\n") + "\n"
  for key in ("Machine", "Versions", "Date", "Command", "Commit"):
    assert f"- {key}:" in text, key
  tables = _tables(text)
  step_tables = [t for t in tables if t.startswith("(")]
  assert [t[:3] for t in step_tables] == ["(a)", "(b)", "(c)"]
  for title in step_tables:
    rows = {cells[0].split(" <sub>")[0]: cells for cells in tables[title]}
    assert sorted(rows) == sorted(STEP_ROWS), title
    for name, cells in rows.items():
      _ratio(cells[1])
      if name in OPTAX_TWINS:
        assert cells[4] == OPTAX_TWINS[name]
        _ratio(cells[5])
      if not name.startswith("one read pass alone"):
        temps = cells[6].split(" / ")
        assert float(temps[0]) >= 0, cells
  compile_rows = next(
    rows for title, rows in tables.items() if title.startswith("Compile time")
  )
  names = [cells[0].split(" (")[0] for cells in compile_rows]
  assert names == [
    "adam",
    "chain(clip_global, adam)",
    "chain(optax.clip_by_global_norm, adam)",
  ]
  for cells in compile_rows:
    assert float(cells[1]) > 0 and float(cells[2]) > 0
    _ratio(cells[3])
  assert _ratio(compile_rows[0][3]) == 1.0
  leaves_rows = tables["Compile time of each clipper on many small leaves"]
  names = [cells[0] for cells in leaves_rows]
  assert names == list(_import("compile_time").CLIPPERS)
  for cells in leaves_rows:
    seconds, ratio = re.fullmatch(
      r"(\d+\.\d\d) \((\d+\.\d\d)x\)", cells[1]
    ).groups()
    assert float(seconds) > 0 and float(ratio) > 0, cells
    assert cells[2] in (("",) if cells[0] == "adam" else ("yes", "no"))


def _import(name):
  """A module of benchmarks/ (which put their folders on sys.path)."""
  saved = list(sys.path)
  sys.path.insert(0, str(ROOT / "benchmarks"))
  try:
    return importlib.import_module(name)
  finally:
    sys.path[:] = saved


def test_only_a_full_run_writes_the_committed_report():
  run = _import("run")
  committed = ROOT / "benchmarks" / "RESULTS.md"
  scratch = ROOT / "benchmarks" / "out" / "RESULTS.md"
  assert run.parse_args([]).out == committed
  assert run.parse_args(["--only", *run.SECTIONS]).out == committed
  assert run.parse_args(["--leaf-counts", "300"]).out == scratch
  assert run.parse_args(["--quick"]).out == scratch
  assert run.parse_args(["--only", "a", "compile"]).out == scratch
  assert run.parse_args(["--quick", "--out", "x.md"]).out == pathlib.Path(
    "x.md"
  )


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--only", "x"], "invalid choice: 'x'"),
    (["--only"], "expected at least one argument"),
    (["--rounds", "0"], "--rounds must be at least 1; got 0"),
    (["--leaf-counts", "0"], "--leaf-counts must be at least 1; got [0]"),
  ],
)
def test_bad_arguments_are_errors(argv, message, capsys):
  run = _import("run")
  with pytest.raises(SystemExit) as exit_info:
    run.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_help_says_how_long_a_run_takes(capsys):
  run = _import("run")
  with pytest.raises(SystemExit):
    run.parse_args(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert f"about {run.FULL_MINUTES} minutes" in text
  assert f"about {run.QUICK_SECONDS} s" in text


def _rows_at_a_tiny_size(script: str) -> list[list[str]]:
  """The table rows that ``benchmarks/<script>`` prints for 2 rounds on 3
  leaves of 1000 (tree (a)'s command line, harness.add_tree_a_arguments).
  """
  stdout = run_script(
    f"benchmarks/{script}",
    "--rounds",
    "2",
    "--leaves",
    "3",
    "--size",
    "1000",
    cwd=ROOT,
    timeout=300,
  )
  return [
    _cells(line)
    for line in stdout.splitlines()
    if line.startswith("| ") and not line.startswith("| variant")
  ]


@pytest.mark.slow
def test_floors_runs_at_a_tiny_size():
  rows = _rows_at_a_tiny_size("floors.py")
  floors = _import("floors")
  assert [cells[0] for cells in rows] == list(floors.VARIANTS)
  for cells in rows:
    _ratio(cells[1])
    assert float(cells[2]) >= 0, cells


@pytest.mark.slow
def test_exact_recompute_runs_at_a_tiny_size():
  """Every variant measured, and the script's own check passed: each scale
  sends the sums where the variant's name says.
  """
  rows = _rows_at_a_tiny_size("exact_recompute.py")
  script = _import("exact_recompute")
  assert [cells[0] for cells in rows] == list(script.variants())
  for cells in rows:
    _ratio(cells[1])
    _ratio(cells[2])
  direct = [cells for cells in rows if ", direct " in cells[0]]
  assert [_ratio(cells[2]) for cells in direct] == [1.0] * len(script.CLIPPERS)
