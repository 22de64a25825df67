"""The notebooks run top to bottom, and are stored without outputs; the README example runs.

The notebooks read their setting from the environment: ``KVEDIT_NB_MODEL`` (here the tiny
random ``tiny-llama``), ``KVEDIT_NB_TRIALS``, ``KVEDIT_NB_RECORDS``, ``KVEDIT_NB_MAX_NEW_TOKENS``
and ``KVEDIT_NB_OUT``. Set ``KVEDIT_NB_TEST_MODEL`` to run them on another model, e.g. the
bundled ``smollm2-135m-instruct``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
NB_MODEL = os.environ.get("KVEDIT_NB_TEST_MODEL", "tiny-llama")


def test_the_notebooks_are_there():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "lost_in_the_middle.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], (
                f"{path.name}: a cell has outputs; clear them with "
                "`python tests/test_notebooks.py --clear notebooks/*.ipynb`"
            )
            assert cell.execution_count is None, f"{path.name}: clear the execution counts"
        assert "execution" not in cell.metadata, f"{path.name}: clear the run timestamps"


def execute(path: Path, tmp_path: Path, monkeypatch) -> nbformat.NotebookNode:
    """Run a notebook in a fresh kernel (cwd: notebooks/) on the small setting."""
    monkeypatch.setenv("KVEDIT_NB_MODEL", NB_MODEL)
    monkeypatch.setenv("KVEDIT_NB_TRIALS", "1")
    monkeypatch.setenv("KVEDIT_NB_RECORDS", "8")
    monkeypatch.setenv("KVEDIT_NB_MAX_NEW_TOKENS", "6")
    monkeypatch.setenv("KVEDIT_NB_OUT", str(tmp_path / "out"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel draws plots inline
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def outputs_text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(
        out.get("text", "") or str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )


def test_quickstart_runs(tmp_path, monkeypatch):
    nb = execute(REPO / "notebooks" / "quickstart.ipynb", tmp_path, monkeypatch)
    text = outputs_text(nb)
    assert "answer from the loaded cache" in text
    assert re.search(r"attention on the gold record: [\d.]+% -> [\d.]+%", text)
    assert any(  # the per-layer plot is drawn
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    )


def test_lost_in_the_middle_runs(tmp_path, monkeypatch):
    nb = execute(REPO / "notebooks" / "lost_in_the_middle.ipynb", tmp_path, monkeypatch)
    text = outputs_text(nb)
    for method in ("none", "auto", "oracle"):
        assert re.search(rf"^{method}\s", text, re.MULTILINE), f"no row for {method}"
    assert (tmp_path / "out" / "curve.png").stat().st_size > 10_000
    assert (tmp_path / "out" / "results.json").is_file()
    assert any("image/png" in out.get("data", {}) for out in nb.cells[5].outputs)


def readme_python() -> str:
    """The README's Python example."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks, "README.md has no python example"
    return blocks[0]


def test_readme_example_is_short_and_complete():
    code = readme_python()
    assert len(code.strip().splitlines()) <= 15
    compile(code, "README.md", "exec")
    assert "kvedit.steer(" in code and "import kvedit" in code


@pytest.mark.real
def test_readme_example_runs(tmp_path):
    """The README example on the bundled model: lost in the middle, then found."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(
        [sys.executable, "-c", readme_python()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    baseline, steered, history, reloaded = out.stdout.strip().splitlines()[-4:]
    assert "3407" not in baseline  # the middle record is missed ...
    assert "3407" in steered and "3407" in reloaded  # ... and found after steering
    assert history.startswith("capture(") and "-> emphasize(" in history
    assert (tmp_path / "records.kv").is_file()


def clear_outputs(path: Path) -> None:
    """Remove the outputs and execution counts of a notebook, in place."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)  # run timestamps
    nbformat.write(nb, path)


if __name__ == "__main__":  # python tests/test_notebooks.py --clear notebooks/*.ipynb
    if sys.argv[1:2] != ["--clear"] or len(sys.argv) < 3:
        sys.exit("usage: python tests/test_notebooks.py --clear NOTEBOOK...")
    for name in sys.argv[2:]:
        clear_outputs(Path(name))
        print("cleared", name)
