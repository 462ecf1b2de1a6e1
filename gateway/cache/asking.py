"""How a question asks, beside what it is about: cheap features that decide the answer.

Two questions about the same things can still want different answers, and
a sentence embedding, an average over the words, barely sees it:

- **why vs how** — "how do i make bread rise" wants steps, "why didn't my
  bread rise" a cause;
- **tense** — "who won the super bowl last year" is not "who will win it this
  year": the time the question is about (past / future markers) must agree;
- **asking for a thing vs asking what a thing is** — "what is a linked list"
  is not "implement a linked list in c";
- **one slot filled differently** — the same question frame with another
  thing in one place ("best fertilizer for roses" / "for tomatoes", "clean
  a cast iron pan" / "a stainless steel pan", "sort a list in python" /
  "sort a list of dictionaries by a key in python"): the words before the
  slot include a content word (so the frame says what is asked; a reworded
  opener such as "what is" / "which city is" is not a slot), the slot starts
  a noun phrase (after or with an article, a possessive or a preposition:
  "stand for" / "short for" is a rewording, not another thing), and it holds
  at most ``MAX_SLOT`` content words a side, none matching the other's;
- **roles** — the same words with two of them trading places ("can dogs eat
  cat food" / "can cats eat dog food", "5 to the power of 2"): a
  transposition of two words that are not neighbours, everything else in
  place.

Each is a word-level feature of one question (``Asking``), compared pairwise
by ``differs``; none lists the words of a particular subject. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.cache import wording

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
# "how" that asks for a quantity ("how many", "how long") is not "how to".
_HOW_QUANTITY = frozenset("many much long often far old big large tall fast heavy soon come "
                          "late early deep wide high hot cold".split())
_WHY = frozenset({"why", "whys", "why's", "y"})
# Markers of the time asked about; "was" and "who invented" are left out: "who
# was the inventor of" asks what "who invented" does.
_PAST = frozenset("did didn't didnt ago yesterday".split())
_FUTURE = frozenset("will won't shall tomorrow i'll you'll we'll it'll they'll".split())
_PERIODS = frozenset("year years week weeks month months night time season day weekend "
                     "decade century summer winter spring fall autumn quarter".split())
# Asking for something to be made, at the start of a request.
_MAKE = frozenset("make write implement create generate build draft code design compose "
                  "plan produce give".split())
_WHAT_IS = (("what", "is"), ("what", "are"), ("what's",), ("whats",), ("define",),
            ("meaning", "of"), ("definition", "of"))
_FILLER = frozenset("the a an please of is are do does to in and".split())
MAX_SLOT = 3
# Words that open a noun phrase: a slot after or starting with one names a thing.
_PHRASE_OPENERS = frozenset("a an the of for in on at to with about from by into my your his "
                            "her our their its this that these those".split())


@dataclass(frozen=True)
class Asking:
    asks: str  # "why", "how" (a way to do something) or "" (anything else)
    tense: str  # "past", "future" or "" (present or none marked)
    mood: str  # "make" (asks for something to be made), "what-is" (a definition) or ""
    words: tuple[str, ...]  # words in order, filler dropped, numbers kept
    tokens: tuple[str, ...] = ()  # every word in order


def _asks(words: list[str]) -> str:
    if any(w in _WHY for w in words) or "how come" in " ".join(words):
        return "why"
    for i, word in enumerate(words):
        if word == "how" and (i + 1 == len(words) or words[i + 1] not in _HOW_QUANTITY):
            return "how"
    return ""


def _tense(words: list[str]) -> str:
    pairs = list(zip(words, words[1:]))
    past = (any(w in _PAST for w in words)
            or any(a == "last" and b in _PERIODS for a, b in pairs))
    future = (any(w in _FUTURE for w in words)
              or any(a == "next" and b in _PERIODS for a, b in pairs)
              or any(t == ("going", "to", "be") for t in zip(words, words[1:], words[2:])))
    if past == future:
        return ""
    return "past" if past else "future"


def _mood(words: list[str]) -> str:
    if not words:
        return ""
    if words[0] in _MAKE or (words[0] in ("can", "could") and len(words) > 2
                             and words[1] == "you" and words[2] in _MAKE):
        return "make"
    for opener in _WHAT_IS:
        if tuple(words[:len(opener)]) == opener:
            return "what-is"
    return ""


def asking(text: str) -> Asking:
    words = _WORD.findall(text.lower().replace("’", "'"))
    return Asking(_asks(words), _tense(words), _mood(words),
                  tuple(w for w in words if w not in _FILLER), tuple(words))


def transposed(one: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """The same words but two that are not neighbours trade places."""
    if len(one) != len(other) or len(one) < 3:
        return False
    differ = [k for k, (a, b) in enumerate(zip(one, other)) if not wording.same_word(a, b)]
    if len(differ) != 2:
        return False
    i, j = differ
    return (j - i >= 2 and wording.same_word(one[i], other[j])
            and wording.same_word(one[j], other[i]))


def _is_content(word: str) -> bool:
    return word not in wording.FUNCTION_WORDS


def slot_filled_differently(one: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """The same frame (the words before and after the slot, in place) around
    another content in one slot; the frame before the slot holds a content word."""
    shortest = min(len(one), len(other))
    start = 0
    while start < shortest and wording.same_word(one[start], other[start]):
        start += 1
    end = 0
    while end < shortest - start and wording.same_word(one[-1 - end], other[-1 - end]):
        end += 1
    if not any(_is_content(w) for w in one[:start]):
        return False
    opens = (start and one[start - 1] in _PHRASE_OPENERS) or any(
        start < len(words) - end and words[start] in _PHRASE_OPENERS for words in (one, other))
    if not opens:
        return False
    slots = [[w for w in words[start:len(words) - end] if _is_content(w)] for words in (one, other)]
    if not any(slots) or max(len(s) for s in slots) > MAX_SLOT:
        return False
    return not any(wording.same_word(a, b) for a in slots[0] for b in slots[1])


def differs(new: Asking, cached: Asking) -> str | None:
    """None when the two ask the same way, else how they differ."""
    if {new.asks, cached.asks} == {"why", "how"}:
        return "why vs how"
    if new.tense != cached.tense:
        return "tense"
    if {new.mood, cached.mood} == {"make", "what-is"}:
        return "make vs what is"
    if transposed(new.words, cached.words):
        return "roles swapped"
    if slot_filled_differently(new.tokens, cached.tokens):
        return "slot"
    return None
