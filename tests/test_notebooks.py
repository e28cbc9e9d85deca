"""Every notebook in examples/ runs top to bottom on a real ipykernel kernel without a cell error."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import require

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def _execute(path: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    try:
        import ipykernel  # noqa: F401
        import nbclient
        import nbformat
    except ImportError as exc:
        require(False, f"notebook tooling missing: {exc}")
    # The kernel inherits the environment: draw with the inline backend, never a GUI.
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()  # raises CellExecutionError on the first cell that fails
    return nb


def _stdout(cell) -> str:  # type: ignore[no-untyped-def]
    return "".join(
        o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"
    )


def test_there_are_notebooks() -> None:
    """The examples include the quickstart and the live-metrics notebooks."""
    assert [p.name for p in NOTEBOOKS] == ["live_metrics.ipynb", "quickstart.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path: Path) -> None:
    """No committed notebook carries outputs or execution counts."""
    import json

    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == []
            assert cell["execution_count"] is None


def test_quickstart_runs_and_a_rerun_registration_does_not_double(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quickstart executes; its re-registered named handler got the next event once."""
    nb = _execute(EXAMPLES / "quickstart.ipynb", tmp_path, monkeypatch)
    outputs = [_stdout(c) for c in nb.cells if c.cell_type == "code"]
    assert "[0, 1, 2]\n" in outputs
    assert "1 ['remember']\n" in outputs
    assert "{'step_time.mean': 0.02, 'step_time.max': 0.03, 'step_time.count': 3}\n" in outputs


def test_live_metrics_plot_refreshes_from_a_subscription(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live-metrics notebook executes, its plot output is a PNG, and every step was plotted once."""
    nb = _execute(EXAMPLES / "live_metrics.ipynb", tmp_path, monkeypatch)
    code = [c for c in nb.cells if c.cell_type == "code"]
    plot_cell = next(c for c in code if "await follow(STEPS)" in c.source)
    images = [
        o for o in plot_cell.outputs if o.output_type == "display_data" and "image/png" in o.data
    ]
    assert len(images) == 1  # one display, updated in place
    assert _stdout(plot_cell).startswith("plotted 600 steps, final loss ")
    assert _stdout(plot_cell).endswith(", dropped 0\n")
    assert _stdout(code[-1]) == "{'steps': 600}\n"
    rerun = [c for c in code if 'name="count-steps"' in c.source]
    assert len(rerun) == 2  # the registration cell, and the same cell run again
    assert _stdout(rerun[1]) == "['count-steps']\n"  # one handler, not two
