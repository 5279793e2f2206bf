"""Two lm-evaluation-harness tasks on local data, generated deterministically from fixed word
lists so SmolLM2-135M has signal on them (its scores sit well between 0 and 1):

- `hetmoe_choice` (multiple_choice, log-likelihood): which word continues a sentence, one gold
  word among three distractors of the same kind;
- `hetmoe_answer` (generate_until, chat): a one-word answer, scored by exact match of the
  answer's first word.

The task YAML files beside this module name their data as `ITEMS`; `write_tasks` writes the
items as JSONL and the YAMLs pointing at them into one folder for lm-eval's `TaskManager`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
CHOICE_TASK = "hetmoe_choice"
ANSWER_TASK = "hetmoe_answer"
SEED = 17

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "Russia": "Moscow", "Egypt": "Cairo", "England": "London",
    "China": "Beijing", "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
    "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw",
    "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Cuba": "Havana",
}
KINDS = {
    "animal": ["dog", "cat", "horse", "cow", "lion", "tiger", "sheep", "rabbit", "mouse", "bear",
               "wolf", "fox", "goat", "pig", "elephant"],
    "fruit": ["apple", "banana", "orange", "grape", "lemon", "cherry", "peach", "pear", "mango",
              "plum", "melon", "strawberry", "pineapple", "apricot", "kiwi"],
    "color": ["red", "blue", "green", "yellow", "purple", "pink", "brown", "black", "white",
              "gray", "cyan", "violet", "silver", "gold", "beige"],
    "vehicle": ["car", "bus", "truck", "bicycle", "train", "plane", "boat", "ship", "motorcycle",
                "tractor", "van", "taxi", "tram", "scooter", "helicopter"],
}
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad",
    "light": "dark", "old": "young", "open": "closed", "high": "low", "early": "late",
    "good": "bad", "rich": "poor", "hard": "soft", "full": "empty", "strong": "weak",
    "wet": "dry", "loud": "quiet", "long": "short", "thick": "thin", "clean": "dirty",
}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen", "nineteen", "twenty"]
IRREGULAR = {"mouse": "mice", "sheep": "sheep"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _choice(rng: random.Random, context: str, gold: str, pool: list[str]) -> dict[str, Any]:
    """An item: the gold word among three distractors from `pool`, in a seeded order."""
    distractors = rng.sample(sorted(set(pool) - {gold}), 3)
    choices = [gold, *distractors]
    rng.shuffle(choices)
    return {"context": context, "choices": choices, "gold": choices.index(gold)}


def choice_items() -> list[dict[str, Any]]:
    """Sentence continuations: capitals, kinds of things, opposites, counting, weekdays."""
    rng = random.Random(SEED)
    capitals = list(CAPITALS.values())
    items = [_choice(rng, f"The capital of {country} is", city, capitals)
             for country, city in CAPITALS.items()]
    for kind, words in KINDS.items():
        for word in words:
            article = "An" if word[0] in "aeiou" else "A"
            items.append(_choice(rng, f"{article} {word} is a kind of", kind, list(KINDS)))
    words = sorted(set(OPPOSITES) | set(OPPOSITES.values()))
    for word, opposite in OPPOSITES.items():
        items.append(_choice(rng, f"The opposite of {word} is", opposite, words))
        items.append(_choice(rng, f"The opposite of {opposite} is", word, words))
    for start in range(len(NUMBERS) - 3):
        run = ", ".join(NUMBERS[start:start + 3])
        items.append(_choice(rng, f"Counting: {run},", NUMBERS[start + 3], NUMBERS))
        down = ", ".join(reversed(NUMBERS[start + 1:start + 4]))
        items.append(_choice(rng, f"Count down: {down},", NUMBERS[start], NUMBERS))
    for i, day in enumerate(DAYS):
        for step in (1, 2, 3):
            items.append(_choice(rng, f"{step} days after {day} comes",
                                 DAYS[(i + step) % 7], DAYS))
    words = [word for kind in ("animal", "fruit", "vehicle") for word in KINDS[kind]]
    plurals = {word: IRREGULAR.get(word) or word + ("es" if word.endswith(("s", "ch")) else "s")
               for word in words}
    for word, plural in plurals.items():
        items.append(_choice(rng, f"One {word}, two", plural, list(plurals.values())))
    return items


def answer_items() -> list[dict[str, Any]]:
    """One-word questions: capitals, sums, next numbers, opposites, kinds."""
    items = [{"question": f"What is the capital of {country}? Answer with one word.",
              "answer": city} for country, city in CAPITALS.items()]
    for a in range(1, 10):
        for b in range(1, 10):
            items.append({"question": f"What is {a} + {b}? Answer with a number.",
                          "answer": str(a + b)})
    for start in range(1, 60, 2):
        run = ", ".join(str(n) for n in range(start, start + 4))
        items.append({"question": f"What number comes next: {run}? Answer with a number.",
                      "answer": str(start + 4)})
    for word, opposite in OPPOSITES.items():
        items.append({"question": f"What is the opposite of {word}? Answer with one word.",
                      "answer": opposite})
    for kind, words in KINDS.items():
        for word in words[:12]:
            items.append({"question": f"Is a {word} an animal, a fruit, a color or a vehicle? "
                                      "Answer with one word.", "answer": kind})
    for i, day in enumerate(DAYS):
        items.append({"question": f"Which day comes after {day}? Answer with one word.",
                      "answer": DAYS[(i + 1) % 7]})
    return items


def write_tasks(folder: Path, every: int = 1) -> dict[str, int]:
    """Writes both tasks (every `every`-th item: a smaller set over all kinds) into `folder` as
    YAML + JSONL; returns each task's item count. lm-eval's dataset cache goes there too."""
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for task, items in ((CHOICE_TASK, choice_items()), (ANSWER_TASK, answer_items())):
        data = folder / f"{task}.jsonl"
        kept = items[::every]
        data.write_text("".join(json.dumps(item) + "\n" for item in kept))
        config = yaml.safe_load((TASKS_DIR / f"{task}.yaml").read_text())
        config["dataset_kwargs"]["data_files"]["test"] = str(data)
        config["dataset_kwargs"]["cache_dir"] = str(folder / "datasets")
        (folder / f"{task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        counts[task] = len(kept)
    return counts
