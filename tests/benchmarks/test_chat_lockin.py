"""benchmarks.chat_lockin's measures: the script, the longest run of one answer, recall."""

from __future__ import annotations

from benchmarks.chat_lockin import FACTS, longest_run, recalled, script


def test_the_script_tells_the_facts_first_and_asks_each_in_its_own_turn():
    turns = script(50, [25, 50])
    assert len(turns) == 50
    assert [m for m, _ in turns[:3]] == [told for told, _, _ in FACTS]
    asked = [i for i, (_, gold) in enumerate(turns, 1) if gold is not None]
    assert asked == [23, 24, 25, 48, 49, 50]
    assert [gold for _, gold in turns[22:25]] == [g for *_, g in FACTS]


def test_longest_run_counts_consecutive_repeats_only():
    assert longest_run(["a", "b", "a", "b"]) == 1
    assert longest_run(["a", "b", "b", "b", "a", "a"]) == 3
    assert longest_run([]) == 0


def test_recalled_needs_the_telling_part_as_a_word():
    assert recalled("Your locker code is 4821.", "4821") == 1
    assert recalled("It is 48210.", "4821") == 0
    assert recalled("Level 17.", "7") == 0
    assert recalled("Level 7, near the lift", "7") == 1
    assert recalled("OTTILIE!", "ottilie") == 1
