"""mkdocs hook: pages that read on a phone's narrow screen as on a wide one.

- Every image in a page is a link to its own file, so a figure shrunk to a phone's column
  opens at full size with a tap (no lightbox script, no plugin).
- A diagram (mermaid) sits in a box of its own, where the stylesheet gives it a phone's
  readable width and lets it scroll sideways: shrunk to the column, its labels would be 4 px.
- A dotted API name in a heading (``monitor_bus.integrations.torch.merge_stats_across_ranks``)
  may break after each dot and nowhere else: the hook puts a ``<wbr>`` after each dot, and the
  stylesheet (docs/stylesheets/extra.css) forbids breaking inside the name.
"""

from __future__ import annotations

import re
from typing import Any

# An <img> with what comes before it, if that opens a link (an image already linked is left).
_IMAGE = re.compile(r"(<a\b[^>]*>\s*)?(<img\b[^>]*>)")
_SRC = re.compile(r'\bsrc="([^"]+)"')
# A diagram's source, which the theme replaces with the drawing in place.
_DIAGRAM = re.compile(r'<pre class="mermaid">.*?</pre>', re.S)
# The name in a heading that mkdocstrings renders for an API object.
_OBJECT_NAME = re.compile(r'(<span class="doc doc-object-name[^"]*">)([^<]+)(</span>)')


def _link_image(match: re.Match[str]) -> str:
    opened, image = match[1], match[2]
    src = _SRC.search(image)
    if opened is not None or src is None:
        return match[0]
    return f'<a href="{src[1]}" title="Open the full-size image">{image}</a>'


def _box_diagram(match: re.Match[str]) -> str:
    return f'<div class="diagram">{match[0]}</div>'


def _break_at_dots(match: re.Match[str]) -> str:
    return match[1] + match[2].replace(".", ".<wbr>") + match[3]


def on_page_content(html: str, **kwargs: Any) -> str:
    """Link each image to its file, box each diagram, let API names in headings break only
    after a dot."""
    html = _IMAGE.sub(_link_image, html)
    html = _DIAGRAM.sub(_box_diagram, html)
    return _OBJECT_NAME.sub(_break_at_dots, html)
