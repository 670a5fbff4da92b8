"""The examples, the README's and the guides' code run, so they never rot.

The examples run at tiny sizes; the Python blocks of README.md and of
docs/*.md each run on their own, as a reader would paste them.
"""

import math
import pathlib
import re

import pytest

from example_runner import load_script
from example_runner import run_script
import optaxclip

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# The guides moved from the README to the Sphinx site keep their code tested.
GUIDES = {
  path.name: path.read_text(encoding="utf-8")
  for path in sorted((ROOT / "docs").glob("*.md"))
}


@pytest.mark.slow
def test_lstm_exploding_prints_the_table_and_writes_the_png(tmp_path):
  out = tmp_path / "plots" / "lstm.png"
  stdout = run_script(
    "examples/lstm_exploding.py",
    "--steps",
    "20",
    "--out",
    str(out),
    cwd=tmp_path,
  )
  header = re.search(
    r"^variant +final loss +best loss +max pre-clip norm "
    r"+steps clipped +diverged +learned$",
    stdout,
    re.M,
  )
  assert header, stdout
  variants = load_script("examples/lstm_exploding.py").VARIANTS
  rows = {}
  for name in variants:
    row = re.search(
      rf"^{name} +(\S+) +(\S+) +(\S+) +(\d+)% +(yes|no) +(yes|no)$",
      stdout,
      re.M,
    )
    assert row, f"no row for {name}:\n{stdout}"
    rows[name] = row.groups()
  for name, (final, best, norm, _, diverged, _) in rows.items():
    assert math.isfinite(float(final)) and diverged == "no", (name, stdout)
    assert 0 < float(best) <= float(final), (name, stdout)
    assert float(norm) > 0, (name, stdout)
  # The unclipped run logs its norm through clip_global(inf): it clips nothing.
  assert rows["none"][3] == "0"
  assert int(rows["clip_global"][3]) > 0
  assert f"plot: {out}" in stdout
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_which_layer_names_the_bad_layer_and_writes_the_heatmap(tmp_path):
  out = tmp_path / "which_layer.png"
  stdout = run_script(
    "examples/which_layer.py",
    "--steps",
    "6",
    "--layers",
    "3",
    "--width",
    "4",
    "--bad-layer",
    "1",
    "--out",
    str(out),
    "--tensorboard",
    str(tmp_path / "tb"),
    cwd=tmp_path,
  )
  sentences = re.findall(r"^  step \d+: (clip_global .*)$", stdout, re.M)
  assert len(sentences) == 3, stdout
  # The badly scaled block carries most of the squared norm.
  for sentence in sentences:
    assert sentence.endswith("came from blocks/w (layer 1)"), stdout
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
  assert events and all(e.stat().st_size > 0 for e in events), events


@pytest.mark.slow
def test_nnx_quickstart_prints_the_pre_clip_norm(tmp_path):
  stdout = run_script(
    "examples/nnx_quickstart.py",
    "--steps",
    "5",
    "--seq-len",
    "10",
    cwd=tmp_path,
  )
  norms = re.findall(r"pre-clip norm +(\S+) +clipped (yes|no)", stdout)
  assert len(norms) == 5, stdout
  assert all(math.isfinite(float(n)) and float(n) > 0 for n, _ in norms)


def _python_blocks(markdown):
  return re.findall(r"^```python\n(.*?)^```", markdown, re.M | re.S)


def _run_blocks(markdown, name):
  """Each block on its own, as a reader would paste it."""
  blocks = _python_blocks(markdown)
  for i, code in enumerate(blocks):
    namespace = {"__name__": f"{name}_block_{i}"}
    exec(compile(code, f"{name} python block {i}", "exec"), namespace)  # noqa: S102
  return len(blocks)


@pytest.mark.slow
def test_readme_python_blocks_run(capsys):
  assert _run_blocks(README, "README.md") >= 3
  printed = capsys.readouterr().out
  # The quickstarts print the pre-clip norm they read with stats().
  assert len(re.findall(r"pre-clip norm \d", printed)) >= 6, printed


@pytest.mark.slow
def test_docs_python_blocks_run():
  ran = {
    name: _run_blocks(text, f"docs/{name}") for name, text in GUIDES.items()
  }
  # The guides moved from the README keep their examples.
  for guide in ("migrating.md", "which_clipper.md", "many_devices.md"):
    assert ran[guide] >= 1, ran


def test_readme_has_the_two_setup_commands_verbatim():
  lines = README.splitlines()
  assert (
    'python -m pip install -e ".[examples]" && '
    "python examples/lstm_exploding.py"
  ) in lines
  assert 'python -m pip install -e ".[test]" && python -m pytest' in lines


def test_readme_has_the_docs_preview_command():
  # The same build as .ci/run's, warnings as errors.
  assert (
    'python -m pip install -e ".[docs]" && '
    "python -m sphinx -W -b html docs docs/_build/html"
  ) in (README.splitlines())
  assert "-m sphinx -W " in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_readme_links_to_every_docs_page():
  for page in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "docs/api.rst"]:
    if page.stem in ("index", "changelog", "contributing") or (
      page.stem.startswith("benchmark_")
    ):
      continue  # reached from the docs' index and from the guides
    assert f"](docs/{page.name})" in README, page.name


def test_api_reference_documents_every_public_name():
  api = (ROOT / "docs" / "api.rst").read_text(encoding="utf-8")
  documented = set(
    re.findall(r"^\.\. auto(?:function|class):: (\w+)$", api, re.M)
  )
  missing = sorted(set(optaxclip.__all__) - documented)
  assert not missing, f"docs/api.rst does not document {missing}"
  unknown = sorted(documented - set(optaxclip.__all__))
  assert not unknown, f"docs/api.rst documents {unknown}, not in __all__"


def test_readme_and_guides_name_only_what_exists():
  for name, text in {"README.md": README, **GUIDES}.items():
    named = set(re.findall(r"\boptaxclip\.([A-Za-z_]\w*)", text))
    unknown = sorted(n for n in named if not hasattr(optaxclip, n))
    assert not unknown, f"{name} names optaxclip.{unknown}, which do not exist"
