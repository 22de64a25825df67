"""``benchmarks.tuning.answer_prefix``: the tokens an edited answer shares with the unedited one, where
focus kept the edit (the steps a draft could skip)."""

from __future__ import annotations

from benchmarks.tuning.answer_prefix import prefixes, summary
from kvedit.memory.rendering import common_prefix


def test_the_shared_prefix_is_counted_only_where_an_edit_was_kept(llama):
    _, tok = llama
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1  # from the start only

    def record(example, method, prediction, **kw):
        return {"id": example, "example": example, "method": method, "prediction": prediction, **kw}

    results = {
        "examples": [
            record("a", "none", "The code is 4821."),
            record("a", "auto", "The code is 7730.", chosen=[1], kept=True),
            record("b", "none", "Paris"),
            record("b", "auto", "Paris", chosen=[0], kept=False),  # the unedited answer kept
            record("c", "none", "Rome"),
            record("c", "auto", "Rome", chosen=[], kept=True),  # focus abstained
        ]
    }
    (got,) = prefixes(results, tok)
    edited = tok.encode("The code is 7730.", add_special_tokens=False)
    unedited = tok.encode("The code is 4821.", add_special_tokens=False)
    assert got == (common_prefix(unedited, edited), len(edited))
    assert 0 < got[0] < got[1]
    assert summary([got]).startswith("1 edits kept: shared prefix mean")
    assert summary([]) == "no question where auto kept an edit"
