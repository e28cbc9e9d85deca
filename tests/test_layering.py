"""The package's layering: top-level imports form a DAG, and an import made inside a function is
one of a fixed few, each lazy for its cost (STYLE.md, "Imports run one way"). The sources are
read with ``ast`` by docs/module_map.py, the generator of the design page's module map."""

from __future__ import annotations

from typing import Any

from .test_docs import _module_map

# (module, the package module it imports inside a function), each with why it waits.
LAZY_FOR_COST = {
    ("_cli", "_demo"),  # numpy and the demo's network, only for `monitor-bus demo`
    ("_default", "system"),  # only when system metrics are asked for; registers an atexit
    ("_demo", "tensorboard"),  # the tensorboard extra, only when asked for
    ("exporters.otel", "exporters._otel_histogram"),  # the OpenTelemetry extra's types
}


def test_imports_inside_functions_are_only_those_lazy_for_their_cost() -> None:
    """Every import of a package module made inside a function is in the allow-list, and the
    allow-list holds no import that is gone: a new lazy import (one climbing back up to a
    higher module) fails here."""
    module_map: Any = _module_map()
    found = module_map.modules()
    lazy = {(name, target) for name, module in found.items() for target in module.lazy}
    assert lazy == LAZY_FOR_COST


def test_top_level_imports_form_a_dag() -> None:
    """Each module's layer is above every module it imports at its top; a cycle raises."""
    module_map: Any = _module_map()
    found = module_map.modules()
    layer = module_map.layers(found)
    assert set(layer) == set(found)
    assert all(layer[name] > layer[target] for name, m in found.items() for target in m.top)
