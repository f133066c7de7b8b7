"""Validate a functional label: the seven-step chain of docs/METHODS.md §4.11
on a stated claim, from a dataset to a verdict that names its distribution.

:func:`validate` is the library call behind ``vlm-readout validate`` and the
app's Validation panel: read the search set and the held-out set
(:func:`read_chain_data`), run the chain (:mod:`core.methods.validation`) on each
head or route named, or on the candidates it finds on the search set, and
return a :class:`Validation` (a Readout of kind ``validate``).

Where the inputs come from (``source``):

* ``scenes`` or ``scenes:SPLIT``: the synthetic shape scenes
  (:mod:`core.zoo.scenes`), drawn as the chain's own setting does
  (:func:`core.zoo.label_scenes.scene_samples`); their ground truth gives the
  target and the distractors, and step 4's swap is drawn from the scene.
* a pairs JSONL or a folder holding one (:func:`core.files.pairs.read_pairs`), each
  line with ``answer`` and ``foil``. The target and the distractors come from
  the line's masks: ``object_masks`` (or ``masks``) with the ``target`` index
  (distractors: ``distractors``, or every object but the target and the
  ``reference``), else ``target_mask`` and ``distractor_masks``, else the
  painted region given for every line without one (``region``). A line whose
  ``objects`` describe the shape scenes (colour, shape, centre, size,
  rotation, as ``core.zoo.dataset`` writes them) gets the scenes' swap; any
  other line may give its swap as ``"swap": {"image", "answer", "foil",
  "target_mask", "partner_mask"}``; without one step 4 is not tested. Lines
  of another ``kind`` than the claim's are step 7's other question kinds.

The held-out set must not be the search set: another scene split, another
file, or (without one) the seeded other half of the same file; an input
(image and question) in both is refused.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from core.errors import InputFileError, ReadoutError
from core.methods.validation import (
    RELATION,
    ChainCancelled,
    ChainContext,
    ChainSample,
    HeadRef,
    InputCondition,
    RegionObject,
    RouteRef,
    Subject,
    SwapScene,
    ValidationChain,
    find_candidates,
    find_routes,
    run_chain,
)
from core.methods.validation.power import power_refusal
from core.methods.validation.setting import REGION_MIN_COVER, relation_heads
from core.methods.validation.spec import ATTRIBUTE_MOVING, QUERY_WORDS, ClaimSpec
from core.methods.validation.spec import resolve as resolve_spec
from core.results.audit import AuditRecord
from core.results.readout import jsonable

SCHEMA_VERSION = 1
SCENES = "scenes"  # the source name of the synthetic shape scenes ("scenes" or "scenes:SPLIT")
CLAIM_KIND = "attribute"  # the question kind the chain's relation is about
QUERY_POSITION = QUERY_WORDS["answer"]  # the attribute relation's (a document written before specifications)


class ValidateError(ReadoutError):
    """A claim that cannot be checked as asked (bad subject, data, or held-out set)."""


# ------------------------------------------------------------------ the data


@dataclass
class ChainData:
    """One side of the chain's data: the claim's inputs, the other question
    kinds (step 7) and the condition they were drawn under."""

    samples: list
    condition: InputCondition
    side: dict[str, list] = field(default_factory=dict)
    digests: set = field(default_factory=set, repr=False)  # (image sha256, question) of each input

    @property
    def n(self) -> int:
        return len(self.samples)


def _digest(image: np.ndarray, question: str) -> tuple[str, str]:
    return hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest(), question


def swap_of(sample, seed: int = 0) -> SwapScene | None:
    """Step 4's counterfactual of one input: the dataset's own swap for a
    :class:`ChainSample`, the scenes' drawn swap for a scene."""
    if isinstance(sample, ChainSample):
        return sample.swap
    from core.zoo.label_scenes import swap_attribute

    return swap_attribute(sample, seed)


