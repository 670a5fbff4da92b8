"""benchmarks/run.py --quick, floors.py and studies/exact_recompute.py run
and write sane reports (so they never rot); run.py's command line; what
benchmarks/edge_cases.py reports now.

Speed itself is not tested here (timings belong to benchmarks/RESULTS.md);
this checks that every row is measured and every figure is a positive number.
"""

import importlib
import json
import math
import pathlib
import re
import sys

import pytest

from example_runner import load_script
from example_runner import run_script
import optaxclip

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
  "guard(adam, scope=leaf)",
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


def _import(name, folder="benchmarks"):
  """A module of benchmarks/ or a folder below it (which put their folders
  on sys.path).
  """
  saved = list(sys.path)
  sys.path.insert(0, str(ROOT / "benchmarks"))
  sys.path.insert(0, str(ROOT / folder))
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


def test_a_full_run_keeps_the_other_benchmarks(tmp_path, monkeypatch):
  """A full run rewrites run.py's part of RESULTS.md and keeps the other
  scripts' runs, from ``## Other benchmarks`` on; other outputs keep nothing.
  """
  run = _import("run")
  results = tmp_path / "RESULTS.md"
  monkeypatch.setattr(run, "RESULTS", results)
  assert run.kept_part(results) == ""
  results.write_text(
    "# old run\n\n| a |\n\n## Other benchmarks\n\n### ghost\n\n| b |\n\n",
    encoding="utf-8",
  )
  assert (
    run.kept_part(results) == "\n## Other benchmarks\n\n### ghost\n\n| b |\n"
  )
  assert run.kept_part(tmp_path / "other.md") == ""
  committed = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
  assert f"\n{run.OTHER_SCRIPTS}\n" in committed


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--only", "x"], "invalid choice: 'x'"),
    (["--only"], "expected at least one argument"),
    (["--rounds", "0"], "--rounds must be at least 1; got 0"),
    (["--leaf-counts", "0"], "--leaf-counts must be at least 1; got [0]"),
    (["--leaf-rounds", "0"], "--leaf-rounds must be at least 1; got 0"),
  ],
)
def test_bad_arguments_are_errors(argv, message, capsys):
  run = _import("run")
  with pytest.raises(SystemExit) as exit_info:
    run.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_leaf_rounds_reach_the_compile_section(monkeypatch):
  """--leaf-rounds N: every clipper compiled in N interleaved rounds, and
  the section says how many (--rounds, for step times, did not reach it:
  a table headed "three rounds" had one).
  """
  run = _import("run")
  calls = []

  def measure(names, n_leaves, rounds=1, tree="mixed", log=None):
    calls.append((n_leaves, rounds))
    return {name: [1.0] * rounds for name in ["adam", *names]}

  monkeypatch.setattr(run.compile_time, "measure", measure)
  args = run.parse_args(["--only", "leaves", "--leaf-rounds", "3"])
  sizes = run.Sizes(leaf_counts=(7, 9), leaf_rounds=args.leaf_rounds)
  lines = run.run_leaves(sizes)
  assert calls == [(7, 3), (9, 3)]
  assert "3 interleaved rounds (--leaf-rounds), wall seconds." in lines


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
  rows = _rows_at_a_tiny_size("studies/exact_recompute.py")
  script = _import("exact_recompute", "benchmarks/studies")
  assert [cells[0] for cells in rows] == list(script.variants())
  for cells in rows:
    _ratio(cells[1])
    _ratio(cells[2])
  direct = [cells for cells in rows if ", direct " in cells[0]]
  assert [_ratio(cells[2]) for cells in direct] == [1.0] * len(script.CLIPPERS)


