"""Load-time checks of the tokenizer: its files must agree with each other
(added and post-processor token ids, a BPE / Unigram vocabulary's training
order) and with the model's config (special-token ids, the vocabulary against
the embedding and output rows), so a shuffled or foreign tokenizer is refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from core.errors import ModelLoadError
from core.models.adapter import Adapter
from core.models.model_files import read_json

# Config fields naming a special token's id -> the tokenizer attribute holding
# that token (image / video token ids are the adapters' check: core.models.adapter).
_TOKEN_ID_ROLES = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "pad", "sep_token_id": "sep"}


def token_id_fields(source: str, config: dict) -> list[tuple[str, str, Any]]:
    """``[(label, role, value)]`` of the special token ids a config states, at
    its top level and in its ``text_config`` (label: ``"config.json text_config.eos_token_id"``)."""
    out = []
    for prefix, section in (("", config), ("text_config.", config.get("text_config"))):
        if isinstance(section, dict):
            out += [(f"{source} {prefix}{k}", role, section[k]) for k, role in _TOKEN_ID_ROLES.items() if k in section]
    return out


def _post_processor_ids(pp) -> list[tuple[str, int]]:
    """``[(token, id)]`` a tokenizer.json post-processor inserts (TemplateProcessing,
    Bert / Roberta processing, nested in Sequence)."""
    if not isinstance(pp, dict):
        return []
    kind = pp.get("type")
    if kind == "Sequence":
        return [x for p in pp.get("processors") or [] for x in _post_processor_ids(p)]
    if kind == "TemplateProcessing" and isinstance(pp.get("special_tokens"), dict):
        out = []
        for spec in pp["special_tokens"].values():
            if isinstance(spec, dict):
                out += list(zip(spec.get("tokens") or [], spec.get("ids") or []))
        return out
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [tuple(pp[k]) for k in ("sep", "cls") if isinstance(pp.get(k), list) and len(pp[k]) == 2]
    return []


# Trained vocabularies keep their ids in training order (~100% of consecutive
# pairs in order); a shuffled one has about half in order.
_ORDERED_SHARE = 0.75
_ORDER_EVIDENCE = 32  # fewer merges / pieces than this tell nothing


def _vocabulary_order(model: dict, ids: dict) -> tuple[str, float] | None:
    """(what, share in order) for a BPE or Unigram vocabulary: the share of
    consecutive merges whose merged token has a higher id than the previous
    one's (BPE trainers and tiktoken give a merge's token the next id; the
    SentencePiece converter lists merges by their token's id), or of consecutive scored Unigram pieces whose
    score does not rise (SentencePiece sorts them). None: nothing to tell."""
    if model.get("type") == "BPE" and isinstance(model.get("merges"), list):
        merged = []
        for m in model["merges"]:
            pair = m if isinstance(m, list) else str(m).split(" ", 1)
            i = ids.get("".join(pair)) if all(isinstance(p, str) for p in pair) else None
            if isinstance(i, int) and (not merged or merged[-1] != i):  # one token merged several ways: once
                merged.append(i)
        pairs = list(zip(merged, merged[1:]))
        if len(pairs) >= _ORDER_EVIDENCE:
            return "merges", sum(b > a for a, b in pairs) / len(pairs)
    if model.get("type") == "Unigram" and isinstance(model.get("vocab"), list):
        scores = [e[1] for e in model["vocab"] if isinstance(e, list) and len(e) == 2 and e[1] not in (0, 0.0)]
        pairs = [
            (a, b) for a, b in zip(scores, scores[1:]) if isinstance(a, int | float) and isinstance(b, int | float)
        ]
        if len(pairs) >= _ORDER_EVIDENCE:
            return "scores", sum(b <= a for a, b in pairs) / len(pairs)
    return None


def check_tokenizer_json(f: Path) -> None:
    """A reordered or edited vocabulary no longer agrees with the rest of
    tokenizer.json: each id must name one token, the added tokens and the
    post-processor's special tokens must keep the ids the vocabulary gives
    them, and a BPE / Unigram vocabulary must keep its training order."""
    data = read_json(f)
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids = vocab
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        ids = {e[0]: i for i, e in enumerate(vocab) if isinstance(e, list) and e and isinstance(e[0], str)}
    else:
        return
    owner: dict = {}
    for token, i in ids.items():
        if not isinstance(i, int):
            continue
        if i in owner:
            raise ModelLoadError(f"{f}: the vocabulary gives id {i} to both {owner[i]!r} and {token!r}")
        owner[i] = token
    known = dict(ids)
    added = data.get("added_tokens") if isinstance(data.get("added_tokens"), list) else []
    for a in added:
        content, i = (a.get("content"), a.get("id")) if isinstance(a, dict) else (None, None)
        if not isinstance(content, str):
            continue
        if content in ids and ids[content] != i:
            raise ModelLoadError(
                f"{f}: added token {content!r} has id {i} in added_tokens but id {ids[content]} in the "
                "vocabulary: the vocabulary was reordered or edited"
            )
        known.setdefault(content, i)
    for token, i in _post_processor_ids(data.get("post_processor")):
        if isinstance(token, str) and token in known and known[token] != i:
            raise ModelLoadError(
                f"{f}: the post-processor inserts {token!r} as id {i}, the vocabulary has it at id {known[token]}: "
                "the vocabulary was reordered or edited"
            )
    order = _vocabulary_order(model, ids)
    if order is not None and order[1] < _ORDERED_SHARE:
        what, share = order
        raise ModelLoadError(
            f"{f}: the vocabulary's ids do not follow its {what} ({share:.0%} of consecutive {what} in order; "
            "a trained vocabulary has nearly all): the vocabulary was reordered"
        )


def _check_added_tokens_decoder(f: Path, tokenizer) -> None:
    """tokenizer_config.json's ``added_tokens_decoder`` (id -> token) must be
    what the loaded tokenizer does."""
    decoder = read_json(f).get("added_tokens_decoder")
    if decoder is None:
        return
    if not isinstance(decoder, dict):
        raise ModelLoadError(
            f"{f} added_tokens_decoder: expected an object of id -> token, got {type(decoder).__name__}"
        )
    vocab = tokenizer.get_vocab()
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not str(key).isdigit():
            raise ModelLoadError(f"{f} added_tokens_decoder[{key!r}]: expected a token id and an object with 'content'")
        if vocab.get(content) != int(key):
            have = vocab.get(content)
            raise ModelLoadError(
                f"{f}: added_tokens_decoder gives {content!r} id {key}, the tokenizer "
                + (f"has it at id {have}" if have is not None else "does not have it")
                + ": the tokenizer files disagree (a reordered or edited vocabulary)"
            )


def _check_special_token_ids(tokenizer, fields: list[tuple[str, str, Any]]) -> None:
    """Each special token id the model's config states (bos, eos, pad, sep)
    must be the id the tokenizer gives its token of that role, or at least one
    of the tokenizer's special tokens (configs list extra end tokens): else the
    model would start, stop or pad on an ordinary word."""
    special = set(getattr(tokenizer, "added_tokens_decoder", None) or {}) | set(
        getattr(tokenizer, "all_special_ids", None) or []
    )
    n_tokens = len(tokenizer)
    for label, role, value in fields:
        values = value if role == "eos" and isinstance(value, list) else [value]
        for v in values:
            if v is None:
                continue
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int):
                more = " or a list of them" if role == "eos" else ""
                raise ModelLoadError(f"{label}: expected a token id (an integer{more}), got {value!r}")
            declared = getattr(tokenizer, f"{role}_token", None)
            if v < 0 or not isinstance(declared, str) or v in special:
                continue  # -1 means "none" in some configs; nothing to compare without a declared token
            declared_id = tokenizer.convert_tokens_to_ids(declared)
            if v == declared_id:
                continue
            token = tokenizer.convert_ids_to_tokens(v) if v < n_tokens else None
            reads = f"reads id {v} as {token!r}" if token is not None else f"has no id {v} ({n_tokens} tokens)"
            raise ModelLoadError(
                f"{label} is {v}, but the tokenizer {reads} and gives its {role} token {declared!r} id {declared_id}: "
                "the tokenizer does not belong to this model (a reordered vocabulary or another model's tokenizer)"
            )


def check_tokenizer(folder: Path, tokenizer, fields: list[tuple[str, str, Any]], padded: bool = False) -> None:
    """The tokenizer files in ``folder`` agree with each other and with the
    model's config (before the weights load: a wrong tokenizer costs no
    gigabytes). open_clip's own tokenizers have no files to check.
    ``padded``: the processor pads every batch, so a padding token is needed."""
    if not hasattr(tokenizer, "get_vocab"):
        return
    if (folder / "tokenizer.json").is_file():
        check_tokenizer_json(folder / "tokenizer.json")
    if (folder / "tokenizer_config.json").is_file():
        _check_added_tokens_decoder(folder / "tokenizer_config.json", tokenizer)
    _check_settings(folder / "tokenizer_config.json", tokenizer, padded)
    _check_special_tokens_known(folder / "tokenizer_config.json", tokenizer)
    _check_special_token_ids(tokenizer, fields)


def _check_special_tokens_known(config_file: Path, tokenizer) -> None:
    """Every special token the tokenizer declares (bos, eos, unk, pad, ... and
    its extra ones) must be in its vocabulary: one that is not reads as the
    unknown token, and an unknown token that is not either sends the library
    into endless recursion looking its id up."""
    vocab = tokenizer.get_vocab()
    for role, tokens in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        for token in tokens if isinstance(tokens, list | tuple) else [tokens]:
            if str(token) not in vocab:
                raise ModelLoadError(
                    f"{config_file} {role}: {str(token)[:80]!r} is not in the tokenizer's vocabulary "
                    "(expected one of its tokens)"
                )


def _check_settings(config_file: Path, tokenizer, padded: bool) -> None:
    """``model_max_length``, which every encoding compares the prompt's length
    with, must be a number >= 1 (the library checks its other settings itself);
    where batches are padded, there must be a padding token (else every
    processor call fails)."""
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int | float) or not math.isfinite(limit) or limit < 1
    ):
        raise ModelLoadError(f"{config_file} model_max_length: expected a number >= 1, got {limit!r}"[:300])
    if padded and getattr(tokenizer, "pad_token", None) is None:
        raise ModelLoadError(
            f"{config_file} pad_token: the tokenizer has no padding token, and the processor pads every batch "
            "(expected a pad_token, e.g. the one the model was trained with)"
        )


def check_vocabulary_fits(where: Path, tokenizer, model, adapter: Adapter) -> None:
    """Every token id must have an embedding row, and every ordinary (not
    added) token a row of the output layer: a tokenizer of another model
    reads ids the model does not have. (Added tokens such as Mllama's
    ``<|image|>`` may be input-only.)"""
    import torch

    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        if isinstance(embedding, torch.nn.Embedding):
            rows = embedding.num_embeddings
        else:  # open_clip: the adapter knows where the token embeddings are
            rows = int(adapter.input_embeddings().shape[0])
    except (AttributeError, NotImplementedError, TypeError):
        rows = None
    try:
        out_rows = int(adapter.W_U.shape[1])
    except (AttributeError, NotImplementedError, TypeError):
        out_rows = None
    if not hasattr(tokenizer, "get_vocab"):  # open_clip's own tokenizer: ids 0 .. vocab_size - 1
        size = getattr(tokenizer, "vocab_size", None)
        if isinstance(size, int) and rows is not None and size > rows:
            raise ModelLoadError(
                f"{where}: the tokenizer ({type(tokenizer).__name__}, open_clip's own) has {size} tokens but the model "
                f"embeds {rows}: the tokenizer is not this model's (name its tokenizer in "
                "model_cfg.text_cfg.hf_tokenizer_name)"
            )
        return
    vocab = tokenizer.get_vocab()
    if not vocab:
        raise ModelLoadError(f"{where}: the tokenizer has no tokens")
    token, top = max(vocab.items(), key=lambda kv: kv[1])
    if rows is not None and top >= rows:
        raise ModelLoadError(
            f"{where}: the tokenizer's ids reach {top} ({token!r}) but the model embeds {rows} tokens: "
            "the tokenizer is not this model's"
        )
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or {})
    ordinary = [(t, i) for t, i in vocab.items() if i not in added]
    if out_rows is not None and ordinary:
        token, top = max(ordinary, key=lambda kv: kv[1])
        if top >= out_rows:
            raise ModelLoadError(
                f"{where}: the tokenizer's vocabulary reaches id {top} ({token!r}) but the model's output layer "
                f"scores {out_rows} tokens: the tokenizer is not this model's"
            )
