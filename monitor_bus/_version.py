"""The package's version, its one copy: read by the build (pyproject.toml), re-exported as
``monitor_bus.__version__`` and imported by the modules that report it, below the package."""

from __future__ import annotations

__version__ = "0.1.0"