def _scene_data(loaded, split: str, n: int, n_side: int, min_distractors: int, reading: Reading) -> ChainData:
    from core.methods.validation import SIDE_KINDS
    from core.zoo import scenes
    from core.zoo.label_scenes import scene_samples

    if split not in scenes.SPLIT_SEEDS:
        raise ValidateError(f"{SCENES}:{split}: no such scene split; the splits are {', '.join(scenes.SPLIT_SEEDS)}")
    spec = reading.spec
    samples, condition = scene_samples(
        loaded, split, n, min_distractors=min_distractors, templates=spec.templates, target_tokens=spec.on_image
    )
    if spec.query == "repeat":  # the scenes' questions have no repeat: each image gets a seeded repeated sequence
        samples = [_with_question(s, _repeated_words(reading.words, reading.seed, s.index)) for s in samples]
        condition = replace(
            condition,
            kinds=("repeated-word",),
            templates=(REPEATED_SEQUENCE,),
            seeds={**condition.seeds, "sequence_seed": reading.seed, "sequence_words": len(reading.words)},
        )
    samples, left_out = reading.readable(loaded, samples, n)
    condition = reading.condition(condition, samples, left_out, split)
    side = {k: scene_samples(loaded, split, n_side, k)[0] for k in SIDE_KINDS} if n_side else {}
    return ChainData(samples, condition, side, {_digest(s.image, s.question) for s in samples})


REPEAT_WORDS = 5  # the distinct words of a generated repeated sequence
REPEATED_SEQUENCE = f"{REPEAT_WORDS} seeded words, then the first j of them again"  # its template, as described


def _repeated_words(words: Sequence[str], seed: int, index: int) -> str:
    """``w1 .. wk w1 .. wj`` (1 <= j < k), seeded by the input: its last word repeats the j-th,
    which was followed by the (j+1)-th (what an induction head attends to and copies)."""
    if len(words) < REPEAT_WORDS + 1:
        raise ValidateError(f"a repeated sequence needs {REPEAT_WORDS + 1} words of the model's; it has {len(words)}")
    rng = np.random.default_rng([seed, index, 3])
    chosen = [words[int(i)] for i in rng.choice(len(words), REPEAT_WORDS, replace=False)]
    j = int(rng.integers(1, REPEAT_WORDS))
    return " ".join(chosen + chosen[:j])


def _with_question(sample, question: str) -> ChainSample:
    """``sample``'s image (and regions) under another question, as a :class:`ChainSample`."""
    return ChainSample(
        sample.image,
        question,
        "",
        "",
        [RegionObject(o.mask, getattr(o, "source", "")) for o in sample.objects],
        sample.target,
        list(sample.distractors),
        kind=sample.kind,
        template=REPEATED_SEQUENCE,
        split=sample.split,
        index=sample.index,
        where=getattr(sample, "where", ""),
    )


@dataclass
class Reading:
    """How the chain reads each input: the claim's specification, the seed and the words a
    relation draws its foil and inserted words from; :meth:`readable` keeps the inputs the
    relation can be read on (:func:`core.methods.validation.relations.locate`)."""

    spec: ClaimSpec
    seed: int = 0
    words: tuple[str, ...] = ()
    # each kept input's Row, by the input object (the chain's context reads it again from here)
    located: dict = field(default_factory=dict, repr=False)

    def readable(self, loaded, samples, n: int) -> tuple[list, dict[str, int]]:
        """The first ``n`` of ``samples`` the relation reads (of its templates), and why others were left out."""
        from core.methods.validation.relations import Unreadable, locate, prepared

        out, left_out = [], {}
        for s in samples:
            if len(out) >= n:
                break
            if self.spec.templates and getattr(s, "template", "") not in self.spec.templates:
                left_out["another template"] = left_out.get("another template", 0) + 1
                continue
            try:
                row = locate(
                    loaded.adapter, self.spec, s, prepared(loaded.adapter, s), seed=self.seed, words=self.words
                )
            except Unreadable as e:
                left_out[str(e)] = left_out.get(str(e), 0) + 1
                continue
            self.located[id(s)] = row
            out.append(s)
        return out, left_out

    def condition(self, condition: InputCondition, samples, left_out: dict, where: str) -> InputCondition:
        """``condition`` of the inputs kept, with what the relation left out and its query."""
        if not samples:
            raise ValidateError(
                f"{where}: the relation {self.spec.name!r} reads none of its inputs ("
                + "; ".join(f"{v}: {k}" for k, v in left_out.items())
                + ")"
            )
        filters = {**condition.filters, **({"relation_left_out": left_out} if left_out else {})}
        seeds = dict(condition.seeds)
        for key in ("indices", "lines"):
            if key in seeds:
                seeds[key] = [s.index for s in samples]
        if self.spec.templates:
            filters["templates"] = list(self.spec.templates)
        return replace(
            condition,
            n_samples=len(samples),
            templates=tuple(sorted({s.template for s in samples if s.template})) or condition.templates,
            filters=filters,
            seeds=seeds,
            query=QUERY_WORDS[self.spec.query],
        )


