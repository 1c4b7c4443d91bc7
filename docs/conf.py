"""Sphinx configuration of the moeforge documentation site.

Build (strict, as CI runs it):  sphinx-build -W --keep-going -n -b html docs docs/_build/html
Needs the ``docs`` extra: pip install ".[docs]" (Sphinx, MyST for the Markdown pages, sphinx-argparse for the CLI
reference, the Furo theme). The CLI reference and the Python API reference are generated from the installed
``moeforge`` (its argparse parser and its docstrings), so they cannot drift from the code.
"""

from __future__ import annotations

import moeforge

project = "moeforge"
author = "moeforge contributors"
copyright = "moeforge contributors"
release = moeforge.__version__
version = release

extensions = [
    "myst_parser",  # the pages are Markdown
    "sphinx.ext.autodoc",  # the Python API reference, from docstrings
    "sphinxarg.ext",  # the CLI reference, from moeforge.cli.parser.build_parser()
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown: "(label)=" targets, ::: fences, definition lists for the glossary, heading anchors for #links.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Python API reference: the descriptions come from the docstrings; type hints are listed under each signature
# (in the signature itself, long dataclass signatures become unreadable).
autodoc_typehints = "description"
autodoc_member_order = "bysource"

# -n (nitpicky) checks every cross-reference. Types from other packages (numpy, torch, onnx, ...) have no page here
# (no intersphinx: the build must work offline), and moeforge's internal types that appear in a public signature
# are described on the design pages rather than as API objects: neither may fail the build. Every other reference
# (pages, sections, documented objects) must resolve.
_EXTERNAL = (r"numpy|np|torch|onnx|onnx_ir|ir|tokenizers|pathlib|collections\.abc|typing|os|socket|argparse|fastapi"
             r"|uvicorn")
nitpick_ignore_regex = [
    (r"py:.*", rf"({_EXTERNAL})\..*"),
    (r"py:.*", r"moeforge\..*"),
    (r"py:.*", r"Path|Any|Sequence|Iterator|Iterable|Callable|Mapping|Literal|NDArray|MLAImpl|TierSettings"),
    (r"py:.*", r"BackendTokenizer"),
]

html_theme = "furo"
html_title = f"moeforge {release}"
html_static_path: list[str] = []

# Keep "--flag" as typed: smart quotes would turn the double hyphen of option names into a dash.
smartquotes = False
