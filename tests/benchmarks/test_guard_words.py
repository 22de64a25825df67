"""``benchmarks.tuning.guard_words``: the support guard's verdict replayed on a run's answers under the
prompt's own words and under the word list they replaced."""

from __future__ import annotations

from benchmarks.tuning.guard_words import replay
from kvedit.evals.litm import build_examples


def test_the_replay_finds_where_the_prompts_own_words_change_the_verdict(llama):
    _, tok = llama
    (ex,) = build_examples("records", n_docs=5, positions=[2], trials=1, seed=0)
    code = ex.documents[2].split()[-1].rstrip(".")
    digest = ex.digest()

    def run(unedited: str, recorded: float) -> dict:
        base = {"id": ex.id, "example": digest, "gold_index": 2}
        return {
            "examples": [
                {**base, "method": "none", "prediction": unedited},
                {**base, "method": "auto", "chosen": [2], "support": recorded},
                {**base, "id": "other", "example": "-", "method": "auto", "chosen": []},
            ]
        }

    # "below", "some" and "records" are the instruction's words, not the list's: the list
    # counts them as telling words found in no passage (support 1/4, the edit answers); the
    # prompt's own words leave them out (support 1, the unedited answer stands)
    got = replay(run(f"Below, some records: {code}", 1.0), [ex], tok, "plain")
    assert got["edited"] == 1 and got["replay_matches_run"] == 1  # the abstention is skipped
    (row,) = got["differ"]
    assert (row["support"], row["support_listed"]) == (1.0, 0.25)
    assert (row["kept"], row["kept_listed"]) == (False, True)
    assert got["verdict_differs"] == got["support_differs"] == 1
    # the listed words are the instruction's too here: both rules read the same support
    same = replay(run(f"The answer to the question: {code}", 0.5), [ex], tok, "plain")
    assert same["differ"] == [] and same["support_differs"] == 0
    assert same["replay_matches_run"] == 0  # a recorded support the replay does not give


def test_a_stopped_runs_partial_records_stand_for_its_results(tmp_path):
    import json

    import pytest

    from benchmarks.tuning.guard_words import read_records

    records = [{"id": "a", "method": "none"}, {"id": "a", "method": "auto", "chosen": []}]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = {"model": "smollm2-135m-instruct", "prompt": "chat", "seed": 0}
    (tmp_path / "partial.settings.json").write_text(json.dumps(settings))
    got = read_records(partial)
    assert got["examples"] == records and got["model"] == settings["model"]
    assert got["extra"]["prompt"] == "chat"
    partial.write_text("{broken\n")
    with pytest.raises(SystemExit, match="partial.jsonl"):
        read_records(partial)


def test_the_verdict_on_the_unedited_answers_first_tokens_is_counted(llama):
    _, tok = llama
    (ex,) = build_examples("records", n_docs=5, positions=[2], trials=1, seed=0)
    code = ex.documents[2].split()[-1].rstrip(".")
    base = {"id": ex.id, "example": ex.digest(), "gold_index": 2}
    # the code first (in the chosen record), then four words no passage holds: on its first
    # tokens the answer comes from the record (the unedited answer would stand); whole, it
    # does not (support 1/5: the edit answers)
    unedited = f"{code} Zanzibar Quuxley Florp Blorp"
    run = {
        "examples": [
            {**base, "method": "none", "prediction": unedited},
            {**base, "method": "auto", "chosen": [2], "support": 0.2},
        ]
    }
    n = len(tok(code, add_special_tokens=False)["input_ids"])
    got = replay(run, [ex], tok, "plain", [n, 100])
    assert got["edited"] == 1 and got["verdict_differs"] == 0
    assert got["prefix_differs"] == {n: 1, 100: 0}
