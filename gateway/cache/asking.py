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
  place; or two phrases of up to ``MAX_SLOT`` words around a word between
  them ("turn my home into a rental" / "turn my rental into my home");
- **the kind of answer** — a bare "what is X" (a definition) is not "how do
  i X" nor "who / when / where ... X"; a request to make something ("write
  a poem about X", "rewrite this: ...") is not a yes-or-no verdict ("is this
  correct: ...") nor a who / when / where question. Chat openers ("hey
  quick question") are skipped before the request is read.

Each is a word-level feature of one question (``Asking``), compared pairwise
by ``differs``; none lists the words of a particular subject. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
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
# Asking for something to be made (or remade), at the start of a request.
_MAKE = frozenset("make write implement create generate build draft code design compose "
                  "plan produce give rewrite rephrase paraphrase summarize summarise "
                  "translate shorten sort rank put".split())
# Chat openers before the request itself ("hey quick question, is ...").
_OPENERS = frozenset("hey hi hello so ok okay quick question please pls plz um hmm".split())
# A yes/no question: it asks for a verdict ("is this paragraph clear", "is nacl
# soluble"), not for something to be made.
_YES_NO = frozenset("is are does do did should can could would will was were has have".split())
# The question word that says what kind of thing the answer is; "what" with a
# word of time asks "when". "how" and "why" are ``asks``'s.
_WH = {"who": "who", "whom": "who", "whose": "who", "when": "when", "where": "where",
       "what": "what", "which": "what", "whats": "what", "what's": "what"}
_NOT_WHAT = frozenset({"who", "when", "where"})
_WHEN_NOUNS = frozenset("time year years day days month months date age hour season".split())

_WHAT_IS = (("what", "is"), ("what", "are"), ("what's",), ("whats",), ("define",),
            ("meaning", "of"), ("definition", "of"))
_ARTICLES = frozenset({"a", "an", "the"})
MAX_DEFINED = 3
_FILLER = frozenset("the a an please of is are do does to in and".split())
MAX_SLOT = 3
# Words that open a noun phrase: a slot after or starting with one names a thing.
_PHRASE_OPENERS = frozenset("a an the of for in on at to with about from by into my your his "
                            "her our their its this that these those".split())


@dataclass(frozen=True)
class Asking:
    asks: str  # "why", "how" (a way to do something) or "" (anything else)
    tense: str  # "past", "future" or "" (present or none marked)
    mood: str  # "make" (asks for something to be made), "what-is" (a definition),
    #            "yes-no" (a verdict: "is this paragraph clear") or ""
    words: tuple[str, ...]  # words in order, filler dropped, numbers kept
    tokens: tuple[str, ...] = ()  # every word in order
    wh: str = ""  # "who", "when", "where", "what" (the first question word) or ""
    defines: bool = False  # asks only what a thing is (``_defines``)


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


def _request(words: Sequence[str]) -> list[str]:
    """The words from where the request starts, chat openers ("hey quick question") dropped."""
    start = 0
    while start < len(words) and words[start] in _OPENERS:
        start += 1
    return list(words[start:])


def _mood(words: list[str]) -> str:
    """``words``: the request's (``_request``)."""
    if not words:
        return ""
    asked = words[2:] if words[0] in ("can", "could", "would") and words[1:2] == ["you"] else []
    if asked[:1] == ["please"]:
        asked = asked[1:]
    if words[0] in _MAKE or asked[:1] and asked[0] in _MAKE:
        return "make"
    if words[0] in _YES_NO:
        return "yes-no"
    for opener in _WHAT_IS:
        if tuple(words[:len(opener)]) == opener:
            return "what-is"
    return ""


def _defines(words: list[str], mood: str) -> bool:
    """Asks only what a thing is: "what is a deload week", "define entropy" -- the
    opener, an article at most, and a bare name of a few words (no number, no
    preposition: "what is 100 f in celsius" or "what's the return policy at costco"
    ask something else). ``words``: the request's."""
    if mood != "what-is":
        return False
    opener = next(o for o in _WHAT_IS if tuple(words[:len(o)]) == o)
    rest = [w for w in words[len(opener):] if w not in _ARTICLES]
    return (0 < len(rest) <= MAX_DEFINED and not any(w in _PHRASE_OPENERS for w in rest)
            and all(w.replace("'", "").isalpha() for w in rest))


def _wh(words: list[str]) -> str:
    """The question word that opens the request (``words``), if any."""
    kind = _WH.get(words[0], "") if words else ""
    if kind == "what" and words[1:2] and words[1] in _WHEN_NOUNS:
        return "when"
    return kind


def asking(text: str) -> Asking:
    words = _WORD.findall(text.lower().replace("’", "'"))
    request = _request(words)
    mood = _mood(request)
    return Asking(_asks(words), _tense(words), mood,
                  tuple(w for w in words if w not in _FILLER), tuple(words),
                  _wh(request), _defines(request, mood))


def phrases_swapped(one: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """The same words with two words, or two phrases of up to ``MAX_SLOT`` words,
    trading places around at least one word in between, the rest in place: "can
    dogs eat cat food" / "can cats eat dog food", "turn my home into a rental" /
    "turn my rental into my home" (neighbours trading places is a rewording:
    "germany gdp" / "gdp of germany")."""
    if len(one) != len(other) or len(one) < 3:
        return False
    start = 0
    while start < len(one) and wording.same_word(one[start], other[start]):
        start += 1
    end = len(one)
    while end > start and wording.same_word(one[end - 1], other[end - 1]):
        end -= 1
    middle, swapped = one[start:end], other[start:end]
    for first in range(1, min(MAX_SLOT, len(middle)) + 1):
        for last in range(1, min(MAX_SLOT, len(middle) - first - 1) + 1):
            a, between, b = middle[:first], middle[first:len(middle) - last], middle[-last:]
            candidate = b + between + a
            if all(wording.same_word(x, y) for x, y in zip(candidate, swapped)):
                return True
    return False


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
    if {new.mood, cached.mood} == {"make", "yes-no"}:
        return "make vs yes or no"
    if (new.mood == "make" and cached.wh in _NOT_WHAT) or (
            cached.mood == "make" and new.wh in _NOT_WHAT):
        return "make vs who, when or where"
    if (new.defines and cached.wh in _NOT_WHAT) or (cached.defines and new.wh in _NOT_WHAT):
        return "what is vs who, when or where"
    if (new.defines and cached.asks == "how") or (cached.defines and new.asks == "how"):
        return "what is vs how"
    if phrases_swapped(new.words, cached.words):
        return "roles swapped"
    if slot_filled_differently(new.tokens, cached.tokens):
        return "slot"
    return None