def _masks(pair, names, size, key: str) -> list[RegionObject]:
    from core.files.pairs import load_pair_mask, resolve_beside

    if not isinstance(names, list) or not all(isinstance(x, str) and x for x in names):
        raise InputFileError(f'{pair.where}: "{key}" must be a list of mask file names')
    path = Path(pair.where.rsplit(":", 1)[0])
    return [
        RegionObject(load_pair_mask(pair, size, resolve_beside(path, name)), str(resolve_beside(path, name)))
        for name in names
    ]


def _index(row: dict, key: str, where: str, n: int) -> int | None:
    v = row.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
        raise InputFileError(f'{where}: "{key}" must be an object index 0..{n - 1}, got {v!r}')
    return v


def _regions(pair, row: dict, size, region: np.ndarray | None) -> tuple[list[RegionObject], int, list[int]]:
    """``(objects, target, distractors)`` of one claim line (see the module docstring)."""
    from core.files.pairs import load_pair_mask

    names = row.get("object_masks", row.get("masks"))
    if names is not None:
        objects = _masks(pair, names, size, "object_masks" if "object_masks" in row else "masks")
        target = _index(row, "target", pair.where, len(objects))
        if target is None:
            raise InputFileError(f'{pair.where}: the object masks need "target", the index of the target object')
        reference = _index(row, "reference", pair.where, len(objects))
        given = row.get("distractors")
        if given is not None:
            if not isinstance(given, list):
                raise InputFileError(f'{pair.where}: "distractors" must be a list of object indices')
            distractors = [_index({"d": d}, "d", pair.where, len(objects)) for d in given]
        else:
            distractors = [k for k in range(len(objects)) if k not in (target, reference)]
        return objects, target, [d for d in distractors if d != target]
    mask = load_pair_mask(pair, size)
    if mask is not None:
        target = [RegionObject(mask, str(pair.target_mask))]
    elif region is not None:
        if region.shape != (size[1], size[0]):
            raise InputFileError(
                f"{pair.where}: the painted region is {region.shape[1]}x{region.shape[0]}, the image "
                f"{size[0]}x{size[1]}; they must match"
            )
        target = [RegionObject(region, "painted region")]
    else:
        raise InputFileError(
            f"{pair.where}: no target region: give target_mask (or object_masks and target), or a painted region "
            "for the lines without one"
        )
    others = _masks(pair, row["distractor_masks"], size, "distractor_masks") if row.get("distractor_masks") else []
    return target + others, 0, list(range(1, 1 + len(others)))


def _swap_of_row(pair, row: dict, size) -> SwapScene | None:
    spec = row.get("swap")
    if spec is None:
        return None
    from core.files.pairs import Pair, load_pair_image, load_pair_mask, resolve_beside, text_field

    where = f"{pair.where} swap"
    if not isinstance(spec, dict):
        raise InputFileError(f'{where}: "swap" must be an object with image, answer, foil, target_mask, partner_mask')
    path = Path(pair.where.rsplit(":", 1)[0])
    fields = {k: text_field(spec, k, where) for k in ("image", "answer", "foil", "target_mask", "partner_mask")}
    other = Pair(pair.index, pair.line, where, fields["image"], resolve_beside(path, fields["image"]), pair.question)
    image = np.asarray(load_pair_image(other))
    if (image.shape[1], image.shape[0]) != tuple(size):
        raise InputFileError(f"{where}: the swapped image must have the original's size {size[0]}x{size[1]}")
    a, b = (load_pair_mask(pair, size, resolve_beside(path, fields[k])) for k in ("target_mask", "partner_mask"))
    return SwapScene(image, -1, fields["answer"], fields["foil"], a, b)


