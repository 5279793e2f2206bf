"""The tokenizer of the tiny presets: a byte-level BPE trained in-process on a built-in text.

Offline and deterministic: the same text and settings give the same 512-token vocabulary on every
machine, so token ids in tests are stable. Special tokens come first (ids 0..5), matching the tiny
configs' `bos_token_id=0`, `eos_token_id=1`, `pad_token_id=2`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 512
"""Tokens in the vocabulary, special tokens included; equals the tiny models' `vocab_size`."""

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
"""Ids 0.. in this order: bos, eos, pad, then the chat roles."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Each turn as `<|role|>\\ncontent</s>\\n`, the reply opened by `<|assistant|>\\n`."""

# Enough varied English for ~250 merges; written for this file.
_TRAINING_TEXT = """\
Hello! The harbour town woke slowly that morning. Fishing boats rocked against the wooden pier,
and the baker opened her shutters to let the smell of fresh bread drift down the narrow street.
Children ran past the fountain, laughing, chasing a small brown dog that had stolen a glove.
An old man sat on the bench by the lighthouse, reading yesterday's newspaper for the third time.
He liked the weather report best: wind from the west, light rain in the afternoon, clear by night.
Where do the gulls go when it storms? Nobody in the town could answer, though everyone had a theory.
The teacher said they hide in the cliffs; the fisherman said they fly far out to sea; the baker
said they simply wait on the roof of the church, patient as stones, until the sky turns blue again.
In the market, merchants shouted prices for apples, onions, cheese, honey and warm woollen socks.
A traveller asked for directions to the station. "Follow the river," said a girl, "then turn left
at the red bridge, walk past the library, and you will see the clock tower. You cannot miss it."
He thanked her, bought a cup of tea, and wrote a short letter home: the journey is long but kind,
the people are friendly, the food is good, and tomorrow I will climb the hill to watch the sunrise.
Numbers matter too: one, two, three, four, five, six, seven, eight, nine, ten; 2024, 3.14, 42, 100.
Questions and answers, lists and stories, greetings and goodbyes: a model needs a bit of everything.
What is your name? My name is Tiny. How are you today? I am well, thank you, and how are you?
Please write a poem about the sea. The sea is wide, the sea is deep, it sings the sailors
all to sleep.
"""


def save_tiny_tokenizer(path: str | Path) -> None:
    """Trains the tiny tokenizer; writes tokenizer.json, its config and chat template to `path`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TRAINING_TEXT], trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: "
            "the built-in training text is too short"
        )
    bos = SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )
    fast.save_pretrained(str(path))
