"""mkdocs hook: serve the diagram library (mermaid) from the built site, not from a CDN; and
keep doctest directives (``# doctest: +SKIP``) of docstring examples out of the pages.

The theme loads mermaid from the internet when a page with a diagram opens, unless a global
``mermaid`` is already defined; this hook adds a pinned copy to the site and to its scripts,
so diagrams render offline. The copy comes from the npm registry's tarball of that version,
checked against the registry's sha512 integrity and cached in the user's cache directory, so
only a first build needs the network. To update: set VERSION and INTEGRITY to the values of
``npm view mermaid@<version> dist.integrity`` (the theme wants major version 11).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

VERSION = "11.17.2"
INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
TARBALL = f"https://registry.npmjs.org/mermaid/-/mermaid-{VERSION}.tgz"
MEMBER = "package/dist/mermaid.min.js"
SITE_PATH = "assets/javascripts/mermaid.min.js"

_script: bytes | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "monitor_bus-docs"


def _verified(data: bytes) -> bool:
    algorithm, _, digest = INTEGRITY.partition("-")
    return base64.b64encode(hashlib.new(algorithm, data).digest()).decode() == digest


def _tarball() -> bytes:
    """The pinned tarball: from the cache if it is there and intact, else from the registry."""
    cached = _cache_dir() / f"mermaid-{VERSION}.tgz"
    if cached.is_file():
        data = cached.read_bytes()
        if _verified(data):
            return data
    try:
        with urllib.request.urlopen(TARBALL, timeout=60) as response:
            data = response.read()
    except OSError as exc:
        raise RuntimeError(
            f"docs: cannot fetch mermaid {VERSION} ({TARBALL}): {exc}; diagrams need it once, "
            f"then it is cached in {cached.parent}"
        ) from exc
    if not _verified(data):
        raise RuntimeError(f"docs: {TARBALL} does not match its pinned integrity {INTEGRITY}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, cached)  # a build running beside this one never reads half a file
    return data


def mermaid_script() -> bytes:
    """mermaid.min.js of the pinned version."""
    global _script
    if _script is None:
        with tarfile.open(fileobj=io.BytesIO(_tarball()), mode="r:gz") as tar:
            member = tar.extractfile(MEMBER)
            if member is None:
                raise RuntimeError(f"docs: {TARBALL} has no {MEMBER}")
            _script = member.read()
    return _script


def on_config(config: Any) -> Any:
    config.extra_javascript.append(SITE_PATH)
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, SITE_PATH, content=mermaid_script()))
    return files


# A highlighted comment that is only a doctest directive, with the spaces before it.
_DIRECTIVE = re.compile(r'\s*<span class="c1">#\s*doctest:[^<]*</span>')


def on_page_content(html: str, **kwargs: Any) -> str:
    """Drop doctest directives from code blocks: they are for the doctest run, not readers
    (mkdocstrings trims them too in some versions; this holds for all)."""
    return _DIRECTIVE.sub("", html)