def _file_rows(loaded, source: str, kind: str, region, role: str, reading: Reading):
    """``(claim samples, {kind: side samples}, file)`` of every line of a pairs file, in file order
    (a relation of the sequence's own tokens reads no region: its lines need no mask)."""
    from core.files.pairs import load_pair_image, pairs_file, read_pairs
    from core.models.question_checks import QuestionError
    from core.zoo.label_scenes import scene_of_row

    path = pairs_file(source, "dataset file")
    a = loaded.adapter
    claim, side = [], {}
    for pair in read_pairs(path, what="dataset file"):
        row = pair.row or {}
        line_kind = pair.kind or kind
        # a copying claim's S is the source token against a foil word: its own lines need no answer
        if line_kind != kind or reading.spec.content != "copy":
            if pair.answer is None or pair.foil is None:
                raise InputFileError(f'{pair.where}: the chain needs "answer" and "foil" (S is their logit difference)')
            for word in (pair.answer, pair.foil):
                try:
                    a.token_id(word)
                except QuestionError as e:
                    raise InputFileError(f"{pair.where}: {e}") from None
        image = np.asarray(load_pair_image(pair))
        size = (image.shape[1], image.shape[0])
        common = dict(kind=line_kind, template=pair.template or "", split=role, index=pair.line, where=pair.where)
        if line_kind != kind or not reading.spec.on_image:
            bucket = side.setdefault(line_kind, []) if line_kind != kind else claim
            bucket.append(ChainSample(image, pair.question, pair.answer or "", pair.foil or "", **common))
            continue
        objects, target, distractors = _regions(pair, row, size, region)
        scene = scene_of_row(row, image, [o.mask for o in objects], target, pair.question, pair.answer, pair.foil)
        if scene is not None:
            scene.split, scene.index = role, pair.line
            claim.append(scene)
            continue
        swap = _swap_of_row(pair, row, size)
        claim.append(
            ChainSample(image, pair.question, pair.answer, pair.foil, objects, target, distractors, **common, swap=swap)
        )
    return claim, side, path


def _keep(loaded, samples, n: int, min_distractors: int, reading: Reading) -> tuple[list, dict, dict]:
    """The first ``n`` claim samples that pass the chain's filters and that the relation reads,
    what the filters skipped, and what the relation left out (why: how many)."""
    skipped = {}
    if reading.spec.on_image:
        enough = [s for s in samples if len(s.distractors) >= min_distractors]
        skipped["too_few_distractors"] = len(samples) - len(enough)
        samples = enough
    out, left_out = reading.readable(loaded, samples, n)
    return out, skipped, left_out


def _file_condition(
    path, role: str, samples, skipped: dict, min_distractors: int, kind: str, extra: dict, reading: Reading
):
    if not samples:
        raise ValidateError(
            f"{path}: no {kind} input of the {role} set passes the filters"
            + (
                f" (at least {min_distractors} distractor region(s), a target covering a visual token by "
                f"{REGION_MIN_COVER:g})"
                if reading.spec.on_image
                else f" of the relation {reading.spec.name!r}"
            )
            + "; skipped: "
            + ", ".join(f"{k} {v}" for k, v in skipped.items())
        )
    filters = (
        {"min_distractors": min_distractors, "target_tokens_min": 1, "region_min_cover": REGION_MIN_COVER}
        if reading.spec.on_image
        else {}
    )
    return InputCondition(
        str(path),
        role,
        len(samples),
        (kind,),
        tuple(sorted({s.template for s in samples if s.template})),
        filters,
        {"lines": [s.index for s in samples], "skipped": skipped, **extra},
        QUERY_POSITION,
    )


def _file_data(loaded, rows, role, path, n, n_side, min_distractors, kind, reading: Reading, extra=None) -> ChainData:
    claim, side = rows
    kept, skipped, left_out = _keep(loaded, claim, n, min_distractors, reading)
    condition = _file_condition(path, role, kept, {**skipped, **left_out}, min_distractors, kind, extra or {}, reading)
    condition = reading.condition(condition, kept, left_out, str(path))
    side = {k: v[:n_side] for k, v in sorted(side.items()) if n_side}
    return ChainData(kept, condition, side, {_digest(s.image, s.question) for s in kept})


def _halves(items: list, seed: int) -> tuple[list, list]:
    order = np.random.default_rng([seed, len(items)]).permutation(len(items))
    half = (len(items) + 1) // 2
    return [items[i] for i in sorted(order[:half])], [items[i] for i in sorted(order[half:])]


def _as_role(samples, role: str):
    for s in samples:
        s.split = role
    return samples


