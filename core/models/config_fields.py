"""Reading fields of a model config (or a processor's size settings) as the
adapters need them: by dotted path, spelled as config.json spells them, and
checked as integers with one-line errors naming the field."""

from __future__ import annotations

from core.errors import ModelLoadError


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


def size_value(size, key: str):
    """``size[key]`` of a processor size setting, a dict or a transformers
    ``SizeDict`` (None if absent, or if ``size`` is None)."""
    if size is None:
        return None
    value = getattr(size, key, None)
    if value is None and hasattr(size, "get"):
        value = size.get(key)
    return value
