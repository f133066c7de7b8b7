"""Questions that would break the prompt, and config fields the adapters read.

For every family's tiny model and both built-in models: each special token of
the model in a question is refused by name (unless raw prompts are asked for,
when the answer is still computed, with the token in the model's input),
image placeholders are refused even in raw prompts, text that is not valid
UTF-8 is refused, and ordinary punctuation never reads as markup. A chat
template or prompt that cannot render, and malformed config fields
(``image_token_index`` and the others the adapters read), are one-line
ModelLoadErrors naming the field, raised when the model loads.
"""

import copy
import json
import re
import shutil

import pytest
import torch

from core import answer, answer_batch, load_model
from core.errors import ModelLoadError, QuestionError
from core.models.adapter import is_markup
from core.models.loading import resources_dir
from tests.core.exactness import noise_image
from tests.core.test_blip import PREFIX, tiny_blip_float64
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.core.test_idefics3 import tiny_model_float64 as tiny_idefics3_float64
from tests.core.test_llava_next import tiny_llava_next_float64
from tests.core.test_mllama import tiny_mllama_float64
from tests.core.test_paligemma import tiny_paligemma_float64
from tests.core.test_qwen2_vl import tiny_qwen_float64

SAMPLE = resources_dir() / "samples" / "sample_00.png"
SHAPES_QUESTION = "what shape is the blue object?"
TINY_QUESTION = "is there a red circle?"

# name -> (builder, an ordinary question in that model's vocabulary)
MODELS = {
    "llava": (tiny_llava_float64, SHAPES_QUESTION),
    "llava_next": (tiny_llava_next_float64, TINY_QUESTION),
    "qwen2_vl": (lambda: tiny_qwen_float64("qwen2_vl"), TINY_QUESTION),
    "qwen2_5_vl": (lambda: tiny_qwen_float64("qwen2_5_vl", tie=True), TINY_QUESTION),
    "paligemma": (tiny_paligemma_float64, "answer en " + TINY_QUESTION),
    "idefics3": (lambda: tiny_idefics3_float64("idefics3"), TINY_QUESTION),
    "smolvlm": (lambda: tiny_idefics3_float64("smolvlm"), TINY_QUESTION),
    "mllama": (tiny_mllama_float64, TINY_QUESTION),
    "blip": (tiny_blip_float64, PREFIX),
    "coca": (tiny_coca_float64, SHAPES_QUESTION),
    "shapes-llava": (lambda: load_model("shapes-llava"), SHAPES_QUESTION),
    "shapes-coca": (lambda: load_model("shapes-coca"), SHAPES_QUESTION),
}
_built: dict = {}


def built(name: str):
    """The model ``name`` of :data:`MODELS`, built once per module (tests that
    build a variant of it call the builder themselves)."""
    if name not in _built:
        _built[name] = MODELS[name][0]()
    return _built[name]


@pytest.fixture(params=sorted(MODELS))
def model(request):
    """``(loaded model, an ordinary question)``."""
    return built(request.param), MODELS[request.param][1]


def with_token(question: str, token: str) -> str:
    """``question`` with ``token`` between its first and second word."""
    first, rest = question.split(" ", 1)
    return f"{first} {token} {rest}"


def test_markup_is_derived_from_the_tokenizer_and_processor(model):
    m, _ = model
    markup = m.adapter.markup
    tok = m.adapter.tokenizer
    listed = set(markup.special) | set(markup.placeholders)
    assert {s for s in tok.all_special_tokens if is_markup(s)} <= listed
    assert {str(t) for t in tok.added_tokens_decoder.values() if t.special and is_markup(str(t))} <= listed
    image = getattr(m.processor, "image_token", None)
    if isinstance(image, str):
        assert markup.placeholders[image] == "image"
    assert markup.special  # every model has markup (bos / eos / pad at least)


def test_every_special_token_is_refused_by_name(model):
    m, question = model
    a = m.adapter
    a.check_question(question)
    for token in a.markup.special:
        with pytest.raises(QuestionError, match="special token") as e:
            a.check_question(with_token(question, token))
        assert repr(token) in str(e.value) and "raw" in str(e.value)
        assert "\n" not in str(e.value)
    # glued to a word, at the very end, twice: still found, still named
    token = a.markup.special[0]
    for q in (question + token, token + question, with_token(question, token + token)):
        with pytest.raises(QuestionError, match=re.escape(repr(token))):
            a.check_question(q)