def read_chain_data(
    loaded,
    source: str,
    heldout: str | None = None,
    *,
    n: int = 150,
    n_side: int = 50,
    kind: str = CLAIM_KIND,
    region: np.ndarray | None = None,
    min_distractors: int = 1,
    seed: int = 0,
    reading: Reading | None = None,
) -> tuple[ChainData, ChainData]:
    """``(search, heldout)``: the chain's data from ``source`` and the held-out
    ``heldout`` (see the module docstring). Without ``heldout``, a scene split
    other than ``heldout`` is held out against the ``heldout`` split, and a
    file against the seeded other half of its own lines. ``n``: the first n
    inputs of each set that pass the filters and that the relation reads
    (``reading``: default the attribute relation's); ``n_side``: of each other kind."""
    reading = reading or Reading(ATTRIBUTE_MOVING, seed)

    def one(src: str, role: str) -> tuple[str, object]:
        if src == SCENES or src.startswith(SCENES + ":"):
            return "scenes", src.partition(":")[2] or ("val" if role == "search" else "heldout")
        return "file", _file_rows(loaded, src, kind, region, role, reading)

    if kind != CLAIM_KIND:
        raise ValidateError(f"the chain's relation is about {CLAIM_KIND} questions, not {kind!r}")
    what, got = one(source, "search")
    if heldout is None and what == "scenes" and got == "heldout":
        raise ValidateError(f"{source} is the held-out split itself: search on another split, or give --heldout")
    if heldout is None and what == "file":
        claim, side, path = got
        if len(claim) < 2:
            raise ValidateError(f"{path}: {len(claim)} {kind} line(s); halving the file for a held-out set needs 2")
        (cs, ch), sides = _halves(claim, seed), {k: _halves(v, seed) for k, v in side.items()}
        search, held = (
            _file_data(
                loaded,
                (_as_role(claim_half, role), {k: _as_role(v[i], role) for k, v in sides.items()}),
                role,
                path,
                n,
                n_side,
                min_distractors,
                kind,
                reading,
                {"halved_with_seed": seed},
            )
            for i, (claim_half, role) in enumerate(((cs, "search half"), (ch, "held-out half")))
        )
    else:
        search = (
            _scene_data(loaded, got, n, n_side, min_distractors, reading)
            if what == "scenes"
            else _file_data(loaded, got[:2], "search", got[2], n, n_side, min_distractors, kind, reading)
        )
        h_what, h_got = one(heldout or f"{SCENES}:heldout", "heldout")
        if h_what == "scenes":
            held = _scene_data(loaded, h_got, n, n_side, min_distractors, reading)
        else:
            if what == "file" and Path(h_got[2]).resolve() == Path(got[2]).resolve():
                raise ValidateError(f"{h_got[2]}: the held-out set is the search set's file; give another file")
            held = _file_data(loaded, h_got[:2], "heldout", h_got[2], n, n_side, min_distractors, kind, reading)
        if search.condition.split == held.condition.split and search.condition.dataset == held.condition.dataset:
            raise ValidateError(f"the held-out set is the search set ({search.condition.describe()})")
    both = search.digests & held.digests
    if both:
        raise ValidateError(
            f"{len(both)} held-out input(s) are also in the search set (same image and question): the evaluation "
            "must be held out"
        )
    return search, held


def source_files(dataset: str, heldout: str | None = None) -> dict:
    """What a session records of the sources that are files (a run's input, as an image is
    another run's): ``{"dataset", "dataset_sha256"[, "heldout", "heldout_sha256"]}``, the
    SHA-256 of each file's bytes now; a scene source records nothing here."""
    from core.session.records import dataset_sha256

    out = {}
    for key, source in (("dataset", dataset), ("heldout", heldout)):
        if source and Path(source).exists():
            out[key], out[f"{key}_sha256"] = str(source), dataset_sha256(source)
    return out


def relation_words() -> tuple[str, ...]:
    """The words a relation draws its foil words, inserted words and repeated sequences from:
    the default models' vocabulary of words (each used only where it is one token of the model)."""
    from core.zoo.vocab import words

    return tuple(w for w in words() if w.isalpha())


# ------------------------------------------------------------------ subjects


