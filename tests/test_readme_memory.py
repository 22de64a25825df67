"""The README's memory example, run as written on the bundled SmolLM2: it prints what the README
says it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> tuple[str, str]:
    """The memory section's code block and the text block of what it prints."""
    text = README.read_text()
    section = text[text.index("## Memory: a conversation kept as one exact cache") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    printed = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return code, printed


@pytest.mark.real
def test_the_readme_memory_example_prints_what_the_readme_says(smollm2, tmp_path, monkeypatch):
    import kvedit

    code, printed = _blocks()
    model, tok = smollm2
    monkeypatch.chdir(tmp_path)  # it saves chat.kv in the working directory
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {"kvedit": kvedit, "model": model, "tok": tok})  # noqa: S102
    assert out.getvalue() == printed, out.getvalue()
    assert (tmp_path / "chat.kv").exists()
