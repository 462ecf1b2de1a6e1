"""How a question asks: why vs how, tense, asking for a thing vs what it is,
swapped roles, one slot filled differently. Each is refused through the
guards a semantic hit must pass; the paraphrases around them still pass."""

from __future__ import annotations

import pytest

from gateway.cache.asking import asking, differs, phrases_swapped, slot_filled_differently
from gateway.cache.guards import check


@pytest.mark.parametrize(("cached", "new", "reason"), [
    ("how does a refrigerator keep food cold", "why does my refrigerator keep food cold",
     "why vs how"),
    ("what did the central bank decide about rates",
     "what will the central bank decide about rates", "tense"),
    ("who won the chess olympiad last year", "who will win the chess olympiad next year",
     "tense"),
    ("what is a haiku", "write a haiku about autumn", "make vs what is"),
    ("what's a cover letter", "can you write me a cover letter", "make vs what is"),
    ("can rabbits eat hamster food", "can hamsters eat rabbit food", "roles swapped"),
    ("what is 3 to the power of 4", "what is 4 to the power of 3", "roles swapped"),
    ("how do i clean a leather sofa", "how do i clean a velvet armchair", "slot"),
    ("is camping allowed in the national park", "is camping allowed in yosemite", "slot"),
    ("how to reverse a list in python", "how to reverse a list of tuples by the second item "
     "in python", "slot"),
    ("what is a sourdough starter", "how do i make a sourdough starter", "what is vs how"),
    ("what is mortgage escrow", "who holds the escrow on a mortgage",
     "what is vs who, when or where"),
    ("hey, what is the mona lisa", "who painted the mona lisa", "what is vs who, when or where"),
    ("is this haiku correct: old pond, frog jumps in", "rewrite this haiku: old pond, frog jumps in",
     "make vs yes or no"),
    ("who was ada lovelace", "write a short poem about ada lovelace",
     "make vs who, when or where"),
    ("how do i turn a spare bedroom into an office",
     "how do i turn an office into a spare bedroom", "roles swapped"),
])
def test_questions_that_ask_another_way_are_refused(cached: str, new: str, reason: str) -> None:
    assert differs(asking(new), asking(cached)) == reason
    assert differs(asking(cached), asking(new)) == reason
    assert check(new, cached) is not None  # the cache misses, whichever guard says so first


@pytest.mark.parametrize(("cached", "new"), [
    ("what does NASA stand for", "what is NASA short for"),
    ("how many legs does a spider have", "how many legs are on a spider"),
    ("who painted the sistine chapel ceiling", "who was the painter of the sistine chapel ceiling"),
    ("when did the berlin wall fall", "in what year did the berlin wall come down"),
    ("how long does a marathon take", "how long is a marathon"),
    ("what causes thunder", "why is there thunder"),
    ("how do i get to the airport from downtown", "best way from downtown to the airport"),
    ("is it safe to swim after eating", "is swimming after eating safe"),
    ("what is a sourdough starter", "what's a sourdough starter exactly"),
    ("what is the best way to store basil", "how do i store basil"),
    ("hey quick question, what is a roth ira", "define roth ira"),
    ("can you write a limerick about cats", "write me a limerick about cats"),
    ("which planet is the hottest", "what is the hottest planet"),
])
def test_paraphrases_that_ask_the_same_way_pass(cached: str, new: str) -> None:
    assert differs(asking(new), asking(cached)) is None
    assert check(new, cached) is None


def test_a_definition_is_a_bare_name_after_what_is() -> None:
    assert asking("hey quick question, what's avogadro's number").defines
    assert asking("define entropy").defines
    # A number, a preposition or a long phrase asks something else than what a thing is.
    assert not asking("what is 100 fahrenheit in celsius").defines
    assert not asking("what's the return policy at costco").defines
    assert not asking("what is the best way to store fresh basil").defines
    assert not asking("how do i store basil").defines


def test_phrases_swapped_need_a_word_between_them() -> None:
    assert phrases_swapped(("convert", "primary", "home", "into", "rental"),
                           ("convert", "rental", "into", "primary", "home"))
    assert not phrases_swapped(("reverse", "python", "list"), ("reverse", "list", "python"))


def test_how_asking_for_a_quantity_is_not_how_to() -> None:
    assert asking("how long does it take to boil an egg").asks == ""
    assert asking("how many people live in canada").asks == ""
    assert asking("how do i boil an egg").asks == "how"
    assert asking("how come the sky is blue").asks == "why"


def test_tense_is_marked_by_auxiliaries_and_periods_not_by_was() -> None:
    assert asking("who was the first president").tense == ""
    assert asking("when did it rain").tense == "past"
    assert asking("what happened last week").tense == "past"
    assert asking("the last git commit").tense == ""  # "last" + a thing, not a period
    assert asking("is it going to be sunny").tense == "future"
    assert asking("im going to japan").tense == ""


def test_a_transposition_needs_two_words_apart_and_the_rest_in_place() -> None:
    assert phrases_swapped(("dogs", "eat", "cat", "food"), ("cats", "eat", "dog", "food"))
    assert not phrases_swapped(("germany", "gdp"), ("gdp", "germany's"))  # neighbours: a rewording
    assert not phrases_swapped(("a", "b", "c", "d"), ("c", "b", "a", "e"))


def test_a_slot_needs_a_content_word_before_it_and_a_noun_phrase() -> None:
    frame = ("what", "is", "the", "capital", "of", "australia")
    assert not slot_filled_differently(frame, ("which", "city", "is", "the", "capital", "of",
                                               "australia"))  # another opener
    assert not slot_filled_differently(("what", "does", "http", "stand", "for"),
                                       ("what", "does", "http", "mean", "for"))  # no noun phrase
    assert slot_filled_differently(("symptoms", "of", "a", "cold"), ("symptoms", "of", "the", "flu"))