def parse_subject(name: str, loaded, spec: ClaimSpec = ATTRIBUTE_MOVING) -> Subject:
    """A head (``L1.H1``) or a route of one block (``L1.H0+L1.H1``, or ``L1.H0+H1``)
    among the heads a claim of ``spec`` can be about (those that read the image, or
    for a relation of the sequence's own tokens the self-attention heads); a one-line
    error otherwise."""
    from core.methods.component_ablation import parse_head

    adapter = loaded.adapter
    parts = [p.strip() for p in str(name).split("+")]
    if not all(parts):
        raise ValidateError(f"{name!r}: a route is heads joined by '+', e.g. L1.H0+L1.H1")
    block_name = parts[0].rsplit(".H", 1)[0] if ".H" in parts[0] else ""
    heads = [parse_head(p if "." in p else f"{block_name}.{p}", adapter) for p in parts]
    pool = relation_heads(loaded, spec)
    readers = sorted({h.name.rsplit(".H", 1)[0] for h in pool}, key=[b for b, _ in adapter.blocks].index)
    reading = {(h.block, h.head) for h in pool}
    for h in heads:
        if (h.block, h.head) not in reading:
            raise ValidateError(
                (
                    f"{h.name} reads no visual token (its block's keys are text)"
                    if spec.on_image
                    else f"{h.name} reads none of the sequence's own tokens (its keys are the image's)"
                )
                + f": the chain's heads for {spec.name!r} are those of {', '.join(readers)}"
            )
    block = adapter.blocks[heads[0].block][0]
    if len(heads) == 1:
        return HeadRef(heads[0].block, heads[0].head, f"{block}.H{heads[0].head}")
    if len({h.block for h in heads}) > 1:
        raise ValidateError(f"{name!r}: a route's heads must share one block")
    if len({h.head for h in heads}) < len(heads):
        raise ValidateError(f"{name!r}: a route names each head once")
    return RouteRef(heads[0].block, tuple(h.head for h in heads), block)


# ------------------------------------------------------------------ the result


@dataclass(frozen=True)
class Claim:
    """What is claimed: the researcher's words, and the relation, position and
    distribution the chain checks them under (the claim holds there, or is a hypothesis)."""

    text: str
    relation: str = RELATION
    position: str = QUERY_POSITION

    def __post_init__(self):
        if not str(self.text).strip():
            raise ValidateError("state the claim (--claim TEXT): what the head or route is said to do")

    def to_dict(self) -> dict:
        return {"text": self.text, "relation": self.relation, "position": self.position}


