"""``python -m monitor_bus`` and the ``monitor-bus`` console script."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._cli import run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``monitor-bus`` command line (``demo``, ``summary``, ``plot``, ``--version``).

    Args:
        argv: the arguments after the program name; ``sys.argv[1:]`` if None.

    Returns:
        The exit status: 0 on success (also when lines or values were skipped, which are
        reported on stderr), 1 on an error (reported in one line on stderr), 2 on a usage
        error, 130 when interrupted by Ctrl-C.
    """
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
