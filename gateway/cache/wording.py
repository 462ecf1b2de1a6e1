"""Near-identical questions that differ in a content word ask something else.

A sentence embedding averages over the words, so two questions that share
all their words but one score as near-identical whatever that one word is:
"7 am train" vs "7 pm train", "visit in Europe" vs "visit in France", "is it
cheaper" vs "is it faster". Rule lists catch only the words they list. This
check needs no list of such words: it compares the two questions' content
words (function words and chat filler dropped; spelling variants, plurals,
typos and abbreviations matched) and refuses when the questions are mostly
the same words and yet one has a content word the other lacks:

- a substitution (each side has a word the other lacks) when the words they
  share make up at least ``SUBSTITUTED_OVERLAP`` of the longer side,
- an addition (only one side has extra words) when the shared words make up
  at least ``ADDED_OVERLAP``.

True paraphrases that reword the question share fewer words, and are left to
the cosine threshold. The two overlaps were chosen on
``bench/data/paraphrases.jsonl`` only (see docs/benchmarks.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SUBSTITUTED_MAX = 1  # words on either side that the other lacks
SUBSTITUTED_CONTEXT = 2  # content words both share
ADDED_MAX = 1
ADDED_CONTEXT = 3

# Function words, chat filler and the ways of asking "how", "why" or "what
# is" ("what are the steps to", "what's the best way to", "what's the
# reason", "meaning of"): they do not decide what a question asks ("more" and "most" only mark the adjective
# that does). "why", "where" and "who" are not here: they do.
FUNCTION_WORDS = frozenset("""
a an the this that these those some any each every all both
i me my mine we us our you your yours u ur he him his she her it its they them their one
is are be been being am do does did doing done can could should would shall may might must
will was were has have had having
what which whats what's how when
of in on at to for from by with about into onto as than then so if or and but nor
there here vs versus per via up out between among through
please pls plz hey hi hello thanks thank ok okay quick question just really actually
exactly basically roughly approximately usually typically generally normally simply
also still even ever very quite pretty much many more most
tell explain give know want need get got let lets let's im i'm ive i've
way ways step steps method best right proper correct command reason
mean means meaning definition term
""".split()) - {"am"}  # "am" is the time of day far more often than the verb

# Three-letter function words with a letter dropped ("hw", "te", "yu"); longer
# ones would give real words ("into" -> "int", "quite" -> "quit").
_FUNCTION_TYPOS = frozenset(w[:i] + w[i + 1:] for w in FUNCTION_WORDS if len(w) == 3
                            for i in range(3)) - {"am", "pm"}
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?")
_INFLECTIONS = ("'s", "ies", "es", "s", "ing", "ed", "er", "d")


def content_words(text: str) -> tuple[str, ...]:
    """The words that decide what a question asks, in order, lower case;
    digits are left to the number guard, and a function word with a letter
    dropped ("hw do i", "wat is") is still one."""
    return tuple(w for w in _TOKEN.findall(text.lower().replace("’", "'"))
                 if w not in FUNCTION_WORDS and w not in _FUNCTION_TYPOS)


def _stem(word: str) -> str:
    for suffix in _INFLECTIONS:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: len(word) - len(suffix)] + ("y" if suffix == "ies" else "")
    return word


def _one_edit(short: str, long: str) -> bool:
    """``long`` is ``short`` with one letter added, or (words of 5+ letters) one
    letter changed or two neighbours swapped: a typo, not another word."""
    if len(long) - len(short) == 1:
        return len(long) >= 3 and any(long[:i] + long[i + 1:] == short for i in range(len(long)))
    if len(long) != len(short) or len(long) < 5:
        return False
    diff = [i for i in range(len(long)) if long[i] != short[i]]
    if len(diff) == 1:
        return True
    return (len(diff) == 2 and diff[1] == diff[0] + 1
            and long[diff[0]] == short[diff[1]] and long[diff[1]] == short[diff[0]])


def same_word(one: str, other: str) -> bool:
    """The same word written another way: inflection, typo, or a 4+ letter
    abbreviation ("temp", "guac")."""
    if one == other or _stem(one) == _stem(other):
        return True
    short, long = sorted((one, other), key=len)
    if _one_edit(short, long):
        return True
    return len(short) >= 4 and long.startswith(short) and len(long) - len(short) >= 4


def _unmatched(words: Sequence[str], others: Sequence[str]) -> list[str]:
    """Words with no counterpart in ``others``, a pair of neighbours in
    ``others`` written as one word ("jetlagged" / "jet lag") counting as one."""
    joined = [a + b for a, b in zip(others, others[1:])]
    return [w for w in words
            if not any(same_word(w, o) for o in others) and not any(same_word(w, j) for j in joined)]


def changed(new: Sequence[str], cached: Sequence[str]) -> str | None:
    """None when the content words allow one question to answer the other,
    else why not ("changed words" / "added words")."""
    new_only, cached_only = _unmatched(new, cached), _unmatched(cached, new)
    if not new_only and not cached_only:
        return None
    differ = max(len(new_only), len(cached_only))
    shared = max(len(new), len(cached)) - differ
    if new_only and cached_only:
        small = differ <= SUBSTITUTED_MAX and shared >= SUBSTITUTED_CONTEXT
        return "changed words" if small else None
    small = differ <= ADDED_MAX and shared >= ADDED_CONTEXT
    return "added words" if small else None
