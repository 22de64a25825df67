"""benchmarks/gpu_e2e.py runs end to end with --tiny (here: CPU, Triton's interpreter), and its
checks pass: steered output differs from unsteered, and the kvedit kernel runs on every decode
step of the steered paths."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import kvedit.triton as kt

pytestmark = pytest.mark.skipif(
    not kt.is_available(), reason="Triton missing, or neither CUDA nor TRITON_INTERPRET=1"
)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_e2e.py"


def test_gpu_e2e_tiny_runs_and_checks_pass(tmp_path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("gpu_e2e", SCRIPT)
    e2e = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_e2e", e2e)  # dataclasses look their module up
    spec.loader.exec_module(e2e)
    monkeypatch.setenv("KVEDIT_ATTENTION", "triton")
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--tiny", "--models", "llama3-8b", "--new-tokens", "2", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert rc == 0, payload["failures"]
    methods = {r["method"] for r in payload["rows"]}
    assert methods == {"unsteered", "steer", "state"}
    for r in payload["rows"]:
        if r["method"] != "unsteered":
            assert r["kernel_launches_per_step"][-1] == 2  # tiny llama: 2 layers
