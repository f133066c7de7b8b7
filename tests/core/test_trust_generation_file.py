"""A generate JSON read back with ``--answer-from`` is refused in one line
naming the file and the field when it is not what ``vlm-readout generate``
wrote for this model, this question and this image: fields of the wrong type,
range or length; ids outside the vocabulary, negative or huge; the image token
or other markup among the answer tokens; token strings or a text that are not
the ids' decoding; ``model`` not an object; another question, image or model;
deep nesting, a FIFO, a folder, an oversized file. The analyze output is
never written."""

import copy
import json
import os
import threading
from pathlib import Path

import pytest

import core.generate
from core import load_model
from core.cli import main
from core.errors import InputFileError
from core.files.images import image_sha256, load_image
from core.generate import Generation, check_generation, read_generation
from core.models.loading import resources_dir

SAMPLES = resources_dir() / "samples"
IMAGE = SAMPLES / "sample_00.png"
QUESTION = "what shape is the blue object?"


@pytest.fixture(scope="module")
def loaded():
    return load_model("shapes-llava")


@pytest.fixture(scope="module")
def generated(loaded, tmp_path_factory) -> dict:
    """The JSON of ``vlm-readout generate`` (4 tokens) for IMAGE and QUESTION."""
    out = tmp_path_factory.mktemp("gen") / "g.json"
    argv = ["generate", "--image", str(IMAGE), "--question", QUESTION, "--max-new-tokens", "4", "--json", str(out)]
    assert main([*argv, "--quiet"]) == 0
    return json.loads(out.read_text())


def _write(tmp_path: Path, doc, name: str = "g.json") -> Path:
    path = tmp_path / name
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return path


