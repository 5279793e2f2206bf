"""The offline text `demo-moe` is built and measured on: the Python standard library's own
documentation topics (`pydoc_data.topics`, shipped with every CPython), split by topic.

Every fifth topic (in sorted order) is held out: the build never reads it, the quality benchmark
measures perplexity on it. The training text is also wrapped in SmolLM2's chat template (a user
turn asking about the topic, the documentation as the answer) so the routers see the chat tokens
that the questions are asked in. The build adds the dense model's own greedy replies to
CHAT_PROMPTS (general questions and tasks; none of the benchmark's questions), so that the
routers and refit see the chat answers a user would ask for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pydoc_data.topics import topics

CHAT_PROMPTS = (
    "What is the capital of Canada?", "What is the capital of Egypt?",
    "What is the capital of Australia?", "What is the capital of Russia?",
    "What is the capital of China?", "What is the capital of India?",
    "Who discovered penicillin?", "Who wrote Hamlet?", "Who was Albert Einstein?",
    "What is photosynthesis?", "How does rain form?", "Why do we have seasons?",
    "What is the speed of light?", "How many hours are in a day?", "What is 3 + 5?",
    "What is the largest animal on Earth?", "What do cows eat?", "What is a volcano?",
    "What is the smallest prime number?", "How many sides does a triangle have?",
    "What color are bananas?", "Which planet is closest to the Sun?",
    "What language is spoken in Mexico?", "What is the currency of the United States?",
    "Name three fruits.", "Give me a synonym for happy.", "What is the opposite of big?",
    "Write one sentence about the ocean.", "Write two sentences about a dog in the snow.",
    "Explain what a computer is in one sentence.", "What is the longest river in the world?",
    "What is gravity?", "How many minutes are in an hour?", "What is the chemical symbol for gold?",
    "Who painted The Starry Night?", "What is the freezing point of water in Fahrenheit?",
    "Tell me a fun fact about cats.", "What is a noun?", "Translate 'hello' into French.",
    "What is the main ingredient of bread?", "How do airplanes fly?",
    "What is the capital of Greece?", "What is the largest desert in the world?",
    "How many players are on a soccer team?", "What is the hardest natural substance?",
    "What instrument has 88 keys?", "What do you call a baby cat?", "What is the Moon?",
)
"""User turns the build asks the dense model (its greedy replies join the training text)."""
HELD_OUT_EVERY = 5
"""Topic i (in sorted key order) is held out when i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1."""


def _topics(held_out: bool) -> list[tuple[str, str]]:
    keys = sorted(topics)
    return [(k, topics[k]) for i, k in enumerate(keys)
            if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out]


def train_texts() -> list[str]:
    """Training documents: the non-held-out topics, each as a chat exchange."""
    return [_as_chat(name, text) for name, text in _topics(held_out=False)]


def held_out_texts() -> list[str]:
    """Held-out documents (plain text; never read by the build)."""
    return [text for _, text in _topics(held_out=True)]


def _as_chat(name: str, text: str) -> str:
    """SmolLM2's chat format around one topic (the template's own markers, written out so the
    corpus needs no tokenizer)."""
    return (f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            f"Face<|im_end|>\n<|im_start|>user\nExplain the Python topic '{name}'.<|im_end|>\n"
            f"<|im_start|>assistant\n{text.strip()}<|im_end|>\n")


def token_windows(ids_per_text: Sequence[Sequence[int]], length: int,
                  count: int) -> list[list[int]]:
    """Up to `count` windows of `length` tokens, each cut from the start of one document in turn
    and then from its following chunks, so that many documents contribute (deterministic)."""
    chunks: list[list[int]] = []
    offset = 0
    while len(chunks) < count:
        added = False
        for ids in ids_per_text:
            piece = list(ids[offset:offset + length])
            if len(piece) == length:
                chunks.append(piece)
                added = True
                if len(chunks) == count:
                    break
        if not added:
            break
        offset += length
    return chunks
