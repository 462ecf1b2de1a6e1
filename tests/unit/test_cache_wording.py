"""The content-word check: which words count, which spellings are one word,
and when a difference in them refuses a semantic hit."""

from __future__ import annotations

import pytest

from gateway.cache.wording import changed, content_words, same_word


def test_function_words_filler_and_ways_of_asking_how_do_not_count() -> None:
    assert content_words("Hey, what's the best way to get rid of fruit flies pls?") \
        == ("rid", "fruit", "flies")
    assert content_words("What are the steps to change a flat tire?") \
        == ("change", "flat", "tire")


def test_why_where_who_and_am_count() -> None:
    assert content_words("why is the 7 am train late") == ("why", "am", "train", "late")
    assert content_words("who built it and where") == ("who", "built", "where")


def test_a_dropped_letter_in_a_short_function_word_is_still_one() -> None:
    assert content_words("hw do i sharpen te knife") == ("sharpen", "knife")


@pytest.mark.parametrize(("one", "other"), [
    ("knife", "knifes"), ("dictionaries", "dictionary"), ("boiling", "boil"),
    ("converted", "convert"), ("painter", "painted"), ("account", "acount"),
    ("whether", "wether"), ("recieve", "receive"), ("temp", "temperature"),
    ("guac", "guacamole"), ("difference", "differ"), ("chrome's", "chrome"),
])
def test_spellings_of_one_word(one: str, other: str) -> None:
    assert same_word(one, other) and same_word(other, one)


@pytest.mark.parametrize(("one", "other"), [
    ("am", "pm"), ("cat", "car"), ("cheaper", "cheapest"), ("europe", "france"),
    ("legal", "illegal"), ("int", "integer"), ("rome", "home"),
])
def test_different_words(one: str, other: str) -> None:
    assert not same_word(one, other)


def test_two_neighbouring_words_written_as_one_match() -> None:
    assert changed(content_words("tips for long flights without getting jetlagged"),
                   content_words("tips for long flights without jet lag")) is None


@pytest.mark.parametrize(("cached", "new", "reason"), [
    ("is the 7 am train crowded", "is the 7 pm train crowded", "changed words"),
    ("how often should i feed my cat", "how often should i feed my dog", "changed words"),
    ("best hotels near the vatican", "best restaurants near the vatican", "changed words"),
    ("how to sort a list of numbers in python", "how to sort a list of tuples in python",
     "changed words"),
    ("when do cherry blossoms peak in kyoto", "when do cherry blossoms peak in kyoto gardens",
     "added words"),
])
def test_a_small_difference_in_a_shared_context_refuses(cached: str, new: str,
                                                        reason: str) -> None:
    assert changed(content_words(new), content_words(cached)) == reason
    assert changed(content_words(cached), content_words(new)) == reason


@pytest.mark.parametrize(("cached", "new"), [
    ("how long does cooked chicken last in the fridge",
     "how many days is leftover cooked chicken good for in the refrigerator"),  # reworded
    ("how do i exit vim", "how to quit vim editor im stuck"),  # two words on each side
    ("cat food", "dog food"),  # too little shared context to say
    ("what is pi", "what exactly is the number pi"),  # added, but to too short a context
])
def test_rewordings_and_short_questions_are_left_to_the_threshold(cached: str, new: str) -> None:
    assert changed(content_words(new), content_words(cached)) is None