@dataclass
class Validation:
    """The chains run for one claim, with the search and held-out conditions.

    ``chains``: one :class:`ValidationChain` per subject, in the order asked
    (or found). :meth:`verdicts`: per subject, "supported on D" only when all
    seven steps pass, otherwise the status reached and what holds it back.
    """

    claim: Claim
    model: str
    fingerprint: str
    search: InputCondition
    heldout: InputCondition
    chains: list[ValidationChain]
    found_by: str = "named"  # "named", or the candidate search ("top 3 by target-source DLA ...")
    search_table: list[dict] = field(default_factory=list)
    cancelled: bool = False
    seconds: float = 0.0
    schema_version: int = SCHEMA_VERSION
    dtype_and_device: dict = field(default_factory=dict)  # what the chains ran in (Adapter.dtype_and_device)
    spec: ClaimSpec = ATTRIBUTE_MOVING  # the specification the chains were derived from

    kind = "validate"  # the session's run kind (core.results.readout.Readout)

    @staticmethod
    def held_back(chain: ValidationChain) -> str:
        """The steps that keep ``chain`` from the next status (``"6 failed, 7 not tested"``), "" when supported."""
        status = chain.status().status
        if status == "supported":
            return ""
        gate = {"not a candidate": (1, 2, 3, 4), "mechanism candidate": (5,)}.get(status, (6, 7))
        return ", ".join(f"{k} {chain.steps[k].status}" for k in gate if chain.steps[k].status != "passed")

    def tested(self) -> str:
        """What the chains tested, whatever the claim's words: ``relation tested: '...', on
        <the held-out condition: dataset, split, kinds, n=..., at the query position>``."""
        return f"relation tested: {self.claim.relation!r}, on {self.heldout.describe()}"

    def verdict(self, chain: ValidationChain) -> str:
        """``supported on D`` when all seven steps pass, else the status reached
        and the steps that hold it back (the full reason is the chain's); then
        which steps passed, as ``steps passed: 1 of 7 (step 7)``."""
        status = chain.status().status
        where = self.heldout.describe()
        if status == "supported":
            return f"supported on {where}; {chain.steps_passed()}"
        return f"not supported on {where}: {status}, held back by step {self.held_back(chain)}; {chain.steps_passed()}"

    def verdicts(self) -> list[dict]:
        return [
            {
                "subject": c.subject,
                "status": c.status().status,
                "supported": c.label().supported,
                "verdict": self.verdict(c),
                "reason": c.status().reason,
                "relation": self.claim.relation,
                "n": self.heldout.n_samples,
                "steps_passed": [k for k, s in c.steps.items() if s.status == "passed"],
                "steps_tested": len(c.steps),
            }
            for c in self.chains
        ]

    def summary(self) -> str:
        """``validate L1.H1: candidate with intervention, steps passed: 6 of 7 (steps 1, 2, 3, 4, 5, 7);
        relation tested: '...', on scenes split 'heldout', ..., n=150, at the answer position``."""
        parts = [f"{c.subject}: {c.status().status}, {c.steps_passed()}" for c in self.chains]
        tail = " [cancelled]" if self.cancelled else ""
        return f"validate {'; '.join(parts) or 'no chain'}; {self.tested()}{tail}"

    def parameters(self) -> dict:
        return {
            "claim": self.claim.text,
            "relation": self.claim.relation,
            "position": self.claim.position,
            "subjects": [c.subject for c in self.chains],
            "found_by": self.found_by,
            "search": self.search.to_dict(),
            "heldout": self.heldout.to_dict(),
        }

    def audit_records(self) -> list[AuditRecord]:
        """Per chain: its own row (the label holds on its condition only), then each tested step's."""
        out = []
        for c in self.chains:
            if c.audit is not None:
                out.append(c.audit)
            out += [s.audit for s in c.steps.values() if s.audit is not None]
        return out

    def to_dict(self) -> dict:
        return jsonable(
            {
                "schema_version": self.schema_version,
                "kind": self.kind,
                "claim": self.claim.to_dict(),
                "specification": self.spec.to_dict(),
                "model": {"spec": self.model, "fingerprint": self.fingerprint, **self.dtype_and_device},
                "search": self.search.to_dict(),
                "heldout": self.heldout.to_dict(),
                "found_by": self.found_by,
                "criteria": {str(k): v for k, v in self.spec.criteria().items()},
                "verdicts": self.verdicts(),
                "chains": [c.to_dict() for c in self.chains],
                "labels": [{**c.label().to_dict(), "claim": self.claim.text} for c in self.chains],
                "search_table": self.search_table,
                "cancelled": self.cancelled,
                "seconds": round(self.seconds, 1),
            }
        )

    @classmethod
    def from_dict(cls, d: dict) -> Validation:
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValidateError(f"validation schema_version {d.get('schema_version')!r} is not {SCHEMA_VERSION}")
        claim = d["claim"]
        return cls(
            Claim(claim["text"], claim.get("relation", RELATION), claim.get("position", QUERY_POSITION)),
            d["model"]["spec"],
            d["model"].get("fingerprint") or "",
            InputCondition.from_dict(d["search"]),
            InputCondition.from_dict(d["heldout"]),
            [ValidationChain.from_dict(c) for c in d["chains"]],
            d.get("found_by", "named"),
            list(d.get("search_table", [])),
            bool(d.get("cancelled", False)),
            float(d.get("seconds", 0.0)),
            dtype_and_device={k: d["model"][k] for k in ("dtype", "device") if k in d["model"]},
            # a document written before specifications: the attribute relation, which it tested
            spec=ClaimSpec.from_dict(d["specification"]) if "specification" in d else ATTRIBUTE_MOVING,
        )


def subject_labels(session, subject: str, fingerprint: str, cache: dict | None = None) -> list[dict]:
    """Every label the validate runs of ``session`` gave ``subject`` on the weights
    ``fingerprint``, oldest first: one head may hold several, each on its relation and
    input condition (4.5). Each: ``{"run", "specification", "relation", "condition",
    "status", "supported"}``. A run the session cannot read back is left out; no session, none.
    ``cache``: a dict kept between calls, so that each recorded run (which never changes) is
    read once: ``{(session file, run id): (fingerprint, [label of each chain])}``."""
    from core.session import SessionError

    cache = {} if cache is None else cache
    out = []
    for info in session.runs("validate") if session is not None else []:
        key = (str(session.path), info.id)
        if key not in cache:
            try:
                validation = session.run(info.id).readout
            except SessionError:
                continue
            labels = [
                {
                    "subject": chain.subject,
                    "run": info.id,
                    "specification": validation.spec.name,
                    "relation": validation.claim.relation,
                    "condition": validation.heldout.describe(),
                    "status": chain.status().status,
                    "supported": chain.label().supported,
                }
                for chain in validation.chains
            ]
            cache[key] = (validation.fingerprint or "", labels)
        weights, labels = cache[key]
        if weights == (fingerprint or ""):
            out += [{k: v for k, v in x.items() if k != "subject"} for x in labels if x["subject"] == subject]
    return out


