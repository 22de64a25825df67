"""Bad inputs of the vLLM publish root: an empty root refused, a killed writer's leftovers swept,
a live writer's kept. ``make test-vllm`` runs this file in the vLLM environment.

The other bad-input probes sit beside what they test: the CLI's exit statuses in
``tests/cli/test_exit_statuses.py``; the length limit in ``tests/states/test_length_limits.py``;
``tests/steering/test_steering_bad_inputs.py``, ``tests/evals/test_jsonl_bad_inputs.py``,
``tests/compress/test_quantize_bad_inputs.py``, ``tests/apps/test_app_bad_inputs.py``,
``tests/reusing/test_blend_bad_inputs.py``, ``tests/focusing/test_focus_bad_inputs.py``.

Only tiny models (``kvedit.testing``): the whole file runs in a few seconds.
"""

from __future__ import annotations

import logging
import os
import time

import pytest

from kvedit.errors import InvalidInputError
from kvedit.states.capturing import capture


@pytest.mark.parametrize("root", ["", "   ", None])
def test_publish_refuses_an_empty_root(llama, tmp_path, monkeypatch, root):
    from kvedit.integrations.vllm import publish

    model, tok = llama
    monkeypatch.chdir(tmp_path)
    state = capture(model, tok, "Alice's secret number is 4821.")
    with pytest.raises(InvalidInputError, match="publish root"):
        publish(state, root)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------ publish leftovers


def _leftovers(root, age: float = 0.0, tag: int = 0) -> list:
    made = []
    for i, is_dir in enumerate([True, False]):
        path = root / f".{i}-{'0' * 32}.safetensors.kvedit-tmp-{tag:08x}{i:08x}"
        if is_dir:
            path.mkdir()
            (path / "inner.safetensors").write_bytes(b"half")
        else:
            path.write_bytes(b"half")
        if age:
            stamp = time.time() - age
            os.utime(path, (stamp, stamp))
        made.append(path)
    return made


def test_publish_sweeps_what_killed_writers_left(llama, tmp_path, caplog):
    from kvedit.integrations.vllm import publish

    model, tok = llama
    root = tmp_path / "root"
    root.mkdir()
    left = _leftovers(root)
    with caplog.at_level(logging.WARNING, logger="kvedit.integrations.vllm.files"):
        publish(capture(model, tok, "Alice's secret number is 4821."), root)
    assert not any(p.exists() for p in left)
    assert "removed 2 temporary file(s)" in caplog.text and str(root) in caplog.text
    assert len(list(root.glob("*.safetensors"))) == 1


def test_publish_keeps_a_live_writers_temporary_files(llama, tmp_path):
    fcntl = pytest.importorskip("fcntl")
    from kvedit.integrations.vllm import files, publish

    model, tok = llama
    root = tmp_path / "root"
    root.mkdir()
    young = _leftovers(root)
    old = _leftovers(root, age=2 * files.STALE_TEMP_SECONDS, tag=1)
    fd = os.open(root / files.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # another writer, alive
        publish(capture(model, tok, "Alice's secret number is 4821."), root)
    finally:
        os.close(fd)
    assert all(p.exists() for p in young)
    assert not any(p.exists() for p in old)
