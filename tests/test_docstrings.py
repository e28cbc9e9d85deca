"""Every docstring example in the package runs as a doctest (the API reference shows them).

Lines marked ``# doctest: +SKIP`` need what a test cannot have (PyTorch, a collector); the
site hides the directive. Modules of optional integrations are checked where their package is
installed, and skipped (failed under CI=true) where it is not.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from types import ModuleType

import pytest

import monitor_bus

from .conftest import require

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(monitor_bus.__path__, prefix="monitor_bus.")
    if info.name != "monitor_bus.__main__"
)


def test_modules_are_found() -> None:
    """The walk finds the package's modules, so the doctest run below is not empty."""
    assert {"monitor_bus._event", "monitor_bus._stat", "monitor_bus.tensorboard"} <= set(MODULES)


def load(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(False, f"{name} needs {exc.name}, which is not installed")
        raise


def private_names() -> dict[str, object]:
    """The globals of the package's core modules (``monitor_bus._*``), merged."""
    merged: dict[str, object] = {}
    for name in MODULES:
        if name.count(".") == 1 and name.startswith("monitor_bus._"):
            merged.update(vars(importlib.import_module(name)))
    return merged


@pytest.mark.parametrize("name", ["monitor_bus", *MODULES])
def test_docstring_examples_run(name: str) -> None:
    """The module's docstring examples give the output they show."""
    module = load(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failures: list[str] = []
    attempted = 0
    for test in finder.find(module, name):  # each with a copy of the module's globals
        if module is monitor_bus:
            # The public objects report the package as their module, so their examples are
            # found here; they run with the names of the private modules that define them.
            test.globs = {**private_names(), **test.globs}
        attempted += runner.run(test, out=failures.append).attempted
    assert "".join(failures) == ""
    if module is monitor_bus:
        assert attempted >= 10  # Event, Stat, EventBus, ... : the examples were found
