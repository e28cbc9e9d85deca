"""griffe extension: the API page shows what a caller can use, not how ``__init__`` is written.

- An instance attribute (set in a method, ``self.hosts = hosts or [...]``) is shown without a
  value: that value is the method's code, not something a reader can rely on. A class-level
  default (a NamedTuple field's ``= None``) and a module constant keep theirs.
- A parameter whose name starts with ``_`` (a test seam, such as ``SystemMetrics``'s
  ``_nvml``) is left out of the signature: it is not part of the API. Callers never pass it,
  so it always has a default.
"""

from __future__ import annotations

from typing import Any

import griffe


class PublicSurface(griffe.Extension):
    def on_attribute(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if "instance-attribute" in attr.labels and "class-attribute" not in attr.labels:
            attr.value = None

    def on_function(self, *, func: griffe.Function, **kwargs: Any) -> None:
        private = [p.name for p in func.parameters if p.name.startswith("_")]
        for name in private:
            del func.parameters[name]
