"""``benchmarks.reuse``: time to first token from stored states, a KVStore and a blend, with
the blend rules given."""

from __future__ import annotations

import json

import kvedit
from benchmarks import reuse as bench


def test_reuse_benchmark_times_a_blend_with_the_rules_given(tmp_path, monkeypatch):
    out = tmp_path / "reuse.json"
    argv = ["--model", "tiny-llama", "--lengths", "128", "--repeats", "1"]
    seen = []
    real = kvedit.blend

    def spy(*args, **kw):
        seen.append({k: kw[k] for k in ("leading", "rescale") if k in kw})
        return real(*args, **kw)

    monkeypatch.setattr(bench.kvedit, "blend", spy)
    assert bench.main([*argv, "--rule", "leading=2:rescale=0.5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["rule"] == "leading=2:rescale=0.5" and row["blend_s"] > 0
    assert seen and all(kw == {"leading": 2, "rescale": 0.5} for kw in seen)
