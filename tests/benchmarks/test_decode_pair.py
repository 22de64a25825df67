"""``benchmarks.decode_pair``: the batch of two computes, row by row, what the unedited and the
edited state compute alone, and the times are reported."""

from __future__ import annotations

import json

from benchmarks import decode_pair


def test_each_row_of_the_pair_is_its_own_state(tmp_path):
    out = tmp_path / "pair.json"
    argv = ["--model", "tiny-llama", "--task", "records", "--steps", "3", "--repeats", "1"]
    assert decode_pair.main([*argv, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["edit_logit_gap"] > 1e-3  # the edit changes the answer's logits...
    assert r["max_logit_gap"] < 1e-4  # ...and each row of the batch keeps its own state's
    assert r["question_tokens"] > 0 and r["cache_entries"] > r["question_tokens"]
    for part in ("question", "step"):
        assert r[f"{part}_single_s"] > 0 and r[f"{part}_pair_s"] > 0
        assert r[f"{part}_pair_over_two"] == r[f"{part}_pair_s"] / (2 * r[f"{part}_single_s"])
