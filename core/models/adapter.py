"""The canonical view of a loaded model.

An :class:`Adapter` is the one place that knows a family's module paths and
input format. Methods never reach into a model's modules: they go through
the adapter. Each family subclasses it in ``core/models/families/<family>.py``
and registers itself in :mod:`core.models.registry`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from PIL import Image

from core.errors import ModelLoadError, QuestionError
from core.forward.capture import run_with_hooks
from core.models.canonical import CANONICAL, CANONICAL_NAMES, NotMapped
from core.models.config_fields import config_int, config_key, config_value, size_value
from core.models.declaration import SANDWICH_CONVENTION, Family
from core.models.decoding import Decoding, DecodingState
from core.models.edit_sites import EditSites
from core.models.forward_checks import check_finite_logits, model_input_errors
from core.models.inputs import ModelInputs
from core.models.markup import PROBE_QUESTION, PromptMarkup, check_pairs, check_text, is_markup
from core.models.question_checks import QuestionChecks
from core.shell.precision import dtype_name, placement

# Re-exported: the names families, methods and tests import from here.
__all__ = [
    "CANONICAL",
    "CANONICAL_NAMES",
    "PROBE_QUESTION",
    "Adapter",
    "DecodingState",
    "ModelInputs",
    "NotMapped",
    "PromptMarkup",
    "check_pairs",
    "check_text",
    "config_int",
    "config_key",
    "config_value",
    "is_markup",
    "size_value",
]


class Adapter(QuestionChecks, EditSites, Decoding, ABC):
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
    # Whether the language model's attention goes through transformers' attention
    # functions (sdpa, flash, eager), so a capture can record each call and recompute
    # pattern rows (core/forward/attention_rows.py); False: the family's own computation
    # yields the pattern (BLIP's inline softmax, CoCa's replay).
    attention_functions: ClassVar[bool] = True

    # Config token ids the adapter (or the model, through the adapter's inputs)
    # reads: (attribute path, required). Checked as integers before the weights
    # load, and against the embedding table and the processor after.
    token_id_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("image_token_id", False), ("video_token_id", False))

    # The architecture names this class serves, declared on the class itself (read by
    # core.models.registry; not inherited): config.architectures[0], or an open_clip
    # model class name.
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    open_clip_classes: ClassVar[tuple[str, ...]] = ()

    # The canonical names of CANONICAL this family defines (set for every subclass).
    capabilities: ClassVar[frozenset[str]] = frozenset()

    # How prepare() calls the processor: the images one list per prompt (processors
    # that read a flat list as one sample holding every image); the processor outputs
    # the forward must not get; the keyword arguments of the forward.
    images_per_prompt: ClassVar[bool] = False
    dropped_tensors: ClassVar[tuple[str, ...]] = ()
    forward_options: ClassVar[dict[str, Any]] = {}
    # Per-token tensors append_token extends beside input_ids / attention_mask, with the
    # value the new token gets (Qwen's mm_token_type_ids: 0, text).
    appended_token_types: ClassVar[dict[str, int]] = {"mm_token_type_ids": 0}

    # The family's declaration (core.models.declaration): a class with its own sets the
    # class attributes above from it (core.models.family_adapter.FamilyAdapter derives the rest).
    declaration: ClassVar[Family | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        d = vars(cls).get("declaration")
        if d is not None:
            cls.family = d.name
            cls.hf_architectures = d.architectures
            cls.open_clip_classes = d.open_clip_classes
            cls.fallback_prompt = d.prompt
            cls.final_norm = d.final_norm
            cls.attention_kind = d.attention
            cls.position_scheme = d.rotary.scheme
            cls.frozen_convention = d.frozen_convention or (
                SANDWICH_CONVENTION if d.decoder.form == "sandwich" else Adapter.frozen_convention
            )
            cls.edit_sites = (
                *d.edit_sites,
                *(("mixer",) if d.decoder.mixers else ()),
                *(("vision_out", "projector_out") if d.visual_sites else ()),
            )
        cls.capabilities = frozenset(name for name in CANONICAL_NAMES if hasattr(cls, name))

    def __getattr__(self, name: str):
        """The one refusal of a canonical name the family does not map (only
        called when normal lookup fails)."""
        if name in CANONICAL_NAMES and name not in type(self).capabilities:
            group = CANONICAL_NAMES[name]
            raise NotMapped(f"{self.family}: {name} not mapped ({group}; this adapter does not define it)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def maps(self, *names: str) -> bool:
        """Whether this family maps every one of the canonical ``names``."""
        return all(name in self.capabilities for name in names)

    def __init__(self, model: torch.nn.Module, processor: Any, tokenizer: Any, config: dict | None = None):
        """Raises ModelLoadError (one line, naming the field) for a model
        config, processor or prompt template the read-outs cannot run on."""
        if config is not None and not isinstance(config, dict):
            raise ModelLoadError(f"adapter config (vlm_readout): expected an object, got {type(config).__name__}")
        self.model = model
        self.processor = processor
        self.tokenizer = tokenizer
        self.config = config or {}
        self.spec = "the model"  # what the user named it (load_model sets it): the forward checks' messages name it
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
            written_id = self.vocab_id(written)
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

    # ---- what training and model cards need (they reach the model only through here)
    @property
    def parameters_dtype(self) -> torch.dtype:
        """The dtype of the model's weights."""
        return next(self.model.parameters()).dtype

    @property
    def model_config(self):
        """The library's config object of the model (None where it has none)."""
        return getattr(self.model, "config", None)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @contextmanager
    def frozen(self):
        """The model's parameters without gradients for the duration (restored after)."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        for p in trainable:
            p.requires_grad_(False)
        try:
            yield self
        finally:
            for p in trainable:
                p.requires_grad_(True)

    # ---- running (the Hugging Face default: the model's own processor, right padding)
    def prepare(
        self,
        images: list[Image.Image],
        questions: list[str],
        *,
        raw_prompt: bool = False,
        answer_prefix: Sequence[int] = (),
    ) -> ModelInputs:
        """Process images (PIL images, paths or uint8 arrays) and questions
        into one right-padded batch; every question goes through
        :meth:`check_question` (``raw_prompt``: allow special tokens). The
        tensors are the processor's (less :attr:`dropped_tensors`); the answer
        position is each row's last real token.

        ``answer_prefix``: answer token ids appended after every row's prompt
        (:attr:`core.answer_text.AnswerText.prefix_ids`: teacher forcing), so
        the answer position is the last of them and the read-out is the
        prediction of the next answer token. Empty: the bare prompt."""
        return self.append_tokens(self.prompt_inputs(images, questions, raw_prompt), answer_prefix)

    def prompt_inputs(self, images, questions: list[str], raw_prompt: bool = False) -> ModelInputs:
        """The batch of the bare prompts (what :meth:`prepare` appends an answer
        prefix to); families whose processor differs override this."""
        return self.batch_inputs(*self.processed_batch(images, questions, raw_prompt))

    def append_tokens(self, inputs: ModelInputs, token_ids: Sequence[int]) -> ModelInputs:
        """``inputs`` with ``token_ids`` appended after every row's answer
        position, one :meth:`append_token` at a time (so each family's own
        per-token tensors grow as in generation). Rows must end at their
        answer position (no padding after it): a padded batch of several
        rows is refused, since the tokens would land after the padding."""
        if not token_ids:
            return inputs
        if bool((inputs.answer_positions != inputs.input_ids.shape[1] - 1).any()):
            raise ValueError("append_tokens: a row is padded after its answer position (run the rows one at a time)")
        for token_id in token_ids:
            inputs = self.append_token(inputs, int(token_id))
        return inputs

    def processor_options(self, prompts: list[str]) -> dict:
        """Extra keyword arguments of the processor call (default none)."""
        return {}

    def processed_batch(
        self, images, questions: list[str], raw_prompt: bool = False
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Check the questions, render the prompts and run the processor with
        right padding (so each row's answer position is its last real token);
        the tokenizer's padding side is restored after. Tensors on the model's
        device, pixels in its dtype."""
        images, prompts = self.checked_batch(images, questions, raw_prompt)
        tok = self.processor.tokenizer
        old_side = tok.padding_side
        tok.padding_side = "right"
        try:
            batch = self.processor(
                images=[[im] for im in images] if self.images_per_prompt else images,
                text=prompts,
                padding=True,
                return_tensors="pt",
                **self.processor_options(prompts),
            )
        finally:
            tok.padding_side = old_side
        tensors = {
            k: v.to(self.device)
            for k, v in batch.items()
            if isinstance(v, torch.Tensor) and k not in self.dropped_tensors
        }
        if "pixel_values" in tensors:
            tensors["pixel_values"] = tensors["pixel_values"].to(self.parameters_dtype)
        return tensors, prompts

    def max_positions(self) -> int:
        """The decoder's position limit (10**9 when the family states none)."""
        return 10**9

    def batch_inputs(self, tensors: dict[str, torch.Tensor], prompts: list[str]) -> ModelInputs:
        """The :class:`ModelInputs` of a right-padded processed batch (answer
        position: each row's last real token), after checking that its longest
        row fits the decoder (visual token counts may follow the image size)."""
        mask = tensors["attention_mask"]
        longest = int(mask.sum(dim=1).max())
        if longest > self.max_positions():
            raise QuestionError(
                f"the question is too long: {longest} tokens with the image, the model takes {self.max_positions()}"
            )
        return ModelInputs(tensors, mask.sum(dim=1) - 1, tensors["input_ids"], prompts)

    def run_model(self, *args, **kwargs):
        """The model's forward, its own image-token / input-size check failing
        as one line (core/models/forward_checks.py): every forward of the
        engine goes through here."""
        with model_input_errors(self.spec):
            return self.model(*args, **kwargs)

    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Full logits ``(batch, pos, vocab)`` of the text stream."""
        return self.run_model(**inputs.tensors, **self.forward_options).logits

    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        """The same batch with ``token_id`` appended to every row after its
        answer position (rows unpadded: see :meth:`append_tokens`):
        ``input_ids``, ``attention_mask`` and the per-token tensors of
        :attr:`appended_token_types` grow by one."""
        t = dict(inputs.tensors)
        ids = t["input_ids"]
        new = torch.full((ids.shape[0], 1), int(token_id), device=ids.device, dtype=ids.dtype)
        t["input_ids"] = torch.cat([t["input_ids"], new], dim=1)
        t["attention_mask"] = torch.cat([t["attention_mask"], torch.ones_like(new)], dim=1)
        for key, value in self.appended_token_types.items():
            if key in t:
                t[key] = torch.cat([t[key], torch.full_like(new, value).to(t[key].dtype)], dim=1)
        return ModelInputs(t, inputs.answer_positions + 1, t["input_ids"], inputs.prompts)

    def next_token_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits at the answer position, ``(batch, vocab)``; non-finite ones
        are a :class:`~core.errors.NonFiniteError`, never a result."""
        logits = self.forward_logits(inputs)
        rows = logits[torch.arange(logits.shape[0], device=logits.device), inputs.answer_positions]
        self.check_logits(rows)
        return rows

    def check_logits(self, logits: torch.Tensor) -> None:
        """:class:`~core.errors.NonFiniteError` naming the model when a row of
        logits a result reads is NaN or Inf (core/models/forward_checks.py)."""
        check_finite_logits(self.spec, logits)

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

    # ---- capture and geometry (see core/forward/capture.py and core/forward/geometry.py)
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

        run_with_hooks(self, inputs, trace, keep)

    def visual_positions(self, inputs: ModelInputs) -> torch.Tensor:
        """``(batch, n_visual)`` sequence positions of the visual tokens: the
        config's image token's (a cross-attention family has none in the text
        sequence: ``(batch, 0)``).

        Raises:
            ValueError: the rows hold different numbers of visual tokens
                (images whose sizes give different counts), which no
                rectangular tensor holds.
        """
        ids = inputs.input_ids
        if self.attention_kind == "cross":
            return torch.zeros(ids.shape[0], 0, dtype=torch.long)
        rows = [row.nonzero().flatten() for row in ids == self.model.config.image_token_id]
        if len({len(r) for r in rows}) > 1:
            raise ValueError(
                "the batch rows hold different numbers of visual tokens "
                f"({[len(r) for r in rows]}): {self.family}'s token count follows the image size"
            )
        return torch.stack(rows)

    # ---- the residual graph (docs/METHODS.md §4.7: the split follows the actual graph)
    def component_stack(self, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
        """Names and ``(n_components, d_model)`` vectors that sum to x_L at
        ``position``. Pre-norm default: x_L = x_0 + sum_l (sum_h W_O^h z^h + b_O) + sum_l m_l;
        a post-norm family (BLIP) propagates each addend through the frozen norms after it."""
        names = ["embed"]
        vecs = [trace.resid_pre[0][batch, position]]
        for block, block_name in enumerate(trace.block_names):
            mixer = self.mixer(block)
            if mixer is not None:  # a token mixer without heads: its write is one component
                names.append(f"{block_name}.{mixer.module}")
                vecs.append(trace.mixer_out[block][batch, position])
            else:
                heads = trace.head_output(self, block, position, batch)  # (heads, d_model)
                names += [f"{block_name}.H{h}" for h in range(heads.shape[0])]
                vecs += list(heads)
                b_O = self.b_O(block)
                if torch.any(b_O != 0):
                    names.append(f"bias.{block_name}.attn_out")
                    vecs.append(b_O.to(heads.dtype))
            parts = self.mlp_components(trace, block, position, batch)
            names += [name for name, _ in parts]
            vecs += [v for _, v in parts]
        device = trace.final_resid.device  # blocks spread over devices meet where x_L is
        dtype = functools.reduce(torch.promote_types, (v.dtype for v in vecs))  # a residue is kept wider
        return names, torch.stack([v.to(device, dtype) for v in vecs])

    def mlp_components(self, trace, block: int, position: int, batch: int = 0) -> list[tuple[str, torch.Tensor]]:
        """``[(name, (d_model,))]``: block ``block``'s MLP write at ``position`` as
        components: ``L{l}.mlp`` whole; a mixture-of-experts family splits it into
        its experts (:meth:`core.models.family_adapter.FamilyAdapter.mlp_components`)."""
        return [(f"{trace.block_names[block]}.mlp", trace.mlp_out[block][batch, position])]

    # ---- blocks without attention (hybrid decoders, docs/METHODS.md §4.15.1)
    def mixer(self, block: int):
        """The :class:`core.models.declaration.Mixer` of a block whose token mixer is
        not attention (no heads, no pattern); None for an attention block."""
        return None

    # What multiplies a head's attention output before W_O, per query (None: nothing; Qwen3.5's
    # sigmoid gate): weight-level circuits are then of the ungated map and say so.
    head_output_gate: ClassVar[str | None] = None

    def output_gate(self, trace, block: int, batch: int = 0) -> torch.Tensor | None:
        """``(pos, heads, d_head)``: what each query position multiplies its heads'
        attention output by before the output projection (Qwen3.5's sigmoid gate), so
        head ``h``'s output at ``p`` is ``(gate[p, h] * sum_j A_pj v_j) W_O^h``; None: ungated."""
        return None

    def moe_experts(self, block: int) -> int:
        """How many routed experts block ``block``'s MLP has (0: a dense MLP)."""
        return 0

    def no_pattern(self, block: int) -> str:
        """The one line that refuses a per-head or pattern read-out of block ``block``."""
        from core.models.declaration import MIXER_KINDS

        name, kind = self.blocks[block]
        mixer = self.mixer(block)
        what = mixer.what if mixer is not None else kind
        return f"{name} has no attention pattern and no heads: {what} ({MIXER_KINDS.get(kind, kind)})"

    def stream_writes(self, trace) -> list[tuple[str, torch.Tensor]]:
        """``[(name, (batch, pos, d_model))]``: what the model adds to the residual
        stream beside its blocks' attention and MLP (Qwen3-VL's DeepStack features);
        none by default. Components of the decomposition, each one more rounding."""
        return []

    def readout_pullback(self, trace, block: int, position: int, g: torch.Tensor, batch: int = 0) -> torch.Tensor:
        """Directions ``g (..., d_model)`` on x_L mapped back to block ``block``'s
        attention-output space, so ``g' . c`` reads a raw head write as it
        reaches x_L. Pre-norm: the identity (every write is added to x_L as is)."""
        return g

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the model does to ``Norm_f(x) W_U + b_U`` before it returns its logits:
        nothing by default (a soft-capping family caps them, c tanh(logits / c))."""
        return logits

    def qk_record_hooks(self, trace, blocks: set[int]) -> list | None:
        """Hooks recording ``trace.q`` / ``trace.k`` / ``trace.score_scale`` for
        families whose attention does not go through transformers' attention
        functions; None: those functions are wrapped (core.forward.capture.record_attention)."""
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

    def query_extras(self, block: int) -> str | None:
        """What a query of block ``block`` passes between ``W_Q`` (+ ``b_Q``) and the
        rotation, in words; None where nothing does (``q = rotate(W_Q Norm(x) + b_Q)``,
        what a read-out inverting the query path needs). A family with its own
        :meth:`queries_keys` says what it adds."""
        return None if type(self).queries_keys is Adapter.queries_keys else f"{self.family}'s own query computation"

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
        window = self.sliding_window(block)
        if window is not None:  # transformers' sliding-window overlay: a query at i reads keys j > i - window
            positions = torch.arange(n)
            allowed = allowed & (positions.view(1, -1) > positions.view(-1, 1) - window)
        return allowed

    def sliding_window(self, block: int) -> int | None:
        """How far back a query of ``block`` reads (keys ``j > i - window``); None for
        full attention (the default; Llama-style decoders read the model's own setting)."""
        return None

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

    def dtype_and_device(self) -> dict:
        """``{"dtype", "device"}``: what the numbers were computed in (``"bfloat16"``; a
        bfloat16 run's numbers are not a float32 run's) and where the weights sit
        (``"cpu"``, ``"cuda:0"``, ``"cuda:0+cuda:1"``): every result's ``input`` and
        ``model`` blocks and every session run record them."""
        return {"dtype": dtype_name(self.parameters_dtype), "device": placement(self.model)}

    def describe(self) -> dict:
        return {
            "family": self.family,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "d_model": self.d_model,
            "final_norm": self.final_norm,
            "attention_kind": self.attention_kind,
            "position_scheme": self.position_scheme,
            **self.dtype_and_device(),
        }
