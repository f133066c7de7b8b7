"""The word-level tokenizer and prompt formats of the default models.

Built offline with ``tokenizers``: the vocabulary is every word of the scene
templates, so no download is needed and every answer is one token.
"""

from __future__ import annotations

import re

from core.models.words import WORD, unknown_words  # noqa: F401  (unknown_words re-exported)
from core.zoo import scenes

PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IMAGE)

# The LLaVA prompt: exactly what the saved chat template renders for one
# user turn holding an image then the question, with the generation prompt.
LLAVA_PROMPT = "USER: <image>\n{question} ASSISTANT:"
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %} "
    "{% elif message['role'] == 'assistant' %}ASSISTANT: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
# The CoCa prompt: the decoder reads the image through cross-attention only.
COCA_PROMPT = "question: {question} answer:"

_WORD = WORD  # the pattern the adapters' unknown_words check uses


def words() -> list[str]:
    """Every word the templates, the prompts and the answers can produce."""
    found: set[str] = set()
    texts = [t["text"] for t in scenes.TEMPLATES.values()]
    texts += [LLAVA_PROMPT, COCA_PROMPT, " ".join(scenes.RELATIONS)]
    texts += list(scenes.ANSWER_WORDS) + list(scenes.SHAPE_PLURALS.values())
    for text in texts:
        text = re.sub(r"\{[a-z0-9]+\}", " ", text.replace("<image>", " "))
        found.update(_WORD.findall(text.lower()))
    return sorted(found)


def build_tokenizer():
    """A ``tokenizers.Tokenizer``: lowercase, split on words and punctuation,
    one id per word, ``<s>`` prepended."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in words():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tok


def build_hf_tokenizer():
    """The same tokenizer wrapped for transformers (saved beside each model)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        model_max_length=256,
        padding_side="right",
    )
