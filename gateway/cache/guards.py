"""Guards against semantic near-misses (sans-IO, pure).

Embeddings place "how far is 5 km" next to "how far is 50 km", and "is X
safe" next to "is X not safe". A semantic hit is accepted only when the facts
that decide the answer agree between the new and the cached question:

- numbers (digits, decimals, and written numbers: "five", "a dozen"),
- units attached to numbers and free-standing units ("km" vs "miles"),
- negations (not, no, never, n't, without, ...),
- named entities (capitalized words past the start of a sentence, acronyms),
- code identifiers (snake_case, camelCase, dotted.names, `backticked`),
- words with a one-word opposite (ascending/descending, upload/download),
- word order, when both use the same words ("A compared to B" vs "B ... A"),
- how the question asks (``asking``): why vs how, the tense asked about,
  asking for a thing to be made vs what a thing is, two words trading
  places ("can dogs eat cat food" / "can cats eat dog food"),
- content words (``wording``): near-identical questions that differ in one
  content word or add one to a longer shared context.

``check(new, cached)`` returns None when they agree, else the first reason
they do not (for logs and metrics).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.cache import asking, wording

_WORD_NUMBERS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000,
    "million": 1_000_000, "billion": 1_000_000_000, "dozen": 12, "half": 0.5,
    "twice": 2, "double": 2, "triple": 3, "once": 1, "thrice": 3, "quarter": 0.25,
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "tenth": 10,
}
_UNITS = {
    # canonical name: spellings
    "km": ("km", "kms", "kilometer", "kilometers", "kilometre", "kilometres"),
    "m": ("m", "meter", "meters", "metre", "metres"),
    "cm": ("cm", "centimeter", "centimeters", "centimetre", "centimetres"),
    "mm": ("mm", "millimeter", "millimeters"),
    "mi": ("mi", "mile", "miles"),
    "ft": ("ft", "foot", "feet"),
    "in": ("inch", "inches"),
    "kg": ("kg", "kgs", "kilogram", "kilograms", "kilo", "kilos"),
    "g": ("g", "gram", "grams"),
    "lb": ("lb", "lbs", "pound", "pounds"),
    "oz": ("oz", "ounce", "ounces"),
    "l": ("l", "liter", "liters", "litre", "litres"),
    "ml": ("ml", "milliliter", "milliliters", "millilitre", "millilitres"),
    "gal": ("gallon", "gallons"),
    "c": ("°c", "celsius", "centigrade"),
    "f": ("°f", "fahrenheit"),
    "k": ("kelvin",),
    "s": ("s", "sec", "secs", "second", "seconds"),
    "ms": ("ms", "millisecond", "milliseconds"),
    "min": ("min", "mins", "minute", "minutes"),
    "h": ("h", "hr", "hrs", "hour", "hours"),
    "day": ("day", "days"),
    "week": ("week", "weeks"),
    "month": ("month", "months"),
    "year": ("year", "years"),
    "%": ("%", "percent", "per cent", "percentage"),
    "usd": ("$", "usd", "dollar", "dollars"),
    "eur": ("€", "eur", "euro", "euros"),
    "gbp": ("£", "gbp"),
    "b": ("byte", "bytes"),
    "kb": ("kb", "kilobyte", "kilobytes"),
    "mb": ("mb", "megabyte", "megabytes"),
    "gb": ("gb", "gigabyte", "gigabytes"),
    "tb": ("tb", "terabyte", "terabytes"),
    "mph": ("mph",),
    "kmh": ("km/h", "kph"),
    "w": ("w", "watt", "watts"),
    "kw": ("kw", "kilowatt", "kilowatts"),
    "v": ("v", "volt", "volts"),
    "hz": ("hz", "hertz"),
    "ghz": ("ghz",),
    "cup": ("cup", "cups"),
    "tbsp": ("tbsp", "tablespoon", "tablespoons"),
    "tsp": ("tsp", "teaspoon", "teaspoons"),
}
# Free-standing units change the question without a number ("in km or miles?").
_STANDALONE_UNITS = {name for name, spellings in _UNITS.items()
                     if any(len(s) > 3 for s in spellings)} - {"s", "day", "week", "month", "year"}
# Short spellings that are units even with no number ("in km or miles?").
_UNIT_SYMBOLS = {"km", "kg", "cm", "mm", "ft", "lb", "lbs", "oz", "ml", "mph", "kph", "km/h", "kb",
                 "mb", "gb", "tb", "ghz", "hz", "kw", "°c", "°f", "$", "€", "£", "%", "usd", "eur",
                 "gbp", "tsp", "tbsp"}
_UNIT_OF = {spelling: name for name, spellings in _UNITS.items() for spelling in spellings}
_NEGATIONS = {
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere", "without",
    "cannot", "cant", "can't", "won't", "don't", "doesn't", "didn't", "isn't", "aren't",
    "wasn't", "weren't", "shouldn't", "wouldn't", "couldn't", "mustn't", "hasn't", "haven't",
    "hadn't", "avoid", "except", "excluding", "unless", "lack", "lacks", "fail", "fails",
    "stop", "prevent", "disable", "never", "neither", "non",
    # as typed in chat, without the apostrophe ("wont" is a word, so not here)
    "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "shouldnt", "wouldnt",
    "couldnt", "hasnt", "havent", "hadnt", "mustnt",
}
# Words whose opposite is one word away: the answer flips with them ("sort in
# ascending order" vs "descending"). Which of them a question uses must agree.
_ANTONYM_PAIRS = (
    ("ascending", "descending"), ("increase", "decrease"), ("increasing", "decreasing"),
    ("before", "after"), ("minimum", "maximum"), ("min", "max"), ("hot", "cold"),
    ("up", "down"), ("left", "right"), ("buy", "sell"), ("buying", "selling"),
    ("import", "export"), ("upload", "download"), ("encrypt", "decrypt"), ("start", "stop"),
    ("open", "close"), ("add", "remove"), ("enable", "disable"), ("push", "pull"),
    ("high", "low"), ("higher", "lower"), ("highest", "lowest"), ("more", "less"),
    ("more", "fewer"), ("largest", "smallest"), ("biggest", "smallest"), ("first", "last"),
    ("oldest", "newest"), ("earliest", "latest"), ("north", "south"), ("east", "west"),
    ("upper", "lower"), ("inside", "outside"), ("positive", "negative"), ("true", "false"),
    ("win", "lose"), ("gain", "lose"), ("male", "female"), ("input", "output"),
    ("send", "receive"), ("sender", "receiver"), ("client", "server"), ("private", "public"),
    ("long", "short"), ("longer", "shorter"), ("heavy", "light"), ("fast", "slow"),
    ("faster", "slower"), ("cheap", "expensive"), ("cheapest", "most expensive"),
    ("best", "worst"), ("better", "worse"), ("over", "under"), ("above", "below"),
    ("safe", "dangerous"), ("legal", "illegal"), ("wet", "dry"), ("acidic", "alkaline"),
    ("sync", "async"), ("synchronous", "asynchronous"), ("inner", "outer"),
    ("lowercase", "uppercase"), ("horizontal", "vertical"), ("rows", "columns"),
    ("rise", "fall"), ("gain", "loss"), ("profit", "loss"), ("success", "failure"),
    ("accept", "reject"), ("allow", "deny"), ("include", "exclude"), ("join", "leave"),
    ("mount", "unmount"), ("install", "uninstall"), ("lock", "unlock"), ("on", "off"),
    ("most", "least"),
)
# word -> the words that mean its opposite
_OPPOSITE_OF: dict[str, set[str]] = {}
for _a, _b in _ANTONYM_PAIRS:
    _OPPOSITE_OF.setdefault(_a, set()).add(_b)
    _OPPOSITE_OF.setdefault(_b, set()).add(_a)


def _opposable(word: str) -> tuple[str, ...]:
    """``word`` if it has an opposite, and, for a comparative or superlative
    ("hottest", "colder", "cheapest"), the word it is made from if that has one."""
    return tuple(w for w in (word, _base(word)) if w is not None and w in _OPPOSITE_OF)


def _base(word: str) -> str | None:
    """The word a comparative or superlative is made from, when that word has an
    opposite: "hottest" -> "hot", "larger" -> "large", "heavier" -> "heavy"."""
    for suffix in ("est", "er"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            stem = word[:-len(suffix)]
            forms = [stem, stem + "e"]
            if len(stem) > 3 and stem[-1] == stem[-2]:
                forms.append(stem[:-1])
            if stem.endswith("i"):
                forms.append(stem[:-1] + "y")
            found = next((f for f in forms if f in _OPPOSITE_OF), None)
            if found is not None:
                return found
    return None


# Words written capitalized at a sentence start, or always, that name nothing.
_COMMON = {
    "i", "what", "how", "why", "when", "where", "which", "who", "whom", "whose", "is", "are",
    "can", "could", "should", "would", "will", "do", "does", "did", "tell", "explain",
    "give", "list", "please", "the", "a", "an", "in", "on", "for", "of", "to", "and", "or",
    "if", "my", "me", "we", "you", "it", "this", "that", "there", "write", "show", "describe",
    "define", "help", "any", "was", "were", "has", "have", "hey", "hi", "hello", "ok", "okay",
    "so", "also", "now", "then", "with", "about", "by", "from", "at", "as", "be", "name",
    "compare", "summarize", "suggest", "recommend", "find", "make", "create", "translate",
    "english", "what's", "how's", "who's", "where's", "i'm", "let's", "its", "it's",
    # imperative and question openers
    "convert", "calculate", "compute", "estimate", "tell", "explain", "outline", "sum",
    "add", "subtract", "multiply", "divide", "count", "check", "fix", "debug", "implement",
    "rewrite", "refactor", "sort", "reverse", "generate", "draft", "provide", "identify",
    "determine", "name", "state", "spell", "rank", "evaluate", "solve", "simplify", "prove",
    "recommend", "offer", "share", "teach", "walk", "guide", "remind", "store", "keep",
    "use", "run", "read", "open", "close", "set", "get", "put", "print", "return", "build",
    "install", "configure", "deploy", "cook", "bake", "boil", "plant", "grow", "clean",
    "wash", "cut", "pick", "choose", "select", "buy", "sell", "pay", "send", "call",
    "roughly", "approximately", "about", "briefly", "quickly", "just", "again", "quick",
    "some", "many", "much", "more", "most", "few", "all", "each", "every", "both", "other",
    "another", "one", "two", "three", "five", "ten", "after", "before", "during", "between",
    "since", "until", "while", "though", "although", "because", "but", "yet", "not", "no",
    "never", "without", "yes", "in", "into", "over", "under", "tips", "steps", "ways",
    "best", "good", "bad", "better", "worse", "easy", "hard", "simple", "fast", "slow",
    "typical", "usual", "normal", "common", "recommended", "safe", "possible", "okay",
    "am", "been", "being", "had", "having", "doing", "done", "say", "said", "mean", "means",
    "difference", "differences", "why's", "when's", "which's", "given", "assuming", "suppose",
}

_FILLER = {"the", "a", "an", "please", "of", "is", "are", "do", "does", "to", "in", "and"}
_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9_'’.]*[A-Za-z0-9_]|[A-Za-z]")
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
_BACKTICKED = re.compile(r"`([^`]{1,200})`")
_SNAKE = re.compile(r"\b[A-Za-z_][A-Za-z0-9]*_[A-Za-z0-9_]+\b")
_CAMEL = re.compile(r"\b[a-z]+[A-Z][A-Za-z0-9]*\b|\b[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*\b")
_DOTTED = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?:\(\))?")
_CALL = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\(\)")
_FLAG = re.compile(r"(?<!\w)--?[a-z][a-z0-9-]*")
_SENTENCE_START = re.compile(r"(?:^|[.!?:;]\s+|\n\s*)([\"'(\[]?)([A-Z][\w'’]*)")


@dataclass(frozen=True)
class Facts:
    """What must agree between two questions for one to answer the other."""

    numbers: frozenset[str]
    units: frozenset[str]
    negations: int  # count: "not not" is rare, but parity alone would be wrong too
    entities: tuple[str, ...]  # in order: "Alice owes Bob" is not "Bob owes Alice"
    identifiers: frozenset[str]
    words: tuple[str, ...]  # content words in order
    opposites: frozenset[str]  # words with a one-word antonym (ascending/descending)
    content: tuple[str, ...] = ()  # wording.content_words, in order
    asks: asking.Asking = asking.Asking("", "", "", ())  # how it asks (why/how, tense, mood)


def _canonical_number(text: str) -> str:
    value = float(text.replace(",", ""))
    return str(int(value)) if value.is_integer() else repr(value)


def _words(text: str) -> list[str]:
    return [w.replace("’", "'").strip(".").lower() for w in _TOKEN.findall(text)]


def _numbers(text: str, words: list[str]) -> frozenset[str]:
    found = {_canonical_number(m) for m in _NUMBER.findall(text)}
    found |= {_canonical_number(str(_WORD_NUMBERS[w])) for w in words if w in _WORD_NUMBERS}
    return frozenset(found)


_UNIT_TOKEN = re.compile(r"km/h|°[cf]|[$€£%]|[-+]?\d[\d,]*(?:\.\d+)?|[a-z]+", re.IGNORECASE)


def _units(text: str) -> frozenset[str]:
    """Units bound to their number ("100:usd", "5:km") and free-standing ones ("mi"):
    "100 dollars in euros" is not "100 euros in dollars"."""
    tokens = [t.lower() for t in _UNIT_TOKEN.findall(text)]
    found: set[str] = set()
    bound: set[int] = set()
    for i, token in enumerate(tokens):
        number = _number_value(token)
        if number is None:
            continue
        after = tokens[i + 1] if i + 1 < len(tokens) else ""
        before = tokens[i - 1] if i else ""
        if after in ("degrees", "degree") and i + 2 < len(tokens):
            after, i = tokens[i + 2], i + 1
        for j, unit in ((i + 1, after), (i - 1, before)):
            if unit in _UNIT_OF and (j == i + 1 or unit in "$€£"):
                found.add(f"{number}:{_UNIT_OF[unit]}")
                bound.add(j)
                break
    for i, token in enumerate(tokens):
        unit = _UNIT_OF.get(token)
        free = len(token) > 3 and unit in _STANDALONE_UNITS or token in _UNIT_SYMBOLS
        if unit is not None and i not in bound and free:
            found.add(unit)
    if "per cent" in text.lower():
        found.add("%")
    return frozenset(found)


def _number_value(token: str) -> str | None:
    if token[:1].isdigit() or (token[:1] in "+-" and token[1:2].isdigit()):
        return _canonical_number(token)
    if token in _WORD_NUMBERS:
        return _canonical_number(str(_WORD_NUMBERS[token]))
    return None


def _negations(words: list[str]) -> int:
    return sum(1 for w in words if w in _NEGATIONS or w.endswith("n't"))


def _entities(text: str) -> tuple[str, ...]:
    starts = {m.start(2) for m in _SENTENCE_START.finditer(text)}
    found: dict[str, None] = {}
    for match in _TOKEN.finditer(text):
        word = match.group().replace("’", "'").rstrip(".")
        bare = word.split("'")[0]
        if not bare[:1].isupper() or bare.lower() in _COMMON:
            continue
        # A capital at a sentence start names something only if it is not a common word,
        # which we cannot know; acronyms and mid-sentence capitals we can trust.
        if match.start() in starts and not (bare.isupper() and len(bare) > 1):
            if bare.lower() in _COMMON or len(bare) < 3:
                continue
        found[bare.lower()] = None
    return tuple(found)


def _identifiers(text: str) -> frozenset[str]:
    found = {m.strip() for m in _BACKTICKED.findall(text)}
    for pattern in (_SNAKE, _CAMEL, _DOTTED, _CALL, _FLAG):
        found |= {m.rstrip("()") for m in pattern.findall(text)}
    # Dotted names also match sentence ends ("end.Next"): keep those with code shape only.
    return frozenset(i for i in found if not re.fullmatch(r"[A-Za-z]+\.[A-Z][a-z]+", i))


def facts(text: str) -> Facts:
    words = _words(text)
    return Facts(_numbers(text, words), _units(text), _negations(words),
                 _entities(text), _identifiers(text), tuple(w for w in words if w not in _FILLER),
                 frozenset(f for w in words for f in _opposable(w)),
                 wording.content_words(text),
                 asking.asking(text))


def compare(new: Facts, cached: Facts) -> str | None:
    """None if the facts agree, else why not."""
    if new.numbers != cached.numbers:
        return "numbers"
    if new.units != cached.units:
        return "units"
    if new.negations != cached.negations:
        return "negation"
    if new.identifiers != cached.identifiers:
        return "identifiers"
    if _opposed(new.opposites, cached.opposites) or _opposed(cached.opposites, new.opposites):
        return "opposites"
    if _negated_word(new.content, cached.content) or _negated_word(cached.content, new.content):
        return "negated word"
    if not _mentioned(new.entities, cached) or not _mentioned(cached.entities, new):
        return "entities"
    # The same words in another order: "A compared to B" is not "B compared to A".
    if new.words != cached.words and sorted(new.words) == sorted(cached.words):
        return "word order"
    return wording.changed(new.content, cached.content) or asking.differs(new.asks, cached.asks)


def _mentioned(entities: tuple[str, ...], other: Facts) -> bool:
    """Each name is in the other question too, capitalized there or not: users
    type "us citizen" for "US citizen", "earth" for "Earth", "germany's" for
    "Germany". (Who does what to whom is the word-order guard's.)"""
    words = {w.split("'")[0] for w in other.words}
    return all(e in words for e in entities)


def _opposed(one: frozenset[str], other: frozenset[str]) -> bool:
    """``other`` uses the opposite of a word of ``one`` that it does not use itself."""
    return any(word not in other and _OPPOSITE_OF[word] & (other - one) for word in one)


_NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "non", "dis")


def _negated_word(one: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """``other`` has a word of ``one`` with a negating prefix ("rational" /
    "irrational", "likely" / "unlikely") and not the word itself."""
    mine, theirs = set(one), set(other)
    return any(prefix + word in theirs and word not in theirs and prefix + word not in mine
               for word in mine if len(word) >= 4 for prefix in _NEGATING_PREFIXES)


def check(new: str, cached: str) -> str | None:
    """None if ``cached``'s answer may serve ``new``, else the guard that refused."""
    return compare(facts(new), facts(cached))
