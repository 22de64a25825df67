"""``benchmarks.gpu_e2e`` runs end to end with --tiny (here: CPU, Triton's interpreter), and its
checks pass: steered output differs from unsteered, and the kvedit kernel runs on every decode
step of the steered paths."""

from __future__ import annotations

import json

import pytest

import kvedit.triton as kt

pytestmark = pytest.mark.skipif(
    not kt.is_available(), reason="Triton missing, or neither CUDA nor TRITON_INTERPRET=1"
)


def test_gpu_e2e_tiny_runs_and_checks_pass(tmp_path, monkeypatch) -> None:
    # imported here, not at collection: without CUDA, importing it sets TRITON_INTERPRET
    from benchmarks import gpu_e2e as e2e

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