# ------------------------------------------------------------------ the call


def validate(
    loaded,
    subjects: Sequence[str] = (),
    *,
    claim: str,
    dataset: str,
    heldout: str | None = None,
    candidates: int = 0,
    n: int = 150,
    n_side: int = 50,
    region: np.ndarray | None = None,
    min_distractors: int = 1,
    seed: int = 0,
    batch_size: int = 32,
    progress: Callable | None = None,
    cancel: Callable[[], bool] | None = None,
    spec: str | ClaimSpec | None = None,
) -> Validation:
    """Run the seven-step chain on each head or route of ``subjects`` (names,
    :func:`parse_subject`), and with ``candidates=k`` on the top k heads the
    search set proposes (:func:`core.methods.validation.find_candidates`, plus
    the routes of :func:`core.methods.validation.find_routes`).

    Args:
        claim: the researcher's statement of what the subjects do (the
            relation it is checked as is :data:`core.methods.validation.RELATION`).
        dataset, heldout: the search and held-out sources (:func:`read_chain_data`).
        n, n_side, region, min_distractors, seed: see :func:`read_chain_data`;
            ``seed`` also seeds the matched random heads and the swaps' noise.
        progress: ``progress(done, total, message)``; cancel: returns True to
            stop (the steps done so far are kept; the rest are not tested).
        spec: the claim's specification (:class:`core.methods.validation.spec.ClaimSpec`,
            a shipped one's name or a JSON file; default the attribute relation): the
            relation tested and each step's thresholds.
    """
    t0 = time.perf_counter()
    spec = resolve_spec(spec)
    the_claim = Claim(claim, spec.relation, QUERY_WORDS[spec.query])
    named = [parse_subject(s, loaded, spec) for s in subjects]
    if not named and candidates <= 0:
        raise ValidateError("name a head or route to validate, or ask for candidates (--candidates K)")
    reading = Reading(spec, seed, relation_words())
    search, held = read_chain_data(
        loaded,
        dataset,
        heldout,
        n=n,
        n_side=n_side,
        region=region,
        min_distractors=min_distractors,
        seed=seed,
        reading=reading,
    )
    ctx = ChainContext(
        loaded,
        search.samples,
        search.condition,
        held.samples,
        held.condition,
        side_samples=held.side,
        side_reference={k: v for k, v in search.side.items() if k in held.side},
        swap=swap_of,
        seed=seed,
        batch_size=batch_size,
        progress=progress,
        cancel=cancel,
        spec=spec,
        words=reading.words,
        located=reading.located,
    )
    # refused before any forward (the rows read token ids and geometry only): a held-out set on
    # which step 1 cannot pass, or steps 3 and 5 cannot at the stated effects, supports nothing
    refusal = power_refusal(spec, [row.chance for row in ctx.rows("eval")])
    if refusal:
        raise ValidateError(refusal)
    todo: list[tuple[Subject, dict | None]] = [(s, None) for s in named]
    table: list[dict] = []
    found_by = "named"
    if candidates > 0:
        try:
            found = find_candidates(ctx, candidates)
            routes = find_routes(ctx, found)
        except ChainCancelled:
            found, routes = [], []
        table = found[0][1]["table"] if found else []
        todo += [(h, s) for h, s in found + routes if h not in named]
        found_by = f"the top {candidates} heads by target-source DLA on the search set (and the top attention head)"
        if named:
            found_by = "named, and " + found_by
    chains = []
    for subject, found_search in todo:
        if cancel is not None and cancel():
            break
        chains.append(run_chain(ctx, subject, found_search))
    cancelled = bool(cancel is not None and cancel())
    return Validation(
        the_claim,
        loaded.spec,
        getattr(loaded, "fingerprint", "") or "",
        search.condition,
        held.condition,
        chains,
        found_by,
        table,
        cancelled,
        time.perf_counter() - t0,
        dtype_and_device=loaded.adapter.dtype_and_device(),
        spec=spec,
    )
