"""One head's non-unique attention on one input: from the loaded model, an image,
a question and a head name (and optionally a region mask) to the
:class:`NonuniqueResult` and the document ``vlm-readout nonunique`` writes (the
method's JSON with the head, the region rule, the model and the input). The
command and the app's Attention tab both call :func:`nonunique_of_input`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from core.errors import InterventionError
from core.methods.nonunique.problem import visual_token_keys
from core.methods.nonunique.results import LEVEL_NAMES, NonuniqueResult
from core.methods.nonunique.search import nonunique_attention

# the default source set's rule (the CLI's --region help states it too)
TOP_TOKENS_RULE = (
    "the fewest visual tokens, most attended first, that hold at least {share:g} of the head's attention "
    "on the image at the answer position (tokens without a patch of their own, e.g. newline or CLS, excluded)"
)


def region_keys(trace, block: int, head: int, tokens, mask=None, *, cover: float = 0.25, share: float = 0.5):
    """``(visual token ordinals, key indices, rule)`` of the set mass is moved off:
    the ``tokens`` (the image's :class:`core.forward.geometry.VisualToken` s) that ``mask``
    covers (:func:`core.forward.geometry.region_tokens` at ``cover``), or without a mask
    the fewest patch tokens, most attended first by ``head`` at the answer
    position, that hold ``share`` of its attention on them; a one-line error
    where the block has no visual keys or the mask covers none."""
    from core.forward.geometry import region_tokens

    cross = trace.block_kinds[block] == "cross"
    if not cross and trace.visual_positions[0].numel() == 0:
        readers = [b for b, kind in zip(trace.block_names, trace.block_kinds) if kind == "cross"]
        raise InterventionError(
            f"block {trace.block_names[block]} attends to no visual token (its keys are text): name a head of a "
            f"block that reads the image ({', '.join(readers) or 'none'})"
        )
    if mask is not None:
        ordinals = region_tokens(tokens, mask, cover)
        if not ordinals:
            raise InterventionError(f"the region covers no visual token by {cover:g} of its patch: paint a larger one")
        return ordinals, visual_token_keys(trace, block, ordinals), f"the visual tokens the mask covers by {cover:g}"
    # patch tokens, not row delimiters; a resampler's latents (no patch at all, Idefics2) are all candidates
    patches = [i for i, t in enumerate(tokens) if t.col >= 0] or list(range(len(tokens)))
    keys = visual_token_keys(trace, block, patches)
    qi = int((trace.query_positions == int(trace.answer_positions[0])).nonzero()[0])
    weights = trace.patterns[block][0, head, qi, keys].double().tolist()
    order = sorted(range(len(keys)), key=lambda i: (-weights[i], keys[i]))
    total, held, n = sum(weights), 0.0, 0
    if total == 0:  # a chunked or sliding-window layer whose answer row cannot reach the image
        raise InterventionError(
            f"head {trace.block_names[block]}.H{head} puts no attention on the image at the answer position (its "
            "mask hides every visual key there): no mass to move; name a head of a block that reads the image"
        )
    while n < len(order) and (n == 0 or held < share * total):
        held += weights[order[n]]
        n += 1
    chosen = sorted(order[:n])
    return [patches[i] for i in chosen], [keys[i] for i in chosen], TOP_TOKENS_RULE.format(share=share)


def nonunique_of_input(
    loaded,
    image,
    question: str,
    head_name: str,
    *,
    mask=None,
    mask_name: str | None = None,
    image_path: str | None = None,
    answer_text=None,
    raw_prompt: bool = False,
    cover: float = 0.25,
    share: float = 0.5,
    tol: float = 0.05,
    score_bounds: Sequence[float] = (1.0, 2.0),
    levels: Sequence[str] = tuple(LEVEL_NAMES),
    objective: str = "mass",
    min_moved: float = 0.05,
    space: str = "write",
    seed: int = 0,
    steps: int = 150,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> tuple[NonuniqueResult, dict]:
    """``(result, doc)`` of head ``head_name`` (``L1.H2``) at the answer position of
    ``image`` (a PIL image) and ``question``: the source set is what ``mask``
    (``(H, W)`` bool) covers by ``cover``, else the :data:`TOP_TOKENS_RULE` set
    holding ``share`` (:func:`region_keys`); every other keyword is
    :func:`core.methods.nonunique.solve`'s. The result carries the header the
    command writes (``component``, ``region``, ``model``, ``input``; ``mask_name`` and
    ``image_path`` say where the mask and the image came from); ``doc`` is its JSON.
    ``answer_text`` (:class:`core.answer_text.AnswerText`): read at one token of an
    answer, teacher forcing."""
    from core.files.images import image_sha256
    from core.forward.capture import capture
    from core.methods.component_ablation import parse_head

    adapter = loaded.adapter
    parsed = parse_head(head_name, adapter)
    block, head = parsed.block, parsed.head
    prefix = answer_text.prefix_ids if answer_text is not None else ()
    inputs = adapter.prepare([image], [question], raw_prompt=raw_prompt, answer_prefix=prefix)
    trace = capture(loaded, image, question, pattern_layers=[block], inputs=inputs)
    tokens = adapter.visual_tokens(image.size, trace.visual_positions[0].tolist() or None)
    ordinals, keys, rule = region_keys(trace, block, head, tokens, mask, cover=cover, share=share)
    result = nonunique_attention(
        adapter,
        trace,
        block,
        head,
        sources=keys,
        space=space,
        tol=tol,
        score_bounds=list(score_bounds),
        levels=tuple(levels),
        objective=objective,
        min_moved=min_moved,
        seed=seed,
        steps=steps,
        progress=progress,
        cancel=cancel,
    )
    region = {
        "rule": rule,
        "mask": mask_name if mask is not None else None,
        "cover": cover if mask is not None else None,
        "share": None if mask is not None else share,
        "visual_tokens": ordinals,
        "keys": keys,
    }
    result.component = head_name
    result.region = region
    result.model = {"spec": loaded.spec, "fingerprint": getattr(loaded, "fingerprint", None), **adapter.describe()}
    result.input = {
        "question": question,
        "image": None if image_path is None else str(image_path),
        "image_sha256": image_sha256(image),
        "image_size": list(image.size),
        "raw_prompt": bool(raw_prompt),
        **(answer_text.to_dict() if answer_text is not None else {}),
        **adapter.dtype_and_device(),
    }
    return result, result.to_dict()
