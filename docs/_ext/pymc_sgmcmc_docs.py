"""Two small Sphinx hooks for this site.

* ``Sampler stats`` (and any other section numpydoc does not know) in a class docstring would be
  dropped by numpydoc with only a Python warning, so such sections are moved, before numpydoc
  sees the docstring, to the end of its ``Notes`` section as a rubric and a definition list.
* A sampler's signature is its ``__init__``'s (PyMC's step methods define ``__new__(*args,
  **kwargs)``, which autodoc would show instead), without annotations: the types are in the
  docstrings.
* Every name of ``pymc_sgmcmc.__all__`` must be documented (as ``pymc_sgmcmc.NAME``): a
  missing one is a warning, so the ``-W`` build fails when a new sampler is not in the API page.
* ``<!-- include-if-exists: PATH -->`` in a Markdown page becomes a MyST ``include`` of PATH
  (relative to the page) when that file exists, and nothing otherwise: the results page shows
  ``examples/README.md`` whenever the examples are in the checkout.
* Relative links in an included Markdown file are written relative to that file (as on
  GitHub); they are rewritten relative to the including page, so that a link to a file
  becomes a download link (or a page link, for a page of this site), and a link to anything
  else (a folder) is reduced to its text instead of a broken reference.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

#: Section titles numpydoc renders (numpydoc.docscrape.NumpyDocString.sections).
KNOWN_SECTIONS = {
    "Parameters",
    "Returns",
    "Yields",
    "Receives",
    "Raises",
    "Warns",
    "Other Parameters",
    "Attributes",
    "Methods",
    "See Also",
    "Notes",
    "Warnings",
    "References",
    "Examples",
}

INCLUDE_MARKER = re.compile(r"^<!-- include-if-exists: (?P<path>\S+) -->$", re.MULTILINE)
#: An inline Markdown link (not an image): [text](target "optional title").
INLINE_LINK = re.compile(r'(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+"[^"]*")?\)')
#: Targets left alone: URLs, in-page anchors, absolute paths, MyST's explicit schemes.
NOT_RELATIVE = re.compile(r"^([a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)


def _is_header(lines: list[str], i: int) -> bool:
    """A numpydoc section header: a title line underlined by dashes of the same length."""
    if i + 1 >= len(lines):
        return False
    title, rule = lines[i].strip(), lines[i + 1].strip()
    return bool(title) and len(rule) == len(title) and set(rule) == {"-"}


def _sections(lines: list[str]) -> list[tuple[str, int, int]]:
    """(title, first line, end line) of each section, in order."""
    starts = [i for i in range(len(lines)) if _is_header(lines, i)]
    ends = [*starts[1:], len(lines)] if starts else []
    return [(lines[s].strip(), s, e) for s, e in zip(starts, ends, strict=True)]


def _as_rubric(title: str, body: list[str]) -> list[str]:
    """An unknown section's body (``name : type`` / indented description) as reST: a rubric
    followed by the body, which reST reads as a definition list with classifiers."""
    while body and not body[-1].strip():
        body = body[:-1]
    return ["", f".. rubric:: {title}", "", *body, ""]


def move_unknown_sections(app, what, name, obj, options, lines: list[str]) -> None:
    """``autodoc-process-docstring`` handler (runs before numpydoc's, which drops unknown
    sections): append every unknown section to the end of the ``Notes`` section."""
    sections = _sections(lines)
    unknown = [s for s in sections if s[0].title() not in KNOWN_SECTIONS]
    if not unknown:
        return
    moved: list[str] = []
    for title, start, end in reversed(unknown):
        moved = _as_rubric(title, lines[start + 2 : end]) + moved
        del lines[start:end]
    notes = [s for s in _sections(lines) if s[0] == "Notes"]
    if notes:
        lines[notes[0][2] : notes[0][2]] = moved
    else:
        lines.extend(["", "Notes", "-----", *moved])


def init_signature(app, what, name, obj, options, signature, return_annotation):
    """``autodoc-process-signature`` handler: a class's signature from its own ``__init__``."""
    init = getattr(obj, "__init__", None)
    if what != "class" or not inspect.isfunction(init):
        return None
    parameters = list(inspect.signature(init).parameters.values())[1:]  # drop self
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
    return str(inspect.Signature(bare)), None


def include_if_exists(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read`` handler: expand the ``include-if-exists`` markers of a page."""
    page_dir = Path(app.env.doc2path(docname)).parent

    def expand(match: re.Match) -> str:
        path = match.group("path")
        # Recorded even while missing (Sphinx then re-reads the page on every build), so that
        # an incremental build notices the file appearing.
        app.env.note_dependency(str((page_dir / path).resolve()))
        if not (page_dir / path).is_file():
            return ""
        return f"```{{include}} {path}\n:relative-images:\n:heading-offset: 1\n```"

    source[0] = INCLUDE_MARKER.sub(expand, source[0])


def relink_included(app: Sphinx, relative_path: Path, parent_docname: str, content: list[str]):
    """``include-read`` handler: rewrite the relative links of an included Markdown file."""
    if Path(relative_path).suffix != ".md":
        return
    srcdir = Path(app.srcdir)
    included_dir = (srcdir / relative_path).resolve().parent
    page_dir = Path(app.env.doc2path(parent_docname)).resolve().parent

    def relink(match: re.Match) -> str:
        target = match.group("target")
        if NOT_RELATIVE.match(target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = (included_dir / path).resolve()
        if not resolved.is_file():
            return match.group("text")
        new = Path(os.path.relpath(resolved, page_dir)).as_posix() + (
            f"#{anchor}" if anchor else ""
        )
        return f"[{match.group('text')}]({new}{match.group('title') or ''})"

    content[0] = INLINE_LINK.sub(relink, content[0])


def check_api_complete(app: Sphinx, env) -> None:
    """``env-check-consistency`` handler: warn about public names the API page omits."""
    import pymc_sgmcmc

    documented = env.get_domain("py").objects
    for name in pymc_sgmcmc.__all__:
        if f"pymc_sgmcmc.{name}" not in documented:
            logger.warning("pymc_sgmcmc.%s is in __all__ but not documented (docs/api.rst)", name)


def setup(app: Sphinx) -> dict:
    # numpydoc connects its own handler with the default priority 500; ours must run first.
    app.connect("autodoc-process-docstring", move_unknown_sections, priority=400)
    app.connect("autodoc-process-signature", init_signature, priority=400)
    app.connect("source-read", include_if_exists)
    app.connect("include-read", relink_included)
    app.connect("env-check-consistency", check_api_complete)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