# What each edge case gives now (benchmarks/edge_cases.py's "now" column), so
# that the script neither rots nor drifts from the fixes.
EDGE_CASES_NOW = {
  "clip_norm_1e38": "out norm 1, norm 1.41e+38",
  "clip_relative_warmup_1e38": "out norm 1 (",
  "clip_per_example_1e38": "sum's out norm 1.5 (",
  "clip_global_sharded_1e38": "out norm 1, norm 1.41e+38",
  "clip_global_tiny_factor": "out norm 0.001 (",
  "hessians": "6 of 6 ok",
  "percentile_and_relative_1e_50": "out norms 2.24e-50 / 2.24e-50",
  "guard_1e200": "skipped 0 of 2, nonfinite 0",
  "guard_after_zero_warmup": "skipped 0 of 200",
  "zscore_after_zero_warmup": "last out norm 1.41 of",
  "relative_zero_leaf_once": "leaf a's last out norm 0.777 of",
  "clip_global_nan_leaf": "b nan, clip_fraction 1",
  "per_example_nonfinite_example": "sum [0.5, 0.0]",
  "adaptive_clipped_norm_on_inf": "update NaN: True, clipped_norm nan",
  "per_example_inf_clip": "accepted, out norm 5",
  "eager_injected_clip_global": " ms a call",
  "stats_foreign_namedtuple": "keys ['clip_global/clip_fraction',",
  "stats_colliding_paths": "4 norm keys",
  "stats_time_1000_leaves": " ms a call",
  "guard_counter_dtype": "guard/skipped int32",
  "warmup_steps=2**31": "ValueError: clip_zscore: warmup_steps must be",
  'sharded="no"': "TypeError: clip_global: sharded must be",
  'axis_name=""': "ValueError: clip_global: axis_name must",
  "seed=PRNGKey": "accepted",
  "clip_relative(factor=0.5)": "ValueError: clip_relative: factor must be",
  "clip_norm(-1.0)": "ValueError: clip_norm: max_norm must be",
}


def test_edge_cases_as_they_are_now():
  module = load_script("benchmarks/edge_cases.py")
  got = {
    fn.__name__: module.result(fn, optaxclip) for _, _, fn in module.REPORTS
  }
  assert set(got) == set(EDGE_CASES_NOW)
  for name, want in EDGE_CASES_NOW.items():
    assert want in got[name], (name, got[name])


def test_ghost_soundness_study_reports_exact_norms(capsys):
  """studies/ghost_soundness.py: every model's ghost norm is the exact one
  and each clipped gradient stays within l2_clip = 1.
  """
  _import("ghost_soundness", "benchmarks/studies").main()
  rows = [
    line.split("|")[1:-1]
    for line in capsys.readouterr().out.splitlines()
    if line.startswith("| ") and "%" in line
  ]
  assert len(rows) == 5
  for name, ghost, exact, error, ghost_clipped, vmap_clipped in rows:
    assert float(ghost) == pytest.approx(float(exact), rel=1e-3), name
    assert error.strip() == "0.00%", name
    assert float(ghost_clipped) <= 1.0 + 1e-6, name
    assert float(vmap_clipped) <= 1.0 + 1e-6, name


def test_program_fingerprints_tell_same_reordered_and_changed(tmp_path):
  """benchmarks/programs.py: a run equals itself row by row; a program
  with the same ops in another order, or with another op, is told apart.
  """
  programs = _import("programs")
  assert programs.main(["--tiny", "--out", str(tmp_path / "a.json")]) == 0
  prints = json.loads((tmp_path / "a.json").read_text())
  assert set(prints) == {
    f"{tree}/{row}" for tree in "abc" for row in STEP_ROWS[1:]
  }
  assert programs.compare(prints, prints)[2:] == [
    f"| {name} | same |" for name in prints
  ]
  one = programs.fingerprint('%0 = stablehlo.add %a, %b loc("x.py":1:2)\n')
  moved = programs.fingerprint('%0 = stablehlo.add %a, %b loc("y.py":9:9)\n')
  assert one == moved  # source locations are not the program
  two = programs.fingerprint("%0 = stablehlo.add %b, %a\n")
  other = programs.fingerprint("%0 = stablehlo.multiply %a, %b\n")
  old, new = {"s": one, "t": one, "u": one}, {"s": one, "t": two, "v": other}
  assert programs.compare(old, new)[2:] == [
    "| s | same |",
    "| t | same ops, another order |",
    "| u | only in the old run |",
    "| v | only in the new run |",
  ]
  new["u"] = other
  assert "| u | changed |" in programs.compare(old, new)
