"""The adapter's text side: rendering a question into the model's prompt and
every check a question (and its image's resize) passes before the model runs.
One implementation for every family; families adjust it through
:meth:`QuestionChecks.extra_markup`, :meth:`QuestionChecks.check_fits`,
:meth:`QuestionChecks.prompt` and :meth:`QuestionChecks.resized_pixels`.
Mixed into :class:`core.models.adapter.Adapter`."""

from __future__ import annotations

import re
from functools import cached_property

from PIL import Image

from core.answer_text import MAX_TOKEN_CHARACTERS, shown_text, text_problem
from core.errors import ImageLoadError, ModelLoadError, QuestionError, ReadoutError
from core.files.images import MAX_PIXELS, load_image
from core.models.config_fields import size_value
from core.models.markup import PROBE_QUESTION, PromptMarkup, check_pairs, check_text, first_named, is_markup
from core.models.words import unknown_words


class QuestionChecks:
    """Prompt rendering and the question / image checks of one model
    (``self.tokenizer``, ``self.processor``, ``self.config``, ``self.model``)."""

    def vocab_id(self, token: str | None) -> int | None:
        """The id of a whole token string; None if the tokenizer has no such token."""
        if not token:
            return None
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
        for string, kind in self.extra_placeholders().items():
            placeholders.setdefault(string, kind)
        placeholders = {s: k for s, k in placeholders.items() if is_markup(s)}
        special = tuple(sorted(s for s in strings if is_markup(s) and s not in placeholders))
        unk = getattr(tok, "unk_token_id", None)
        ids = {}
        for s in (*special, *placeholders):
            i = self.vocab_id(s)
            if i is not None and i != unk:
                ids[i] = s
        return PromptMarkup(placeholders, special, ids)

    def extra_markup(self) -> list[str]:
        """Family-specific control strings the generic derivation cannot see (default none)."""
        return []

    def extra_placeholders(self) -> dict[str, str]:
        """``{string: "image" | "video"}``: family-specific tokens that stand for an
        image or a video where the generic derivation (the processor's and the
        config's placeholders) cannot see them; refused in every question, raw
        prompts too (default none)."""
        return {}

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
        self.check_known_words(question, ids, raw_prompt=raw_prompt)
        self.check_fits(question, ids)

    def check_markup(
        self, question: str, ids: list[int] | None = None, *, raw_prompt: bool = False, what: str | None = None
    ) -> None:
        """QuestionError naming the first image / video placeholder (always) or
        other special token (unless ``raw_prompt``) of :attr:`markup` that
        ``question`` holds, as a substring or, in ``ids`` (its encoding,
        computed if None), as a token id. ``what`` names other text than a
        question (an answer, a foil, a word: ``--foil '<s>'``), which no raw
        prompt lets hold markup: the message starts with it."""
        markup = self.markup
        ids = self.text_ids(question) if ids is None else ids
        found = [s for s in markup.placeholders if s in question]
        found += [markup.ids[i] for i in ids if markup.ids.get(i) in markup.placeholders]
        if found:
            token = first_named(question, found)
            kind = markup.placeholders[token]
            if what is not None:
                raise QuestionError(
                    f"{what} holds the {kind} placeholder {token!r} (markup that stands for the {kind}, not text)"
                )
            raise QuestionError(
                f"the question may not contain the {kind} placeholder {token!r} ({kind} markup: it stands for "
                f"the {kind} tokens, and a question comes with one image; refused in raw prompts too)"
            )
        if raw_prompt and what is None:
            return
        found = [s for s in markup.special if s in question] + [markup.ids[i] for i in ids if i in markup.ids]
        if found:
            token = first_named(question, found)
            if what is not None:
                raise QuestionError(
                    f"{what} holds the special token {token!r} (markup the model reads as a control, not text)"
                )
            raise QuestionError(
                f"the question contains the special token {token!r} (the model would "
                "read it as markup); pass raw prompts explicitly (raw_prompt=True, --raw-prompt) to allow it"
            )

    def check_known_words(
        self, question: str, ids: list[int] | None = None, *, raw_prompt: bool = False, what: str = "the question"
    ) -> None:
        """QuestionError naming the words the tokenizer maps to its unk token
        (``what``: what the message calls the text: a Target field's is no question).
        The unk token's own string is no unknown word where the question may
        hold it: typed on purpose in a raw prompt, or a plain word (an unk
        token spelled ``unk``), which that tokenizer always reads so."""
        tok = self.tokenizer
        ids = self.text_ids(question) if ids is None else ids
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
        words = [
            w if w.isprintable() else repr(w) for w in unknown_words(tok, text)
        ]  # control characters shown escaped
        raise QuestionError(f"{what} uses words this model's vocabulary does not have: {', '.join(words) or '?'}")

    def check_fits(self, question: str, ids: list[int]) -> None:
        """Raise QuestionError if the prompt for ``question`` (``ids``: its own
        tokens) cannot fit the model; default: no limit."""
        return None

    def checked_batch(self, images, questions, raw_prompt: bool = False) -> tuple[list[Image.Image], list[str]]:
        """``(images as RGB PIL images, rendered prompts)`` for a batch, after
        :meth:`check_question` on every question and :meth:`check_resize` on
        every image; what each family's :meth:`prepare` starts from."""

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
        value = size_value(getattr(getattr(self.processor, "image_processor", None), "size", None), key)
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
        ``image_size`` past the pixel budget of :data:`core.files.images.MAX_PIXELS`
        (a processor config can ask for any size; decoding is bounded, the
        resize must be too)."""

        estimate = self.resized_pixels(image_size)
        if estimate is not None and estimate[0] > MAX_PIXELS:
            pixels, setting = estimate
            raise ImageLoadError(
                f"this model's processor would resize the {image_size[0]}x{image_size[1]} image to about "
                f"{pixels:,} pixels ({setting}), over the {MAX_PIXELS:,}-pixel limit"
            )

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)]).strip()

    def as_token_id(self, token) -> int:
        """An answer or foil given as a token string (:meth:`token_id`) or as an
        id (an int inside the unembedding's vocabulary)."""
        if isinstance(token, str):
            return self.token_id(token)
        if isinstance(token, bool) or not hasattr(token, "__index__"):
            raise QuestionError(f"a token is a string or an id, got {type(token).__name__}")
        vocab = int(self.W_U.shape[-1])
        if not 0 <= int(token) < vocab:
            raise QuestionError(f"token id {int(token)} is outside the model's {vocab}-token vocabulary")
        return int(token)

    def token_id(self, token: str, what: str | None = None) -> int:
        """Id of a one-token answer string; QuestionError (one line, starting with
        ``what`` and the token, e.g. ``--foil '<image>'``, or with the token alone)
        if it is not valid text, empty or blank, markup (an image / video
        placeholder or another special token: the model's controls, not an
        answer it gives; text the tokenizer turns into one too), not one token,
        or a word the vocabulary does not have."""
        problem = text_problem(token)
        if problem is not None:
            raise QuestionError(f"{what or 'the answer token'} {problem}: an answer or foil is one token of text")
        label = f"{what} {shown_text(token)}" if what else shown_text(token)
        if len(token) > MAX_TOKEN_CHARACTERS:  # no token is this long: refused before it is tokenised
            raise QuestionError(
                f"{label} is not a single token for this model (over {MAX_TOKEN_CHARACTERS} characters)"
            )
        ids = self.text_ids(token)
        self.check_markup(token, ids, what=label)
        if len(ids) != 1:
            raise QuestionError(f"{label} is not a single token for this model ({len(ids)} tokens)")
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if ids[0] == unk and token.strip() != getattr(self.tokenizer, "unk_token", None):
            raise QuestionError(f"{label} is not in this model's vocabulary (it would read as the unknown token)")
        return int(ids[0])
