"""Sphinx configuration of the pymc_sgmcmc documentation (``make docs``)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

DOCS = Path(__file__).parent
sys.path.insert(0, str(DOCS / "_ext"))

import pymc_sgmcmc  # noqa: E402  (the installed package, so autodoc documents what users get)

project = "pymc_sgmcmc"
author = "pymc_sgmcmc contributors"
copyright = "2026, pymc_sgmcmc contributors"
release = version = pymc_sgmcmc.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
    "pymc_sgmcmc_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# Markdown pages: $...$ / $$...$$ maths, ::: fences, definition lists, (label)= targets.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# API: class docstrings are numpydoc; parameter types are documented there, so signatures
# stay unannotated (their annotations name private module paths).
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
numpydoc_class_members_toctree = False
# numpydoc also parses each raw class docstring for its signature and warns (a Python warning,
# not a Sphinx one) about the "Sampler stats" section; the pymc_sgmcmc_docs extension renders
# that section in the page.
warnings.filterwarnings("ignore", message="Unknown section Sampler Stats", category=UserWarning)

# Nitpicky mode (-n) resolves every cross-reference. Objects of other projects cannot be
# resolved without intersphinx inventories, which would be downloaded at build time (CI has no
# network), and the package's internals are not part of the documented API.
nitpick_ignore = [
    ("py:func", "pytensor.function"),
    ("py:meth", "pymc_sgmcmc.model_layer.Covariance.expm_matvec"),
]

# MathJax is loaded from its CDN by the reader's browser; nothing is fetched at build time.
html_theme = "pymc_sphinx_theme"
html_title = "pymc_sgmcmc"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    # pymc-sphinx-theme's defaults advertise the PyMC project itself (its icon links, donation
    # box and analytics id): keep the theme's look, not those.
    "navbar_end": ["theme-switcher", "navbar-icon-links"],
    "secondary_sidebar_items": ["page-toc", "sourcelink"],
    "google_analytics_id": "",
    "show_prev_next": True,
    "use_search_override": False,
}
# Few pages, all in the top navigation bar: no left sidebar.
html_sidebars: dict[str, list[str]] = {"**": []}
