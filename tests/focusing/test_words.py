"""The one definition of a text's words that focus's scoring and its guard share."""

from kvedit.focusing.guard import answer_support
from kvedit.focusing.scoring import content_free_question, distinctive_words
from kvedit.focusing.words import common_words, holders, split_words, words


def test_a_word_is_a_run_of_letters_and_digits_lower_cased():
    assert words("Cy Diaz's code_2, SZ-611.") == ["cy", "diaz", "s", "code", "2", "sz", "611"]
    text = "What is rust_maple's code?"
    assert "".join(split_words(text)) == text
    assert [p for p in split_words(text) if p[0].isalnum()] == [
        "What",
        "is",
        "rust",
        "maple",
        "s",
        "code",
    ]


def test_a_word_more_than_half_of_the_passages_hold_is_common():
    texts = ["red door", "red gate", "blue door", "red wall"]
    assert holders(["red", "door", "green"], texts) == {
        "red": {0, 1, 3},
        "door": {0, 2},
        "green": set(),
    }
    assert common_words(texts) == {"red"}  # 3 of 4; "door" is in exactly half
    assert common_words(texts, share=1.0) == set()
    assert common_words([]) == set()
    assert common_words(["red door"]) == set()  # one passage has nothing to share with
    assert common_words(["red door", "red gate"]) == {"red"}


def test_scoring_and_guard_read_the_same_words():
    docs = [
        "The rust maple door: 1712.",
        "The oak door: 55.",
        "The rust pine door: 90.",
        "The elm door: 31.",
    ]
    # an underscore splits words for both: the question's "rust_maple" asks for "rust" and
    # "maple", and the calibration removes both
    assert distinctive_words("Code of the rust_maple door?", docs) == {"rust", "maple"}
    assert content_free_question("Code of the rust_maple door?", docs) == "Code of the _ door?"
    # "door" is in every passage: common, neither distinctive nor telling
    assert answer_support("door_1712", [docs[0]], "Code?", docs[1:]) == 1.0
    assert answer_support("door_55", [docs[0]], "Code?", docs[1:]) == 0.0
    assert answer_support("door_55", [docs[0]], "Code?") == 0.5  # no others: "door" tells
