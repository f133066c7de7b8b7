"""The canonical view of a loaded model.

An :class:`Adapter` is the one place that knows a family's module paths and
input format. Methods never reach into a model's modules: they go through
the adapter. Each family subclasses it in ``core/models/families/<family>.py``
and registers itself in :mod:`core.models.registry`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from PIL import Image

from core.errors import ModelLoadError, QuestionError, ReadoutError

# The question every adapter renders once when it is built: the prompt must
# render, hold it verbatim and hold one image placeholder (where the processor
# has one), so a broken template fails at load time, not on every question.
PROBE_QUESTION = "what is in the image?"


def check_text(text, what: str = "question") -> str:
    """``text`` if it is a ``str`` that UTF-8 can encode; QuestionError otherwise
    (tokenizers raise a TypeError on lone surrogates such as ``"\\udcff"``)."""
    if not isinstance(text, str):
        raise QuestionError(f"the {what} is not valid text (got {type(text).__name__}, expected a string)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise QuestionError(
            f"the {what} is not valid text (character {e.start} is {text[e.start]!r}, "
            "a lone surrogate that UTF-8 cannot encode)"
        ) from None
    return text


def check_pairs(images, questions) -> None:
    """QuestionError unless there is one image per question (``questions`` a
    sequence of questions, not one string)."""
    if isinstance(questions, str):
        raise QuestionError("expected a list of questions, got one string")
    if len(images) != len(questions):
        raise QuestionError(f"{len(images)} images for {len(questions)} questions (one image per question)")


def is_markup(token: str) -> bool:
    """Whether a special token's string can only be markup: it holds a letter
    or digit AND a symbol (``</s>``, ``[SEP]``, ``<|im_end|>``). A special
    token that is a plain word (an unk or pad token spelled ``unk``) or a lone
    symbol (CLIP's pad ``!``) is ordinary text too, and must not refuse
    ordinary questions."""
    return (
        isinstance(token, str)
        and any(c.isalnum() for c in token)
        and any(not c.isalnum() and not c.isspace() for c in token)
    )


def config_value(config, path: str):
    """The value at the dotted ``path`` of a config object or dict; None if absent."""
    value = config
    for part in path.split("."):
        if value is None:
            return None
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


def config_key(config, path: str) -> str:
    """``path`` as config.json spells it (``image_token_id`` is ``image_token_index``
    in LLaVA's, PaliGemma's and Mllama's configs)."""
    *parents, name = path.split(".")
    owner = config_value(config, ".".join(parents)) if parents else config
    name = getattr(type(owner), "attribute_map", {}).get(name, name)
    return ".".join([*parents, name])


def config_int(config, path: str, *, minimum: int = 0, required: bool = False) -> int | None:
    """The integer at ``path`` (None if absent and not ``required``); a one-line
    ModelLoadError naming the config.json field when it is missing, not an
    integer (bools and fractional numbers included) or below ``minimum``."""
    value = config_value(config, path)
    key = config_key(config, path)
    if value is None:
        if required:
            raise ModelLoadError(f"config.json {key}: missing (expected an integer >= {minimum})")
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"config.json {key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _first_named(text: str, tokens: list[str]) -> str:
    """The token of ``tokens`` that occurs first in ``text`` (the longest at a
    tie); tokens found only in the encoding (not as substrings) come last."""

    def key(token: str) -> tuple[int, int]:
        at = text.find(token)
        return (at if at >= 0 else len(text), -len(token))

    return min(tokens, key=key)


@dataclass(frozen=True)
class PromptMarkup:
    """The strings of one model that a question may not hold.

    Attributes:
        placeholders: ``{string: kind}`` the processor expands into visual
            tokens ("image", "video"): refused even in raw prompts (one image
            per question; the processor or the model would fail on a second).
        special: every other special / control token string (sorted).
        ids: ``{token id: string}`` of all of them, for text the tokenizer
            normalises into a special token (matched on the encoded ids).
    """

    placeholders: dict[str, str]
    special: tuple[str, ...]
    ids: dict[int, str]


@dataclass
class ModelInputs:
    """A prepared batch.

    Attributes:
        tensors: keyword arguments for the family's forward.
        answer_positions: ``(batch,)`` index of the position whose next-token
            distribution is the answer.
        input_ids: ``(batch, pos)`` the token ids of the text stream.
    """

    tensors: dict[str, torch.Tensor]
    answer_positions: torch.Tensor
    input_ids: torch.Tensor
    prompts: list[str]


class Adapter(ABC):
    """Canonical names for one model family.

    Attributes:
        family: registry name of the family ("llava", "coca", ...).
        final_norm: "rmsnorm" or "layernorm".
        attention_kind: "self" (visual tokens interleaved with text) or
            "cross" (text queries attend to visual keys).
        position_scheme: "none", "absolute", "rope" or "mrope".
    """

    family: ClassVar[str]
    final_norm: ClassVar[str]
    # What "frozen" means in frozen-scale DLA for this family's graph (stated in every audit row).
    frozen_convention: ClassVar[str] = "final norm scale frozen at x_L"
    attention_kind: ClassVar[str]
    position_scheme: ClassVar[str]

    # Config token ids the adapter (or the model, through the adapter's inputs)
    # reads: (attribute path, required). Checked as integers before the weights
    # load, and against the embedding table and the processor after.
    token_id_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("image_token_id", False), ("video_token_id", False))

    def __init__(self, model: torch.nn.Module, processor: Any, tokenizer: Any, config: dict | None = None):
        """Raises ModelLoadError (one line, naming the field) for a model
        config, processor or prompt template the read-outs cannot run on."""
        if config is not None and not isinstance(config, dict):
            raise ModelLoadError(f"adapter config (vlm_readout): expected an object, got {type(config).__name__}")
        self.model = model
        self.processor = processor
        self.tokenizer = tokenizer
        self.config = config or {}
        model_config = getattr(model, "config", None)
        if model_config is not None:
            self.check_config(model_config)
            self._check_token_ids(model_config)
        self._check_prompt_renders()

    @classmethod
    def check_config(cls, config) -> None:
        """Raise a :class:`core.errors.ModelLoadError` (or its subclass
        :class:`core.errors.UnsupportedArchitectureError`) for a model config
        this adapter cannot read out exactly or whose fields it reads are
        malformed; called before the weights load and again when the adapter
        is built. Families extend it with the fields they read (call super)."""
        for path, required in cls.token_id_fields:
            config_int(config, path, required=required)

    def _check_token_ids(self, config) -> None:
        """Each token id of :attr:`token_id_fields` must index the embedding
        table, and an image / video token id must be the one the processor
        writes (else the model looks for the image where there is none)."""
        embedding = getattr(self.model, "get_input_embeddings", lambda: None)()
        try:  # the table's size, without the copy some families' input_embeddings() make
            rows = int(embedding.num_embeddings) if embedding is not None else int(self.input_embeddings().shape[0])
        except (AttributeError, NotImplementedError, TypeError):
            rows = None
        for path, _ in self.token_id_fields:
            value = config_value(config, path)
            if value is None:
                continue
            key = config_key(config, path)
            if rows is not None and not 0 <= int(value) < rows:
                raise ModelLoadError(f"config.json {key}: {value} is outside the model's {rows}-token embedding table")
            kind = path.rsplit(".", 1)[-1].removesuffix("_token_id")
            written = getattr(self.processor, f"{kind}_token", None)
            if kind not in ("image", "video") or not isinstance(written, str):
                continue
            written_id = self._vocab_id(written)
            if written_id is None:
                raise ModelLoadError(
                    f"the processor's {kind} token {written!r} is not in the tokenizer's vocabulary "
                    f"(config.json {key} is {value})"
                )
            if written_id != int(value):
                raise ModelLoadError(
                    f"config.json {key} is {value}, but the processor writes its {kind} token {written!r} as id "
                    f"{written_id}: the model would not find the {kind}"
                )

    def _vocab_id(self, token: str) -> int | None:
        """The id of a whole token string; None if the tokenizer has no such token."""
        convert = getattr(self.tokenizer, "convert_tokens_to_ids", None)
        if convert is not None:
            i = convert(token)
            unk = getattr(self.tokenizer, "unk_token_id", None)
            if i is None or (i == unk and token != getattr(self.tokenizer, "unk_token", None)):
                return None
            return int(i)
        encoder = getattr(self.tokenizer, "encoder", None)  # open_clip's SimpleTokenizer
        return encoder.get(token) if isinstance(encoder, dict) else None

    def _check_prompt_renders(self) -> None:
        """Render :data:`PROBE_QUESTION` once: the prompt must render, hold the
        question verbatim and, where the processor expands an image
        placeholder, hold exactly one."""
        field = self.prompt_field
        try:
            rendered = self.prompt(PROBE_QUESTION)
        except ReadoutError as e:
            raise ModelLoadError(str(e)) from None
        except Exception as e:  # a family's own rendering code: still one line, at load time
            raise ModelLoadError(f"{field}: cannot render the prompt ({type(e).__name__}: {e})") from None
        if not isinstance(rendered, str):
            raise ModelLoadError(f"{field}: renders {type(rendered).__name__}, not text")
        if PROBE_QUESTION not in rendered:
            raise ModelLoadError(
                f"{field}: the rendered prompt does not hold the question (rendered {rendered[:120]!r})"
            )
        image = getattr(self.processor, "image_token", None)
        if isinstance(image, str) and rendered.count(image) != 1:
            raise ModelLoadError(
                f"{field}: the rendered prompt holds {rendered.count(image)} image placeholders {image!r} "
                "for the one image of a question (expected 1)"
            )

    # ---- sizes
    @property
    @abstractmethod
    def n_layers(self) -> int: ...

    @property
    @abstractmethod
    def n_heads(self) -> int: ...

    @property
    @abstractmethod
    def d_model(self) -> int: ...

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- text
    @property
    def prompt_field(self) -> str:
        """The name of what :meth:`prompt` renders from, for error messages."""
        return "vlm_readout.prompt"

    def prompt(self, question: str) -> str:
        """The text the model is run on for ``question``; default: the adapter
        config's ``prompt`` template (``"{question}"`` when it has none).
        QuestionError naming :attr:`prompt_field` if it does not render."""
        template = self.config.get("prompt", "{question}")
        if not isinstance(template, str):
            raise QuestionError(f"{self.prompt_field}: expected a string, got {type(template).__name__}")
        try:
            return template.format(question=question)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise QuestionError(
                f"{self.prompt_field}: cannot render {template!r} ({type(e).__name__}: {e}); "
                "the only field is {question}"
            ) from None

    def text_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` alone (no BOS / EOS added)."""
        tok = self.tokenizer
        if hasattr(tok, "get_vocab"):  # a Hugging Face tokenizer
            return [int(i) for i in tok.encode(text, add_special_tokens=False)]
        return [int(i) for i in tok.encode(text)]  # open_clip's SimpleTokenizer adds nothing

    @cached_property
    def markup(self) -> PromptMarkup:
        """This model's :class:`PromptMarkup`, derived from its tokenizer,
        processor, config and rendered prompt (no hard-coded list): the
        tokenizer's special tokens (bos, eos, pad, unk, sep, cls, mask, the
        additional ones) and every added token it marks special; the
        processor's ``*_token`` / ``*_tag`` strings (image, video, tile and
        turn markers); every added token the rendered prompt holds (chat
        markup); the config's image / video tokens; and :meth:`extra_markup`.
        Strings that are not markup-shaped (:func:`is_markup`) are left out."""
        tok = self.tokenizer
        strings = set(getattr(tok, "all_special_tokens", None) or [])
        added = getattr(tok, "added_tokens_decoder", None) or {}
        strings.update(str(t) for t in added.values() if getattr(t, "special", False))
        decoder = getattr(tok, "decoder", None)
        if isinstance(decoder, dict):  # open_clip's SimpleTokenizer: <start_of_text>, <end_of_text>
            strings.update(decoder[i] for i in getattr(tok, "all_special_ids", []) if i in decoder)
        placeholders: dict[str, str] = {}
        for name, value in getattr(self.processor, "__dict__", {}).items():
            if isinstance(value, str) and name.endswith(("_token", "_tag")):
                kind = name.removesuffix("_token")
                if kind in ("image", "video", "audio"):
                    placeholders[value] = kind
                else:
                    strings.add(value)
        model_config = getattr(self.model, "config", None)
        for kind in ("image", "video"):
            i = getattr(model_config, f"{kind}_token_id", None) if model_config is not None else None
            if isinstance(i, int) and hasattr(tok, "convert_ids_to_tokens"):
                token = tok.convert_ids_to_tokens(i)
                if isinstance(token, str):
                    placeholders.setdefault(token, kind)
        try:  # chat markup: the added tokens the prompt around a question is made of
            strings.update(str(added[i]) for i in self.text_ids(self.prompt(PROBE_QUESTION)) if i in added)
        except ReadoutError:
            pass  # a prompt that does not render was refused when the adapter was built
        strings.update(self.extra_markup())
        placeholders = {s: k for s, k in placeholders.items() if is_markup(s)}
        special = tuple(sorted(s for s in strings if is_markup(s) and s not in placeholders))
        unk = getattr(tok, "unk_token_id", None)
        ids = {}
        for s in (*special, *placeholders):
            i = self._vocab_id(s)
            if i is not None and i != unk:
                ids[i] = s
        return PromptMarkup(placeholders, special, ids)

    def extra_markup(self) -> list[str]:
        """Family-specific control strings the generic derivation cannot see (default none)."""
        return []

    def check_question(self, question: str, *, raw_prompt: bool = False) -> None:
        """Raise :class:`core.errors.QuestionError` (one line) for a question the
        model cannot be run on as asked. One check for every family:

        * not a ``str``, or not encodable as UTF-8 (lone surrogates);
        * empty;
        * an image / video placeholder the processor would expand (always);
        * any other special or control token of this model (see :attr:`markup`):
          the tokenizer splits it out of the text and the model reads it as
          markup; allowed only with ``raw_prompt=True``;
        * words the vocabulary does not have (the tokenizer's unk token);
        * then :meth:`check_fits` (the family's length limit).

        Special tokens are found as substrings of the question (tokenizers
        match them before any other splitting) and as ids in its encoding
        (text a normaliser turns into one)."""
        check_text(question)
        if not question.strip():
            raise QuestionError("the question is empty")
        ids = self.text_ids(question)
        self.check_markup(question, ids, raw_prompt=raw_prompt)
        self._check_known_words(question, ids, raw_prompt)
        self.check_fits(question, ids)

    def check_markup(self, question: str, ids: list[int] | None = None, *, raw_prompt: bool = False) -> None:
        """QuestionError naming the first image / video placeholder (always) or
        other special token (unless ``raw_prompt``) of :attr:`markup` that
        ``question`` holds, as a substring or, in ``ids`` (its encoding,
        computed if None), as a token id."""
        markup = self.markup
        ids = self.text_ids(question) if ids is None else ids
        found = [s for s in markup.placeholders if s in question]
        found += [markup.ids[i] for i in ids if markup.ids.get(i) in markup.placeholders]
        if found:
            token = _first_named(question, found)
            kind = markup.placeholders[token]
            raise QuestionError(
                f"the question may not contain the {kind} placeholder {token!r} ({kind} markup: the processor "
                f"would expand it into {kind} tokens, and a question comes with one image; refused in raw "
                "prompts too)"
            )
        if raw_prompt:
            return
        found = [s for s in markup.special if s in question] + [markup.ids[i] for i in ids if i in markup.ids]
        if found:
            raise QuestionError(
                f"the question contains the special token {_first_named(question, found)!r} (the model would "
                "read it as markup); pass raw prompts explicitly (raw_prompt=True, --raw-prompt) to allow it"
            )

    def _check_known_words(self, question: str, ids: list[int], raw_prompt: bool) -> None:
        """QuestionError naming the words the tokenizer maps to its unk token.
        The unk token's own string is no unknown word where the question may
        hold it: typed on purpose in a raw prompt, or a plain word (an unk
        token spelled ``unk``), which that tokenizer always reads so."""
        tok = self.tokenizer
        unk = getattr(tok, "unk_token_id", None)
        if unk is None or unk not in ids or not hasattr(tok, "get_vocab"):
            return
        unk_token = getattr(tok, "unk_token", None)
        text = question
        if isinstance(unk_token, str) and unk_token and (raw_prompt or not is_markup(unk_token)):
            typed = re.compile(rf"(?<!\w){re.escape(unk_token)}(?!\w)")
            if ids.count(unk) <= len(typed.findall(question)):
                return
            text = typed.sub(" ", question)
        from core.models.words import unknown_words

        words = [
            w if w.isprintable() else repr(w) for w in unknown_words(tok, text)
        ]  # control characters shown escaped
        raise QuestionError(f"the question uses words this model's vocabulary does not have: {', '.join(words) or '?'}")

    def check_fits(self, question: str, ids: list[int]) -> None:
        """Raise QuestionError if the prompt for ``question`` (``ids``: its own
        tokens) cannot fit the model; default: no limit."""
        return None

    def checked_batch(self, images, questions, raw_prompt: bool = False) -> tuple[list[Image.Image], list[str]]:
        """``(images as RGB PIL images, rendered prompts)`` for a batch, after
        :meth:`check_question` on every question and :meth:`check_resize` on
        every image; what each family's :meth:`prepare` starts from."""
        from core.images import load_image

        images, questions = list(images), list(questions)
        check_pairs(images, questions)
        if not questions:
            raise QuestionError("no questions given")
        for q in questions:
            self.check_question(q, raw_prompt=raw_prompt)
        loaded = [load_image(im) for im in images]
        for im in loaded:
            self.check_resize(im.size)
        return loaded, [self.prompt(q) for q in questions]

    def _image_size_setting(self, key: str) -> int | None:
        """``image_processor.size[key]`` (None when the processor has no such
        setting); ModelLoadError naming the field unless a positive integer."""
        size = getattr(getattr(self.processor, "image_processor", None), "size", None)
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(
                f"processor config image_processor.size.{key}: expected a positive integer, got {value!r}"
            )
        return value

    def resized_pixels(self, image_size: tuple[int, int]) -> tuple[int, str] | None:
        """``(pixels, the setting that decides them)`` of the image the
        processor's resize makes of one of ``image_size = (width, height)``;
        None when it does not resize or the family's processor reads its size
        settings another way (then the family overrides this).

        Default: the CLIP-style settings of transformers' image processors: a
        fixed ``height`` x ``width``, or the shortest edge scaled to
        ``shortest_edge`` (capped by ``longest_edge``), or the longest edge to
        ``longest_edge``. The shortest-edge resize is the one an elongated image
        amplifies: a 1 x 200 image at shortest_edge 336 becomes 336 x 67,200."""
        processor = getattr(self.processor, "image_processor", None)
        if processor is None or not getattr(processor, "do_resize", True):
            return None
        w, h = image_size
        height, width = self._image_size_setting("height"), self._image_size_setting("width")
        if height and width:
            return height * width, f"size.height x size.width = {height} x {width}"
        shortest, longest = self._image_size_setting("shortest_edge"), self._image_size_setting("longest_edge")
        if shortest:
            scale = shortest / min(w, h)
            if longest:
                scale = min(scale, longest / max(w, h))
            return round(w * scale) * round(h * scale), f"size.shortest_edge = {shortest}"
        if longest:
            scale = longest / max(w, h)
            return round(w * scale) * round(h * scale), f"size.longest_edge = {longest}"
        return None

    def check_resize(self, image_size: tuple[int, int]) -> None:
        """ImageLoadError if the processor would resize an image of
        ``image_size`` past the pixel budget of :data:`core.images.MAX_PIXELS`
        (a processor config can ask for any size; decoding is bounded, the
        resize must be too)."""
        from core.errors import ImageLoadError
        from core.images import MAX_PIXELS

        estimate = self.resized_pixels(image_size)
        if estimate is not None and estimate[0] > MAX_PIXELS:
            pixels, setting = estimate
            raise ImageLoadError(
                f"this model's processor would resize the {image_size[0]}x{image_size[1]} image to about "
                f"{pixels:,} pixels ({setting}), over the {MAX_PIXELS:,}-pixel limit"
            )

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)]).strip()

    def token_id(self, token: str) -> int:
        """Id of a one-token answer string; QuestionError if it is not valid
        text, not one token, or a word the vocabulary does not have."""
        check_text(token, "answer token")
        ids = self.text_ids(token)
        if len(ids) != 1:
            raise QuestionError(f"{token!r} is not a single token for this model ({len(ids)} tokens)")
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if ids[0] == unk and token.strip() != getattr(self.tokenizer, "unk_token", None):
            raise QuestionError(f"{token!r} is not in this model's vocabulary (it would read as the unknown token)")
        return int(ids[0])

    # ---- running
    @abstractmethod
    def prepare(self, images: list[Image.Image], questions: list[str], *, raw_prompt: bool = False) -> ModelInputs:
        """Process images (PIL images, paths or uint8 arrays) and questions
        into one right-padded batch; every question goes through
        :meth:`check_question` (``raw_prompt``: allow special tokens)."""

    @abstractmethod
    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Full logits ``(batch, pos, vocab)`` of the text stream."""

    @abstractmethod
    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        """The same batch (of one) with ``token_id`` appended after the answer position."""

    def next_token_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits at the answer position, ``(batch, vocab)``."""
        logits = self.forward_logits(inputs)
        return logits[torch.arange(logits.shape[0], device=logits.device), inputs.answer_positions]

    # ---- canonical weights (TransformerLens names; per query head, grouped K/V mapped)
    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def kv_group(self, head: int) -> int:
        """The key/value head that query head ``head`` reads (grouped-query attention)."""
        return head // (self.n_heads // self.n_kv_heads)

    def W_Q(self, layer: int) -> torch.Tensor:
        """``(heads, d_model, d_head)``: q = Norm(r) @ W_Q[h] + b_Q[h] (before RoPE)."""
        raise NotImplementedError(f"{self.family}: W_Q not mapped yet")

    def b_Q(self, layer: int) -> torch.Tensor:
        """``(heads, d_head)``."""
        raise NotImplementedError(f"{self.family}: b_Q not mapped yet")

    def W_K(self, layer: int) -> torch.Tensor:
        """``(heads, d_model, d_head)``, each query head's key map (groups expanded)."""
        raise NotImplementedError(f"{self.family}: W_K not mapped yet")

    def b_K(self, layer: int) -> torch.Tensor:
        raise NotImplementedError(f"{self.family}: b_K not mapped yet")

    def W_V(self, layer: int) -> torch.Tensor:
        """``(heads, d_model, d_head)``, each query head's value map (groups expanded)."""
        raise NotImplementedError(f"{self.family}: W_V not mapped yet")

    def b_V(self, layer: int) -> torch.Tensor:
        raise NotImplementedError(f"{self.family}: b_V not mapped yet")

    def W_O(self, layer: int) -> torch.Tensor:
        """``(heads, d_head, d_model)``: head output = z[h] @ W_O[h]."""
        raise NotImplementedError(f"{self.family}: W_O not mapped yet")

    def b_O(self, layer: int) -> torch.Tensor:
        """``(d_model,)`` the output projection's bias (zeros if none)."""
        raise NotImplementedError(f"{self.family}: b_O not mapped yet")

    def attn_norm(self, layer: int):
        """The :class:`core.models.norms.Norm` in front of layer ``layer``'s attention."""
        raise NotImplementedError(f"{self.family}: attn_norm not mapped yet")

    def final_norm_layer(self):
        """The :class:`core.models.norms.Norm` in front of the unembedding."""
        raise NotImplementedError(f"{self.family}: final norm not mapped yet")

    @property
    def W_U(self) -> torch.Tensor:
        """``(d_model, vocab)``."""
        raise NotImplementedError(f"{self.family}: W_U not mapped yet")

    @property
    def b_U(self) -> torch.Tensor:
        """``(vocab,)`` (zeros if the unembedding has no bias)."""
        raise NotImplementedError(f"{self.family}: b_U not mapped yet")

    # ---- capture and geometry (see core/capture.py and core/geometry.py)
    @property
    def blocks(self) -> list[tuple[str, str]]:
        """``[(name, kind)]`` of the blocks a Trace is cut into; kind is "self"
        or "cross". Self-attention decoders: one block per layer."""
        return [(f"L{layer}", "self") for layer in range(self.n_layers)]

    def kv_norm(self, block: int):
        """The norm applied to the stream keys and values read (self-attention: ``attn_norm``)."""
        return self.attn_norm(block)

    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        """Fill ``trace`` with one forward; default: hooks around the library's forward."""
        from core.capture import run_with_hooks

        run_with_hooks(self, inputs, trace, keep)

    def visual_positions(self, inputs: ModelInputs) -> torch.Tensor:
        """``(batch, n_visual)`` sequence positions of the visual tokens."""
        raise NotImplementedError(f"{self.family}: visual positions not mapped yet")

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """``[(module, kind, fn)]`` hooks filling ``trace`` for block ``layer``:
        ``resid_pre``, ``z`` (the output projection's input as (batch, pos, heads,
        d_head)), ``attn_out``, ``mlp_out`` and, if ``keep_pattern``, the
        patterns of ``trace.query_positions``. Kinds as in :func:`core.capture.hooks`."""
        raise NotImplementedError(f"{self.family}: capture not mapped yet")

    def final_hooks(self, trace) -> list:
        """Hooks that record ``trace.final_resid`` (the final norm's input)."""
        raise NotImplementedError(f"{self.family}: capture not mapped yet")

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply the position scheme to queries or keys ``(pos, heads, d_head)``.

        ``positions`` is in the scheme's own format: ``(pos,)`` for RoPE,
        ``(3, pos)`` (temporal, height, width) for M-RoPE."""
        raise NotImplementedError(f"{self.family}: positions not mapped yet")

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """:class:`core.geometry.VisualToken` per visual token, boxes in the original image."""
        raise NotImplementedError(f"{self.family}: geometry not mapped yet")

    # ---- the residual graph (docs/METHODS.md §4.7: the split follows the actual graph)
    def component_stack(self, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
        """Names and ``(n_components, d_model)`` vectors that sum to x_L at
        ``position``. Pre-norm default: x_L = x_0 + sum_l (sum_h W_O^h z^h + b_O) + sum_l m_l;
        a post-norm family (BLIP) propagates each addend through the frozen norms after it."""
        names = ["embed"]
        vecs = [trace.resid_pre[0][batch, position]]
        for block, block_name in enumerate(trace.block_names):
            heads = trace.head_output(self, block, position, batch)  # (heads, d_model)
            names += [f"{block_name}.H{h}" for h in range(heads.shape[0])]
            vecs += list(heads)
            b_O = self.b_O(block)
            if torch.any(b_O != 0):
                names.append(f"bias.{block_name}.attn_out")
                vecs.append(b_O.to(heads.dtype))
            names.append(f"{block_name}.mlp")
            vecs.append(trace.mlp_out[block][batch, position])
        return names, torch.stack(vecs)

    def readout_pullback(self, trace, block: int, position: int, g: torch.Tensor, batch: int = 0) -> torch.Tensor:
        """Directions ``g (..., d_model)`` on x_L mapped back to block ``block``'s
        attention-output space, so ``g' . c`` reads a raw head write as it
        reaches x_L. Pre-norm: the identity (every write is added to x_L as is)."""
        return g

    # ---- the modules hooks and interventions reach (hook-based families)
    def attention_module(self, block: int) -> torch.nn.Module:
        """Block ``block``'s attention module (its eager call is where q/k are recorded)."""
        raise NotImplementedError(f"{self.family}: attention modules not mapped")

    def z_module(self, block: int) -> torch.nn.Module:
        """The output projection whose input is ``z`` ``(batch, pos, heads * d_head)``."""
        raise NotImplementedError(f"{self.family}: output projections not mapped")

    def mlp_module(self, block: int) -> torch.nn.Module:
        """Block ``block``'s MLP (its output is ``mlp_out``)."""
        raise NotImplementedError(f"{self.family}: MLPs not mapped")

    def layer_module(self, block: int) -> torch.nn.Module:
        """Block ``block``'s layer, whose first input is the residual entering it (``resid_pre``)."""
        raise NotImplementedError(f"{self.family}: layers not mapped")

    def visual_site_module(self, site: str) -> tuple[torch.nn.Module, str]:
        """``(module, "pre" | "fwd")``: the module whose first input ("pre") or
        output ("fwd") is the visual-feature site ``site`` ("vision_out",
        "projector_out") ``(batch, n_visual, width)``."""
        from core.errors import InterventionError

        raise InterventionError(f"{self.family}: no {site!r} site (edit sites: {', '.join(self.edit_sites)})")

    # The edit sites (core.edits.SITES) this family applies; others are refused.
    edit_sites: ClassVar[tuple[str, ...]] = ("z", "mlp")

    def check_edits(self, edits) -> None:
        """Raise :class:`core.errors.InterventionError` for an edit this family
        cannot apply (a site it does not have, a block out of range)."""
        from core.errors import InterventionError

        n = len(self.blocks)
        for e in edits:
            if e.site not in self.edit_sites:
                raise InterventionError(
                    f"{self.family}: no {e.site!r} edit site (this family has: {', '.join(self.edit_sites)})"
                )
            if e.block is not None and not 0 <= e.block < n:
                raise InterventionError(f"{e.describe()}: block out of range (the model has {n} blocks)")

    def edit_hooks(self, edits) -> list:
        """``[(module, kind, fn)]`` applying :class:`core.edits.Edit` s: a
        pre-hook on the output projection changes a head's ``z`` slice (so the
        head's write ``W_O^h z^h`` changes and ``b_O`` stays), a forward hook
        changes the MLP output, a pre-hook on a layer changes the residual
        entering it, hooks on :meth:`visual_site_module` change visual features,
        and a pre-hook on the attention module adds ``-inf`` to the knocked-out
        entries of the additive attention mask it is called with (so only the
        chosen block's softmax sees them, and its other weights renormalise)."""
        self.check_edits(edits)
        regs = []
        for e in edits:
            if e.site == "mlp":

                def mlp(module, args, out, e=e):
                    return e.apply(out)

                regs.append((self.mlp_module(e.block), "fwd", mlp))
            elif e.site == "z":

                def z(module, args, e=e):
                    return (e.apply(args[0], self.d_head), *args[1:])

                regs.append((self.z_module(e.block), "pre", z))
            elif e.site == "resid":

                def resid(module, args, kwargs, e=e):
                    if args:
                        return (e.apply(args[0]), *args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": e.apply(kwargs["hidden_states"])}

                regs.append((self.layer_module(e.block), "pre_kw", resid))
            elif e.site == "knockout":
                regs.append((self.attention_module(e.block), "pre_kw", self._knockout_hook(e)))
            else:  # visual feature sites
                module, kind = self.visual_site_module(e.site)
                if kind == "pre":

                    def pre(module, args, e=e):
                        return (e.apply(args[0]), *args[1:])

                    regs.append((module, "pre", pre))
                else:

                    def fwd(module, args, out, e=e):
                        return e.apply(out)

                    regs.append((module, "fwd", fwd))
        return regs

    def _knockout_hook(self, e):
        """A pre-hook (with kwargs) on an attention module that knocks edges out
        of the additive mask ``(batch, 1 | heads, q, k)`` it is called with."""
        from core.errors import InterventionError

        def knock(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            if mask is None:
                raise InterventionError(
                    f"{self.family}: cannot knock out edges, the attention is called without a mask"
                )
            if mask.dtype == torch.bool:  # True = may attend
                additive = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
                mask = additive.masked_fill(~mask, float("-inf"))
            b, _, q, k = mask.shape
            mask = e.knock(mask.expand(b, self.n_heads, q, k))
            return args, {**kwargs, "attention_mask": mask}

        return knock

    def site_record_hooks(self, site: str, store: dict) -> list:
        """``[(module, kind, fn)]`` that store the visual-feature site's tensor
        ``(batch, n_visual, width)`` in ``store[site]`` (what the module computed,
        before any edit at that site)."""
        module, kind = self.visual_site_module(site)
        if kind == "pre":

            def pre(module, args):
                store[site] = args[0]

            return [(module, "pre", pre)]

        def fwd(module, args, out):
            store[site] = out

        return [(module, "fwd", fwd)]

    def qk_record_hooks(self, trace, blocks: set[int]) -> list | None:
        """Hooks recording ``trace.q`` / ``trace.k`` / ``trace.score_scale`` for
        families whose attention does not go through transformers' eager
        function; None: the eager function is wrapped (see core.capture.record_qk)."""
        return None

    def score_scale(self, block: int) -> float:
        """The factor ``q . k`` is multiplied by before the softmax."""
        return self.d_head**-0.5

    def score_transform(self, block: int, scores: torch.Tensor) -> torch.Tensor:
        """Whatever the model does to scaled scores before the mask (identity;
        Gemma 2's soft-capping overrides it)."""
        return scores

    def qk_gain(self, block: int) -> torch.Tensor | None:
        """``(d_head,)`` the product of per-head q and k norm gains, for families
        that normalise q and k per head (None: no such norms)."""
        return None

    def input_embeddings(self) -> torch.Tensor:
        """``(vocab, d_model)`` token embeddings as the first block receives
        them (families that scale embeddings include the scale)."""
        return self.model.get_input_embeddings().weight

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(pos, heads, d_head)`` for every sequence position and keys
        ``(keys, heads, d_head)`` (one per query head, groups expanded) recomputed
        from the captured residual and the canonical weights: norm, W_Q / W_K,
        bias, then the position scheme (RoPE / M-RoPE) for self-attention.
        Families with extra q/k transforms (q/k norms) override this."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        source = trace.kv_source[block]
        kv = x if source is None else self.kv_norm(block)(source[batch])
        q = torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)) + self.b_Q(block).to(x.dtype)
        k = torch.einsum("pm,hmd->phd", kv, self.W_K(block).to(x.dtype)) + self.b_K(block).to(x.dtype)
        if self.position_scheme in ("rope", "mrope") and source is None:
            positions = self.rope_positions(trace, batch)
            q, k = self.rotate(q, positions), self.rotate(k, positions)
        return q, k

    # ---- roles, masks and positions the read-outs need (overridden where a family differs)
    def rope_positions(self, trace, batch: int = 0) -> torch.Tensor:
        """The positions :meth:`rotate` takes for every sequence position of one
        batch row: ``(pos,)`` sequence indices by default; M-RoPE families return
        ``(3, pos)`` from ``trace.position_ids``."""
        if trace.position_ids is not None:
            p = trace.position_ids
            return p[:, batch] if p.ndim == 3 else p[batch]
        return torch.arange(trace.input_ids.shape[1])

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """``(pos, keys)`` bool: which keys each query may attend to in block
        ``block``. Self-attention default: causal, padding keys excluded;
        cross-attention: every visual token. A prefix-LM (PaliGemma) overrides."""
        n = trace.input_ids.shape[1]
        if trace.block_kinds[block] == "cross":
            n_keys = trace.kv_source[block].shape[1]
            return torch.ones(n, n_keys, dtype=torch.bool)
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        if trace.attention_mask is not None:
            allowed = allowed & trace.attention_mask[batch].bool().cpu().view(1, -1)
        return allowed

    def token_roles(self, trace, batch: int = 0) -> list[str]:
        """One role per sequence position: "sink" (position 0: BOS, or the first
        token, which serves as the attention sink in models without BOS), "visual",
        "visual_delimiter" (image start/end/newline/separator tokens), "special"
        (other special tokens: chat markup, EOS), "padding", or "text". Patterns
        report sink, delimiter and special mass separately, never inside entity
        averages; padding is never counted."""
        ids = trace.input_ids[batch].tolist()
        roles = ["text"] * len(ids)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        for i, t in enumerate(ids):
            if t in special:
                roles[i] = "special"
        for i in self.visual_delimiter_positions(trace, batch):
            roles[i] = "visual_delimiter"
        for i in trace.visual_positions[batch].tolist():
            roles[i] = "visual"
        if trace.attention_mask is not None:
            for i, m in enumerate(trace.attention_mask[batch].tolist()):
                if not m:
                    roles[i] = "padding"
        else:  # right-padded batches: nothing real follows the answer position
            for i in range(int(trace.answer_positions[batch]) + 1, len(ids)):
                roles[i] = "padding"
        if roles and roles[0] != "padding":
            roles[0] = "sink"
        return roles

    def cross_key_roles(self, trace, block: int, batch: int = 0) -> list[str]:
        """The role of each key of cross-attention block ``block``: "visual", or
        "visual_global" for a key that pools the whole image (BLIP's CLS)."""
        return ["visual"] * trace.kv_source[block].shape[1]

    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        """Sequence positions of tokens that frame or separate visual tokens but
        carry no patch (image start/end markers, row newlines); default none."""
        return []

    def describe(self) -> dict:
        return {
            "family": self.family,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "d_model": self.d_model,
            "final_norm": self.final_norm,
            "attention_kind": self.attention_kind,
            "position_scheme": self.position_scheme,
        }