def test_raw_prompt_lets_special_tokens_through_and_the_model_reads_them(model):
    m, question = model
    a = m.adapter
    image = noise_image((64, 48))
    inverse = {s: i for i, s in a.markup.ids.items()}
    tokens = a.markup.special
    inputs = a.prepare([image] * len(tokens), [with_token(question, t) for t in tokens], raw_prompt=True)
    for row, token in enumerate(tokens):
        if token in inverse:  # a token of the vocabulary: the model reads it as that token
            assert inverse[token] in inputs.input_ids[row].tolist(), token
    with torch.no_grad():
        assert torch.isfinite(a.next_token_logits(inputs)).all()
    got = answer(m, image, with_token(question, a.markup.special[0]), raw_prompt=True)
    assert 0 < got.prob <= 1 and got.answer == got.top[0][0]


def test_image_placeholders_are_refused_even_in_raw_prompts(model):
    m, question = model
    a = m.adapter
    image = noise_image((64, 48))
    for token, kind in a.markup.placeholders.items():
        for raw in (False, True):
            with pytest.raises(QuestionError, match=f"{kind} placeholder") as e:
                a.prepare([image], [with_token(question, token)], raw_prompt=raw)
            assert repr(token) in str(e.value)


@pytest.mark.parametrize("bad", ["\udcff", "is there \ud800 a circle?", None, 5, b"is there a circle?"])
def test_text_that_is_not_valid_utf8_is_refused(model, bad):
    m, _ = model
    for raw in (False, True):  # raw prompts never skip this check
        with pytest.raises(QuestionError, match="not valid text"):
            answer(m, noise_image((64, 48)), bad, raw_prompt=raw)
    with pytest.raises(QuestionError, match="not valid text"):
        m.adapter.token_id(bad)


def test_ordinary_punctuation_never_reads_as_markup(model):
    m, question = model
    a = m.adapter
    a.check_question(question)
    for ordinary in (
        "is 3 < 4 > 2 | 1 ? the image's s, [x] (y) {z} <> <b a| |> s> <s a </ >",
        "image s pad unk bos eos mask sep cls im_start end_of_utterance fake_token_around_image",
        "< s > < / s > [ sep ] < | im_end | >",
    ):
        a.check_markup(ordinary)  # may hold words the vocabulary lacks, but no markup


