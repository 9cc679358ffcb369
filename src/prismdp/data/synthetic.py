"""A built-in, generated binary text task for the offline demo: short product reviews, positive or negative.

Nothing here is taken from a dataset; sentences are composed from the vocabulary lists below.  Each review has
one *opinion clause* that decides the label, optionally wrapped in neutral filler sentences and, with probability
``CONTRAST_PROB``, preceded by a clause of the *opposite* polarity joined by "but" / introduced by "although", so
that the label depends on the clause structure and not only on which sentiment words occur:

* adjective clauses ("The kettle is really sturdy.", "I found the tent flimsy."), where a negation ("is not",
  "isn't", "is hardly", "did not find ... ") flips the polarity: "The kettle is not sturdy." is negative,
  "The kettle is not bad." positive;
* recommendation / return / satisfaction clauses ("I would recommend this router.", "I would never recommend ...",
  "I will return this kettle.", "I will not return ...", "I am not happy with the ...");
* contrast: "The box looked nice, but the lamp is flimsy." takes the label of the clause after "but";
  "Although the delivery was slow, I would recommend this lamp." the label of the main clause.

Labels: 1 = positive, 0 = negative (``LABEL_NAMES``).  A pretrained sentence encoder separates much of this after
a little fine-tuning, but a randomly initialised classification head is at chance at step 0, and the negated and
contrastive forms (about half of the examples) defeat a bag-of-sentiment-words shortcut.

:func:`make_synthetic_task` is deterministic for a seed (it uses only ``random.Random(seed)``), returns exactly
balanced splits (``n // 2`` negatives, the rest positive), no duplicate sentences, and train/test disjoint.
The train split is generated first, so it does not depend on ``n_test``.
"""

from __future__ import annotations

import random
from typing import List, Set, Tuple

from .example import Example

__all__ = ["LABEL_NAMES", "NUM_LABELS", "CONTRAST_PROB", "NEGATION_PROB", "make_synthetic_task"]

LABEL_NAMES = ("negative", "positive")
NUM_LABELS = 2
NEGATION_PROB = 0.35
CONTRAST_PROB = 0.25
FILLER_PROB = 0.5

ITEMS = (
    "blender", "kettle", "toaster", "desk lamp", "office chair", "backpack", "rain jacket", "tent", "water bottle",
    "coffee grinder", "keyboard", "mouse", "monitor", "router", "phone case", "suitcase", "umbrella", "frying pan",
    "vacuum cleaner", "mattress", "camera bag", "bike helmet", "sleeping bag", "wall clock", "bookshelf",
    "hair dryer", "garden hose", "speaker", "charger", "notebook",
)
POSITIVE = (
    "good", "great", "excellent", "reliable", "sturdy", "comfortable", "well made", "wonderful", "impressive",
    "solid", "durable", "pleasant", "handy", "fantastic", "worth the money", "easy to use", "nicely designed",
    "dependable", "lovely", "superb",
)
NEGATIVE = (
    "bad", "poor", "flimsy", "awful", "disappointing", "terrible", "unreliable", "useless", "fragile", "noisy",
    "uncomfortable", "defective", "mediocre", "faulty", "overpriced", "hard to use", "badly designed", "cheaply made",
    "annoying", "broken",
)
INTENSIFIERS = ("", "", "", "very ", "really ", "quite ", "truly ", "pretty ", "rather ", "extremely ")
NEGATED_INTENSIFIERS = ("", "", "very ", "really ", "that ", "all that ")
# side remarks for the first clause of a contrast (their polarity is opposite to the label)
SIDE_POSITIVE = (
    "the packaging was neat", "the delivery was quick", "the color is lovely", "the manual was clear",
    "the price was low", "the box looked nice", "the seller was friendly", "the design is great",
)
SIDE_NEGATIVE = (
    "the packaging was torn", "the delivery was slow", "the color is dull", "the manual was confusing",
    "the price was high", "the box arrived dented", "the seller was rude", "the design is awful",
)
FILLERS = (
    "I bought it last month.", "It arrived on a Tuesday.", "My sister picked the color.", "I ordered it online.",
    "We keep it in the kitchen.", "I use it mostly on weekends.", "It came with a manual.",
    "This is my second order from the shop.", "I got it as a gift.", "We have had it for a few weeks.",
    "It is the blue model.", "I compared a few brands first.", "My neighbour has the same one.",
    "I mainly use it at work.",
)


