"""A small byte-level BPE tokenizer, trained locally, for demos and tests without downloads.

The tokenizer is trained with the ``tokenizers`` library on a few built-in English paragraphs to
a vocabulary of :data:`VOCAB_SIZE` (256 byte symbols, 2 special tokens, the rest merges). Being
byte-level with no normalizer, it encodes any UTF-8 text and decodes it back exactly. It has a
Llama-3-like pair of special tokens and a plain chat template.

The files are written to ``cache_dir`` and reused from there; training is deterministic, so a
rebuild writes the same bytes.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
VOCAB_SIZE = 768
# Bump when the corpus, template or settings change, so stale caches are rebuilt.
_VERSION = 1
_STAMP = "tgraph_demo_tokenizer.json"

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '### ' + message['role'] + '\\n' + message['content'] + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### assistant\\n' -}}{%- endif -%}"
)

_CORPUS = """\
The river began high in the mountains, where snow melted slowly in the spring sun. Small streams
ran together over stones and roots until they formed a single quiet channel. By the time the water
reached the valley it was wide and deep, and the people of the town had built a stone bridge over
it. Children walked across the bridge every morning on their way to school, and in the evening
their parents walked home the same way, carrying bread, vegetables and news from the market.

A computer does not understand words the way people do. Before a language model can read a
sentence, the text is split into small pieces called tokens. Some tokens are whole words, some are
parts of words, and some are single letters or bytes. The model turns each token into a vector of
numbers, mixes the vectors with attention, and predicts which token should come next. Generating a
long answer means repeating this prediction one token at a time, which is why fast inference
matters so much.

The old library kept its books on tall wooden shelves. There were histories of kings and
merchants, atlases of distant islands, and thin notebooks filled with recipes for soup, cake and
pickled fruit. The librarian, who had worked there for forty years, knew where every book was
without looking at the catalogue. When a visitor asked a question, she would smile, climb the
ladder, and return with exactly the right volume, its pages smelling of dust and ink.

Engineers measure performance carefully. They count how many bytes each kernel reads and writes,
how long each step takes, and how much memory the cache needs for every request. A good system
keeps the graphics processor busy: it batches requests together, fuses small operations into
larger ones, and replays captured graphs so that the processor never waits for the host. When the
numbers improve, they write down what changed and why, so that others can learn from the result.

In the garden behind the house there were apple trees, a row of tomatoes, and a small pond where
frogs sang on warm nights. The cat liked to sit on the wall and watch the birds, although it never
caught any. On Sundays the family ate lunch outside at a long table, talking about the weather,
the harvest, and the plans they had for the coming year. Everyone agreed that the summer had been
the best one they could remember.

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are in a week? Answer: There are seven days in a week.
Question: What color is the sky on a clear day? Answer: The sky is blue on a clear day.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42.
"""


def train_demo_tokenizer() -> Tokenizer:
    """Train the raw ``tokenizers`` tokenizer on the built-in corpus (no files, no cache).

    Returns:
        The byte-level BPE tokenizer, with a post-processor that prepends BOS.
    """
    tok = Tokenizer(models.BPE())
    # No normalizer: byte-level pre-tokenization and decoding make the round trip exact.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Like Llama 3: encoding with special tokens prepends BOS; the model ends with EOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)])
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    # Imported here: transformers is slow to import and training alone does not need it.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def _stamp() -> dict[str, object]:
    return {"version": _VERSION, "vocab_size": VOCAB_SIZE}


def _cache_is_valid(cache_dir: Path) -> bool:
    stamp = cache_dir / _STAMP
    if not stamp.is_file() or not (cache_dir / "tokenizer.json").is_file():
        return False
    try:
        return json.loads(stamp.read_text()) == _stamp()
    except (OSError, ValueError):
        return False


def build_demo_tokenizer(cache_dir: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Return the demo tokenizer, training it into ``cache_dir`` on first use.

    Args:
        cache_dir: directory for the tokenizer files (``tokenizer.json``,
            ``tokenizer_config.json``, ...); created if missing. Files already there from the same
            version are loaded instead of retraining; other files in the directory are kept.

    Returns:
        A fast HF tokenizer with ``bos_token`` ``<|begin_of_text|>``, ``eos_token`` (and
        ``pad_token``) ``<|end_of_text|>`` and a chat template.
    """
    from transformers import PreTrainedTokenizerFast

    cache_dir = Path(cache_dir)
    if not _cache_is_valid(cache_dir):
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Build in a private directory and move the files in, the stamp last, so a concurrent
        # reader never sees a half-written tokenizer as valid.
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".build-") as tmp:
            _wrap(train_demo_tokenizer()).save_pretrained(tmp)
            Path(tmp, _STAMP).write_text(json.dumps(_stamp(), sort_keys=True) + "\n")
            names = sorted(os.listdir(tmp), key=lambda n: n == _STAMP)
            for name in names:
                os.replace(os.path.join(tmp, name), cache_dir / name)
    return PreTrainedTokenizerFast.from_pretrained(str(cache_dir), local_files_only=True)