def _refused(path: Path, needle: str) -> str:
    with pytest.raises(InputFileError) as e:
        read_generation(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and needle in message, message
    return message


def _set(doc: dict, dotted: str, value) -> None:
    *parents, key = dotted.split(".")
    for p in parents:
        doc = doc[p]
    doc[key] = value


def test_the_written_file_reads_back(tmp_path, generated):
    g = read_generation(_write(tmp_path, generated))
    assert g.token_ids == generated["token_ids"] and g.image_sha256 == generated["input"]["image_sha256"]
    assert g.to_dict()["input"]["image_sha256"] == g.image_sha256  # kept on a round trip


# field -> (value, what the message says); each a class of bad value, not one example
BAD_FIELDS = {
    "negative id": ("token_ids", [33, -1, 45, 27], '"token_ids[1]" must be in 0..2,147,483,647, got -1'),
    "huge id": ("token_ids", [33, 10**30, 45, 27], '"token_ids[1]" must be in 0..2,147,483,647, got a 100-bit number'),
    "float id": ("token_ids", [33, 44.0, 45, 27], '"token_ids[1]" must be an integer, got a number'),
    "boolean id": ("token_ids", [True, 44, 45, 27], '"token_ids[0]" must be an integer, got a boolean'),
    "string id": ("token_ids", ["33", 44, 45, 27], '"token_ids[0]" must be an integer, got a string'),
    "nested ids": ("token_ids", [[33], 44, 45, 27], '"token_ids[0]" must be an integer, got an array'),
    "ids an object": ("token_ids", {"0": 33}, '"token_ids" must be an array, got an object'),
    "more ids than max_new_tokens": ("token_ids", [33, 44, 45, 27, 27], "more than its \"max_new_tokens\" (4)"),
    "a token missing": ("tokens", ["square", "yes", "zero"], '"tokens" has 3 entries, expected 4'),
    "a token not a string": ("tokens", ["square", 44, "zero", "one"], '"tokens[1]" must be a string, got a number'),
    "prob above 1": ("probs", [0.9, 1.5, 0.8, 0.7], '"probs[1]" must be a probability in [0, 1], got 1.5'),
    "prob a string": ("probs", [0.9, "high", 0.8, 0.7], '"probs[1]" must be a probability'),
    "top not pairs": ("top", [[["a", 0.5]], [["b"]], [], []], '"top[1][0]" must be a [token, probability] pair'),
    "top over top_k": ("top", [[["a", 0.1]] * 6, [], [], []], '"top[0]" has 6 entries, over the 5'),
    "unknown stop reason": ("stop_reason", "tired", '"stop_reason" must be one of eos, stop_string'),
    "eos without its token": ("stop_reason", "eos", '"stop_token" must be an object when "stop_reason" is "eos"'),
    "cache a string": ("cache", "yes", '"cache" must be true or false, got a string'),
    "stop strings not strings": ("stop_strings", [""], '"stop_strings[0]" is empty'),
    "top_k zero": ("top_k", 0, '"top_k" must be in 1..2,147,483,647, got 0'),
    "max_new_tokens huge": ("max_new_tokens", 2**63, '"max_new_tokens" must be in 1..2,147,483,647'),
    "model a string": ("model", "shapes-llava", '"model" must be an object, got a string'),
    "model an array": ("model", [1], '"model" must be an object, got an array'),
    "model null": ("model", None, '"model" must be an object, got null'),
    "fingerprint a number": ("model.fingerprint", 7, '"model.fingerprint" must be a string, got a number'),
    "input null": ("input", None, '"input" must be an object, got null'),
    "question blank": ("input.question", "  ", '"input.question" is empty'),
    "question a list": ("input.question", ["q"], '"input.question" must be a string, got an array'),
    "raw_prompt a number": ("input.raw_prompt", 0, '"input.raw_prompt" must be true or false, got a number'),
    "prompt_length negative": ("input.prompt_length", -5, '"input.prompt_length" must be in 1..2,147,483,647, got -5'),
    "image hash not hex": ("input.image_sha256", "zz", '"input.image_sha256" must be 64 lowercase hex digits'),
    "schema version": ("schema_version", 2, '"schema_version" is 2; this build reads 1'),
    "kind": ("kind", "analyze", 'not a generate JSON (no "kind": "generate")'),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_a_bad_field_is_one_line_naming_the_file_and_the_field(tmp_path, generated, case):
    key, value, needle = BAD_FIELDS[case]
    doc = copy.deepcopy(generated)
    _set(doc, key, value)
    _refused(_write(tmp_path, doc), needle)


def test_a_generation_without_tokens_has_nothing_to_read_out(tmp_path, generated):
    doc = copy.deepcopy(generated)
    doc.update(token_ids=[], tokens=[], probs=[], top=[], text="", stop_reason="eos")
    doc["stop_token"] = {"token_id": 2, "token": "</s>", "prob": 0.9, "top": [["</s>", 0.9]]}
    assert Generation.from_dict(doc).token_ids == []  # a valid generation (the app shows it)
    _refused(_write(tmp_path, doc), '"token_ids" is empty (the model generated no token to read out)')


@pytest.mark.parametrize("key", ["token_ids", "tokens", "probs", "top", "stop_reason", "text", "model", "input"])
def test_a_missing_field_is_named(tmp_path, generated, key):
    doc = copy.deepcopy(generated)
    del doc[key]
    _refused(_write(tmp_path, doc), f'no "{key}" field')


def test_from_dict_raises_value_error_for_the_app(generated):
    """The app draws a session's generate run through from_dict and turns a
    ValueError into a note: no other exception may come out of a bad result."""
    for bad in (None, [], {"schema_version": 1}, {**generated, "model": 3}, {**generated, "input": {"question": 1}}):
        with pytest.raises(ValueError):
            Generation.from_dict(bad)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"[" * 50_000 + b"]" * 50_000, "JSON nested deeper than 64 levels"),
        (b'{"kind": "generate", "token_ids": [NaN]}', "NaN is not JSON"),
        (b"\xff\xfe{\x00}\x00", "not UTF-8"),
        (b'{"kind": "generate",', "not valid JSON"),
        (b"[1, 2]", "expected a JSON object, got an array"),
    ],
)
def test_a_file_that_is_not_json_is_one_line(tmp_path, content, needle):
    _refused(_write(tmp_path, content), needle)