def _adj_clause(rng: random.Random, item: str, positive: bool, negated: bool) -> str:
    adj = rng.choice(POSITIVE if positive else NEGATIVE)
    inten = rng.choice(NEGATED_INTENSIFIERS if negated else INTENSIFIERS)
    det = rng.choice(("The", "This", "My"))
    form = rng.randrange(4)
    if form == 0:
        verb = rng.choice(("is not", "isn't", "is hardly", "was not")) if negated else rng.choice(("is", "was"))
        return f"{det} {item} {verb} {inten}{adj}."
    if form == 1:
        verb = rng.choice(("did not find", "never found")) if negated else rng.choice(("found", "think"))
        tail = "" if verb != "think" else " is"
        return f"I {verb} the {item}{tail} {inten}{adj}."
    if form == 2:
        verb = rng.choice(("does not seem", "doesn't feel")) if negated else rng.choice(("seems", "feels"))
        return f"{det} {item} {verb} {inten}{adj}."
    verb = rng.choice(("would not call", "wouldn't call")) if negated else rng.choice(("would call", "must call"))
    return f"I {verb} this {item} {inten}{adj}."


def _verdict_clause(rng: random.Random, item: str, positive_words: bool, negated: bool) -> str:
    if rng.random() < 0.5:
        if positive_words:
            verb = (rng.choice(("would not", "would never", "cannot")) if negated
                    else rng.choice(("would", "would gladly", "can")))
            return f"I {verb} recommend this {item}."
        verb = (rng.choice(("will not", "would never", "do not want to")) if negated
                else rng.choice(("will", "want to", "am going to")))
        return f"I {verb} return this {item}."
    mood = rng.choice(("happy", "satisfied", "pleased")) if positive_words else rng.choice(
        ("unhappy", "disappointed", "annoyed"))
    verb = rng.choice(("am not", "was not")) if negated else rng.choice(("am", "was"))
    return f"I {verb} {mood} with the {item}."


def _opinion(rng: random.Random, item: str, label: int) -> str:
    negated = rng.random() < NEGATION_PROB
    words_positive = bool(label) != negated  # negation flips the polarity of the words
    if rng.random() < 0.7:
        return _adj_clause(rng, item, words_positive, negated)
    return _verdict_clause(rng, item, words_positive, negated)


def _side_remark(rng: random.Random, positive: bool) -> str:
    return rng.choice(SIDE_POSITIVE if positive else SIDE_NEGATIVE)


def _lower_first(s: str) -> str:
    return s if s.startswith("I ") else s[0].lower() + s[1:]


def _sentence(rng: random.Random, label: int) -> str:
    item = rng.choice(ITEMS)
    core = _opinion(rng, item, label)
    if rng.random() < CONTRAST_PROB:
        side = _side_remark(rng, positive=not label)  # opposite polarity, does not decide the label
        if rng.random() < 0.5:
            core = f"{side[0].upper()}{side[1:]}, but {_lower_first(core)}"
        else:
            core = f"Although {side}, {_lower_first(core)}"
    before = rng.choice(FILLERS) if rng.random() < FILLER_PROB else None
    after = rng.choice([f for f in FILLERS if f != before]) if rng.random() < FILLER_PROB / 2 else None
    return " ".join(p for p in (before, core, after) if p)


def _split(rng: random.Random, n: int, seen: Set[str]) -> List[Example]:
    labels = [0] * (n // 2) + [1] * (n - n // 2)
    out: List[Example] = []
    budget = 200 * n + 1000
    for label in labels:
        while True:
            budget -= 1
            if budget < 0:
                raise RuntimeError(f"could not generate {n} distinct synthetic sentences (vocabulary exhausted); "
                                   f"ask for fewer examples")
            s = _sentence(rng, label)
            if s not in seen:
                seen.add(s)
                out.append(Example(s, None, label))
                break
    rng.shuffle(out)
    return out


def make_synthetic_task(n_train: int, n_test: int, seed: int = 0) -> Tuple[List[Example], List[Example]]:
    """Generate ``(train, test)`` lists of single-sentence :class:`Example` with labels 0/1 (see module doc)."""
    if int(n_train) < 0 or int(n_test) < 0:
        raise ValueError(f"n_train and n_test must be >= 0, got {n_train}, {n_test}")
    rng = random.Random(int(seed))
    seen: Set[str] = set()
    train = _split(rng, int(n_train), seen)
    test = _split(rng, int(n_test), seen)
    return train, test
