"""Writes train.txt and validation.txt beside this file: plain English made from a small seeded
grammar (a chronicle of a river town: weather, work, markets, journeys), one paragraph a line,
so nothing is downloaded and the text is free to ship. Deterministic:

    .venv/bin/python examples/data/make_text.py        # then make_tokenizer.py
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).parent

NAMES = ["Anna", "Tomas", "Mira", "Jonah", "Elsa", "Peter", "Ruth", "Samuel", "Clara", "Oskar",
         "Lena", "Martin", "Greta", "Paul", "Ida", "Henrik"]
TRADES = ["baker", "miller", "carpenter", "ferryman", "weaver", "smith", "teacher", "fisher",
          "shepherd", "potter", "gardener", "clerk"]
PLACES = ["the market square", "the old mill", "the river bank", "the school house",
          "the north field", "the harbour", "the church yard", "the long bridge", "the orchard",
          "the station", "the library", "the forest path"]
THINGS = ["bread", "apples", "timber", "wool", "letters", "fish", "candles", "salt", "barley",
          "cheese", "nails", "lamps", "baskets", "honey"]
WEATHER = ["the morning was cold and clear", "a grey rain fell all day",
           "the wind came down from the hills", "the sun was warm on the roofs",
           "a thick fog lay on the water", "snow covered the roads",
           "the air smelled of wet leaves", "clouds moved slowly over the valley"]
SEASONS = ["In spring", "In the summer", "In autumn", "In winter", "Early in the year",
           "Late in the year", "On the first day of the month", "At the end of the week"]
FEELINGS = ["glad", "tired", "worried", "proud", "quiet", "hopeful", "curious", "patient"]
ANIMALS = ["a brown dog", "two white geese", "an old horse", "a black cat", "a flock of sheep",
           "a pair of swans", "a small goat", "the crows"]
VERBS = ["carried", "sold", "counted", "mended", "bought", "packed", "sorted", "delivered"]
TIMES = ["before dawn", "at noon", "in the evening", "after supper", "late at night",
         "in the afternoon"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve"]


def sentence(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    forms = [
        lambda: f"{rng.choice(SEASONS)} {rng.choice(WEATHER)}.",
        lambda: f"{name} the {rng.choice(TRADES)} {rng.choice(VERBS)} {rng.choice(NUMBERS)} "
                f"baskets of {rng.choice(THINGS)} at {rng.choice(PLACES)} {rng.choice(TIMES)}.",
        lambda: f"{name} walked to {rng.choice(PLACES)} and met {other}, who was "
                f"{rng.choice(FEELINGS)} because {rng.choice(WEATHER)}.",
        lambda: f"{rng.choice(ANIMALS).capitalize()} waited near {rng.choice(PLACES)} while "
                f"{name} {rng.choice(VERBS)} the {rng.choice(THINGS)}.",
        lambda: f"\"We need more {rng.choice(THINGS)},\" said {name}, and {other} promised to "
                f"bring {rng.choice(NUMBERS)} sacks {rng.choice(TIMES)}.",
        lambda: f"The {rng.choice(TRADES)} asked {name} how much the {rng.choice(THINGS)} cost, "
                f"and {name} answered that it was {rng.choice(NUMBERS)} coins.",
        lambda: f"{name} felt {rng.choice(FEELINGS)} {rng.choice(TIMES)}, so {name} read a "
                f"book about {rng.choice(THINGS)} by the fire.",
        lambda: f"People said that {rng.choice(WEATHER)}, but {other} only laughed and went on "
                f"working at {rng.choice(PLACES)}.",
        lambda: f"When the train came to {rng.choice(PLACES)}, {name} and {other} unloaded "
                f"{rng.choice(NUMBERS)} crates of {rng.choice(THINGS)}.",
        lambda: f"{name} wrote a letter to {other} and told of {rng.choice(ANIMALS)} that "
                f"slept at {rng.choice(PLACES)}.",
    ]
    return rng.choice(forms)()


def paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(3, 7)))


def write(path: Path, seed: int, size: int) -> None:
    rng, lines, total = random.Random(seed), [], 0
    while total < size:
        lines.append(paragraph(rng))
        total += len(lines[-1]) + 1
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write(HERE / "train.txt", seed=1, size=48_000)
    write(HERE / "validation.txt", seed=2, size=8_000)
    print(f"wrote {HERE / 'train.txt'} and {HERE / 'validation.txt'}")