def test_file_kinds_and_size_are_refused_without_waiting(tmp_path, generated, monkeypatch):
    fifo = tmp_path / "g.fifo"
    os.mkfifo(fifo)
    result = {}
    reader = threading.Thread(target=lambda: result.update(message=_refused(fifo, "not a regular file")), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock it, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("read_generation blocked on a FIFO")
    assert "message" in result
    _refused(tmp_path, "is a folder")
    _refused(tmp_path / "none.json", "no such file")
    monkeypatch.setattr(core.generate, "MAX_GENERATION_BYTES", 1000)
    _refused(_write(tmp_path, generated), "over the 1,000-byte limit")


# ---- against the model, the question and the image


def _checked(loaded, tmp_path, doc, question=QUESTION, raw_prompt=False, image=None) -> str:
    path = _write(tmp_path, doc)
    generation = read_generation(path)
    with pytest.raises(InputFileError) as e:
        check_generation(generation, loaded, str(path), question=question, raw_prompt=raw_prompt, image_sha256=image)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def _with_ids(loaded, generated, ids) -> dict:
    """``generated`` with these ids, its tokens and text made consistent (so only the ids are wrong)."""
    doc = copy.deepcopy(generated)
    doc["token_ids"] = ids
    doc["tokens"] = [loaded.adapter.token_str(i) if i < loaded.adapter.W_U.shape[-1] else "x" for i in ids]
    return doc


def test_the_real_file_passes_every_check(loaded, tmp_path, generated):
    path = _write(tmp_path, generated)
    sha = image_sha256(load_image(IMAGE))
    check_generation(read_generation(path), loaded, str(path), question=QUESTION, image_sha256=sha)


def test_ids_outside_the_vocabulary_are_refused(loaded, tmp_path, generated):
    vocab = int(loaded.adapter.W_U.shape[-1])
    message = _checked(loaded, tmp_path, _with_ids(loaded, generated, [33, vocab, 45, 27]))
    assert f'"token_ids[1]": {vocab} is outside the model\'s {vocab}-token vocabulary' in message


def test_the_image_token_and_markup_are_refused_in_the_answer(loaded, tmp_path, generated):
    markup = loaded.adapter.markup
    (image_id,) = [i for i, s in markup.ids.items() if markup.placeholders.get(s) == "image"]
    message = _checked(loaded, tmp_path, _with_ids(loaded, generated, [33, image_id, 45, 27]), raw_prompt=True)
    assert f'"token_ids[1]": {image_id} is the image placeholder' in message
    bos = loaded.adapter.tokenizer.bos_token_id
    message = _checked(loaded, tmp_path, _with_ids(loaded, generated, [bos, 44, 45, 27]))
    assert f'"token_ids[0]": {bos} is the special token' in message and "--raw-prompt" in message


def test_more_tokens_than_the_model_has_positions(loaded, tmp_path, generated, monkeypatch):
    monkeypatch.setattr(loaded.adapter, "max_positions", lambda: 4)
    assert '"token_ids" holds 4 tokens; the model takes 4 positions' in _checked(loaded, tmp_path, generated)


def test_token_strings_and_text_must_be_the_ids_decoding(loaded, tmp_path, generated):
    doc = copy.deepcopy(generated)
    doc["tokens"][2] = "circle"
    assert "\"tokens[2]\" is 'circle', but token 45 is" in _checked(loaded, tmp_path, doc)
    doc = copy.deepcopy(generated)
    doc["text"] = "a forged answer"
    assert "\"text\" is 'a forged answer', but the tokens decode to" in _checked(loaded, tmp_path, doc)


def test_another_question_model_or_image_is_refused(loaded, tmp_path, generated):
    assert "generated for the question" in _checked(loaded, tmp_path, generated, question="is it red?")
    doc = copy.deepcopy(generated)
    doc["model"]["fingerprint"] = "0" * 16
    assert "generated by model 'shapes-llava' (fingerprint 000000000000)" in _checked(loaded, tmp_path, doc)
    assert "generated for another image" in _checked(loaded, tmp_path, generated, image="f" * 64)


# ---- through the command line


def _analyze(tmp_path, path, question=QUESTION, image=IMAGE) -> list[str]:
    out = tmp_path / "a.json"
    return ["analyze", "--image", str(image), "--question", question, "--answer-from", str(path), "--json", str(out)]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: _set(d, "token_ids", [33, -4, 45, 27]), '"token_ids[1]" must be in 0..'),
        (lambda d: _set(d, "token_ids", [33, 4, 45, 27]), "is the image placeholder '<image>'"),
        (lambda d: _set(d, "token_ids", [33, 1000, 45, 27]), "is outside the model's"),
        (lambda d: _set(d, "model", "shapes-llava"), '"model" must be an object'),
        (lambda d: _set(d, "tokens", ["square", "no", "zero", "one"]), "\"tokens[1]\" is 'no'"),
        (lambda d: _set(d, "input.question", "is the red circle above the blue square?"), "generated for the question"),
    ],
)
def test_the_cli_answers_each_with_one_error_line(tmp_path, capsys, generated, edit, needle):
    doc = copy.deepcopy(generated)
    edit(doc)
    path = _write(tmp_path, doc)
    assert main([*_analyze(tmp_path, path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: ") and "\n" not in err and needle in err, err
    assert "Traceback" not in err and not (tmp_path / "a.json").exists()


def test_the_cli_refuses_a_generation_of_another_image(tmp_path, capsys, generated):
    path = _write(tmp_path, generated)
    other = SAMPLES / "sample_01.png"
    assert main([*_analyze(tmp_path, path, image=other), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: generated for another image") and "--answer-text" in err
    assert main([*_analyze(tmp_path, path), "--quiet"]) == 0  # the image it was made for