def test_plain_word_special_tokens_do_not_refuse_ordinary_questions():
    """A tokenizer whose unk token is the word ``unk`` and whose pad token is
    ``!`` (as CLIP's is): questions holding them, and ``<``, ``>``, ``|``,
    ``image``, ``s``, pass; its real markup and a special token a normaliser
    produces from other text (found by id) are still refused."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from core.models.families.coca import CocaAdapter

    words = "what is the < > | image s ! unk <s> </s> <ctrl> a red circle ? '".split()
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="unk"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["unk", "!", "<s>", "</s>"])
    tok.add_special_tokens([AddedToken("<ctrl>", normalized=True)])  # matched after lowercasing
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="unk", pad_token="!", bos_token="<s>", eos_token="</s>"
    )
    coca = built("coca")
    a = CocaAdapter(coca.model, coca.processor, hf, {"prompt": "{question}"})
    assert "unk" not in a.markup.special and "!" not in a.markup.special
    a.check_question("what is the image < s > | unk !")
    a.check_question("is the circle red !")
    with pytest.raises(QuestionError, match="'</s>'"):
        a.check_question("what is </s> the image")
    with pytest.raises(QuestionError, match="'<ctrl>'"):
        a.check_question("what is <CTRL> the image")  # not a substring: found as the id it becomes
    with pytest.raises(QuestionError, match="vocabulary does not have: zebra"):
        a.check_question("what is the zebra unk")
    a.check_question("what is <s> the unk image", raw_prompt=True)


def test_token_id_refuses_words_outside_the_vocabulary(model):
    m, _ = model
    a = m.adapter
    if a.tokenizer.unk_token_id is None:
        pytest.skip("no unk token: every word encodes")
    with pytest.raises(QuestionError, match="vocabulary"):
        a.token_id("zebra")


def test_answer_batch_names_the_bad_question_and_checks_its_arguments():
    m = built("shapes-llava")
    images = [SAMPLE] * 3
    with pytest.raises(QuestionError, match=r"question 2 of 3: .*special token '</s>'"):
        answer_batch(m, images, [SHAPES_QUESTION, SHAPES_QUESTION + " </s>", SHAPES_QUESTION], batch_size=1)
    with pytest.raises(QuestionError, match="3 images for 2 questions"):
        answer_batch(m, images, [SHAPES_QUESTION] * 2)
    with pytest.raises(QuestionError, match="list of questions"):
        answer_batch(m, images[:1], SHAPES_QUESTION)
    for bad in ({"top_k": 0}, {"batch_size": 0}, {"top_k": "5"}):
        with pytest.raises(QuestionError, match="positive integer"):
            answer_batch(m, images[:1], [SHAPES_QUESTION], **bad)


# ---- chat templates and prompts that cannot render: refused when the model is built


@pytest.mark.parametrize(
    "template, reason",
    [
        ("{% for m in messages %}{{ m.content[1].text }{% endfor %}", "TemplateSyntaxError"),
        ("{{ raise_exception('this template takes no images') }}", "this template takes no images"),
        ("{{ messages[0].content[7].text }}", "UndefinedError"),
        ("{% for m in messages %}USER: {{ m.content[1].text }} ASSISTANT:{% endfor %}", "0 image placeholders"),
        ("USER: <image>\nhello ASSISTANT:", "does not hold the question"),
    ],
)
def test_chat_template_that_does_not_render_is_refused_at_load(template, reason):
    with pytest.raises(ModelLoadError, match="chat_template") as e:
        tiny_llava_next_float64(chat_template=template)
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_chat_template_that_raises_on_one_question_is_a_question_error():
    template = (
        "{% for m in messages %}{% if 'square' in m.content[1].text %}{{ raise_exception('no squares') }}"
        "{% endif %}USER: <image>\n{{ m.content[1].text }} ASSISTANT:{% endfor %}"
    )
    m = tiny_llava_next_float64(chat_template=template)
    m.adapter.check_question(TINY_QUESTION)
    with pytest.raises(QuestionError, match=r"chat_template: cannot render the prompt \(TemplateError: no squares\)"):
        m.adapter.check_question("is there a red square?")


@pytest.mark.parametrize(
    "prompt, reason",
    [("q: {q} a:", "KeyError"), ("q: {0} a:", "IndexError"), (5, "expected a string"), ("answer:", "does not hold")],
)
def test_config_prompt_that_does_not_render_is_refused_at_load(prompt, reason):
    from core.models.families.coca import CocaAdapter

    m = built("coca")
    with pytest.raises(ModelLoadError, match="vlm_readout.prompt") as e:
        CocaAdapter(m.model, m.processor, m.tokenizer, {"prompt": prompt})
    assert reason in str(e.value)
    with pytest.raises(ModelLoadError, match="expected an object"):
        CocaAdapter(m.model, m.processor, m.tokenizer, ["not", "a", "dict"])


@pytest.fixture
def shapes_llava_copy(tmp_path):
    """A writable copy of the built-in LLaVA folder (weights included, tuned lens left out)."""
    folder = tmp_path / "llava"
    shutil.copytree(resources_dir() / "models" / "shapes-llava", folder, ignore=shutil.ignore_patterns("tuned-lens"))
    return folder


def test_broken_chat_template_file_fails_at_load_not_per_question(shapes_llava_copy):
    (shapes_llava_copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    with pytest.raises(ModelLoadError, match=r"chat_template: cannot render the prompt \(TemplateSyntaxError"):
        load_model(shapes_llava_copy)


# ---- config fields the adapters read


@pytest.mark.parametrize(
    "value, message",
    [
        (5, "image_token_index is 5, but the processor writes its image token '<image>' as id 4"),
        (999, "image_token_index: 999 is outside the model's 46-token embedding table"),
        (-1, "image_token_index: expected an integer >= 0, got -1"),
    ],
)
def test_image_token_index_that_does_not_match_is_refused_at_load(shapes_llava_copy, value, message):
    config = json.loads((shapes_llava_copy / "config.json").read_text())
    config["image_token_index"] = value
    (shapes_llava_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape("config.json " + message)):
        load_model(shapes_llava_copy)


@pytest.mark.parametrize("value", ["4", True, 4.5, [4], None])
def test_image_token_id_that_is_not_an_integer_is_refused(value):
    m = tiny_llava_next_float64()
    config = copy.deepcopy(m.model.config)
    config.image_token_id = value
    if value is None:  # optional in general; the adapter must still find its image
        m.model.config.image_token_id = None
        with pytest.raises(ModelLoadError):
            type(m.adapter)(m.model, m.processor, m.tokenizer)
        return
    with pytest.raises(ModelLoadError, match="config.json image_token_index: expected an integer"):
        type(m.adapter).check_config(config)


def test_qwen_token_ids_are_checked_against_the_processor():
    m = tiny_qwen_float64("qwen2_vl")
    m.model.config.video_token_id = m.model.config.image_token_id
    with pytest.raises(ModelLoadError, match=r"config.json video_token_id is 5, but the processor writes its video"):
        type(m.adapter)(m.model, m.processor, m.tokenizer)


def test_fields_each_family_reads_are_checked():
    """Values transformers' own config validation lets through (it refuses a
    wrong type of the whole field, not wrong elements or ranges)."""
    llava_next = tiny_llava_next_float64()
    for bad in ([[32]], [[32, "64"]], [], [[0, 32]], None):
        config = copy.deepcopy(llava_next.model.config)
        config.image_grid_pinpoints = bad
        with pytest.raises(ModelLoadError, match="config.json image_grid_pinpoints: expected a list of"):
            type(llava_next.adapter).check_config(config)

    mllama = tiny_mllama_float64()
    for bad in ([9], [2, 2], [-1], None):
        config = copy.deepcopy(mllama.model.config)
        config.text_config.cross_attention_layers = bad
        with pytest.raises(ModelLoadError, match="config.json text_config.cross_attention_layers: expected"):
            type(mllama.adapter).check_config(config)

    blip = tiny_blip_float64()
    for field, value in (("bos_token_id", None), ("bos_token_id", 10**6), ("pad_token_id", -3)):
        config = copy.deepcopy(blip.model.config)
        setattr(config.text_config, field, value)
        blip.model.config = config
        with pytest.raises(ModelLoadError, match=f"config.json text_config.{field}"):
            type(blip.adapter)(blip.model, blip.processor, blip.tokenizer)

    qwen = tiny_qwen_float64("qwen2_vl")
    config = copy.deepcopy(qwen.model.config)
    config.text_config.max_position_embeddings = 0
    with pytest.raises(ModelLoadError, match="config.json text_config.max_position_embeddings: expected an integer"):
        type(qwen.adapter).check_config(config)


# ---- through the command line


@pytest.mark.parametrize(
    "question, named",
    [("what shape </s> is the blue object?", "'</s>'"), ("what <image> shape?", "'<image>'"), ("what \udcff", "valid")],
)
def test_cli_refuses_in_one_line(capsys, question, named):
    from core.cli import main

    code = main(["answer", "--model", "shapes-llava", "--image", str(SAMPLE), "--question", question])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err.startswith("error: ") and "\n" not in err and named in err
    assert "Traceback" not in err


def test_cli_raw_prompt_reads_the_special_token(capsys, tmp_path):
    """``--raw-prompt`` is the explicit opt-in: answer and analyze run, and
    analyze records that the prompt was raw and that the token reached the model."""
    from core.cli import main

    question = "what shape </s> is the blue object?"
    assert main(["answer", "--image", str(SAMPLE), "--question", question, "--raw-prompt"]) == 0
    word, prob = capsys.readouterr().out.strip().split("\t")
    assert word and 0 < float(prob) <= 1
    out = tmp_path / "a.json"
    args = ["analyze", "--image", str(SAMPLE), "--question", question, "--json", str(out), "--quiet"]
    assert main([*args, "--raw-prompt"]) == 0
    result = json.loads(out.read_text())
    assert result["input"]["raw_prompt"] is True and "</s>" in result["input"]["tokens"]
    assert main(args) == 2 and "'</s>'" in capsys.readouterr().err
