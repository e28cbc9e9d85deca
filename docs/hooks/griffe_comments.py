"""griffe extension: an attribute documented by ``#:`` comment lines just above it (the Sphinx
convention the package's sources use, as in ``Aggregation`` and ``EventOrigin``) gets that text
as its docstring on the API page, unless it has a docstring of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe


class CommentDocstrings(griffe.Extension):
    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None:
            return
        path = attr.filepath
        if not isinstance(path, Path) or path not in attr.lines_collection:
            return
        lines = attr.lines_collection[path]
        comment: list[str] = []
        i = attr.lineno - 2  # the line above, 0-based
        while i >= 0 and lines[i].strip().startswith("#:"):
            comment.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        if comment:
            attr.docstring = griffe.Docstring(" ".join(comment), parent=attr)
