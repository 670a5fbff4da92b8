"""Sphinx configuration for optaxclip's documentation.

Build it with ``python -m sphinx -W -b html docs docs/_build/html`` (the
``docs`` extra installs what it needs); ``.ci/run`` builds it with warnings as
errors.
"""

import optaxclip

project = "optaxclip"
author = "The optaxclip authors"
copyright = "2026, The optaxclip authors"  # noqa: A001 (Sphinx's name)
version = release = optaxclip.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# The docstrings are Google style (Args:, Returns:, Attributes:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
autosummary_generate = False

# Markdown: ``{include}`` of the README's sections, anchors for ``#`` links.
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]


html_theme = "alabaster"
html_title = f"optaxclip {release}"
html_theme_options = {
  "description": "Gradient clipping for JAX, as optax transformations"
}
