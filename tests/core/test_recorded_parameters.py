"""core.requests.RecordedParameters: a stored run's parameters read back typed, the one
reader of them. What each request's parameters() writes (as JSON, the way a session
stores it) reads back as the request's own fields; what a run does not record, or
records with another type, reads as not recorded. No model runs here."""

import json

import numpy as np
import pytest

from core.answer_text import AnswerText
from core.files.images import load_image
from core.models.loading import resources_dir
from core.requests import (
    AblationRequest,
    AnalyzeRequest,
    CounterfactualRequest,
    GenerateRequest,
    NonuniqueRequest,
    PatchingRequest,
    RecordedParameters,
    SweepRequest,
    ValidateRequest,
)

SAMPLES = resources_dir() / "samples"
IMAGE_PATH = SAMPLES / "sample_00.png"
OTHER_PATH = SAMPLES / "sample_01.png"
QUESTION = "what shape is the blue object?"
ANSWER_TEXT = AnswerText("blue circle", (7, 9), ("blue", "circle"), 1)


def stored(request) -> RecordedParameters:
    """The request's parameters as a session stores them (JSON) and reads them back."""
    return RecordedParameters.from_parameters(json.loads(json.dumps(request.parameters())))


@pytest.fixture(scope="module")
def image():
    return load_image(IMAGE_PATH)


@pytest.fixture(scope="module")
def mask(image):
    region = np.zeros((image.height, image.width), bool)
    region[10:30, 10:30] = True
    return region


def asked(image, **fields) -> dict:
    return {"image": image, "image_path": str(IMAGE_PATH), "question": QUESTION, **fields}


def test_the_asked_fields_read_back_as_typed(image):
    recorded = stored(AnalyzeRequest(**asked(image, answer="blue circle", foil="red", answer_text=ANSWER_TEXT)))
    assert recorded.question == QUESTION
    assert recorded.typed_fields == ("blue circle", "red")
    assert recorded.answer_text == ANSWER_TEXT
    first_token = stored(AnalyzeRequest(**asked(image)))
    assert first_token.typed_fields == ("", "") and first_token.answer_text is None  # empty fields are recorded


def test_each_kinds_controls_read_back(image, mask):
    other = load_image(OTHER_PATH)
    paste = stored(
        CounterfactualRequest(
            **asked(image), mask=mask, fill="paste", paste_from=other, paste_from_path=str(OTHER_PATH)
        )
    )
    assert paste.paste_from == str(OTHER_PATH)
    assert stored(SweepRequest(**asked(image), k=4, fill="blur", radius=2.0)).paste_from is None
    assert stored(GenerateRequest(image=image, question=QUESTION, max_new_tokens=5)).max_new_tokens == 5
    assert stored(GenerateRequest(image=image, question=QUESTION)).max_new_tokens is None

    references = (str(IMAGE_PATH), str(OTHER_PATH))
    mean = stored(
        AblationRequest(
            **asked(image), component="L1.H0", selected_in="attention", ablation="mean", positions="region",
            mask=mask, references=references, reference_set="bundled sample",
        )
    )  # fmt: skip
    assert (mean.component, mean.selected_in, mean.positions) == ("L1.H0", "attention", "region")
    assert mean.reference_images == references and mean.source_image is None
    resample = stored(
        AblationRequest(
            **asked(image), component="L1.mlp", selected_in="dla", ablation="resample", positions="all",
            source_image=other, source_image_path=str(OTHER_PATH),
        )
    )  # fmt: skip
    assert (resample.positions, resample.source_image, resample.reference_images) == ("all", str(OTHER_PATH), ())
    patch = stored(PatchingRequest(**asked(image), source_image=other, source_image_path=None, mask=mask))
    assert patch.source_image is None and patch.component is None  # pixels without a file
    head = stored(NonuniqueRequest(**asked(image), head="L1.H1"))
    assert (head.component, head.selected_in) == ("L1.H1", None)


def test_a_claims_choices_read_back(mask, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    claim = "L1.H1 reads the colour asked about"
    on_file = stored(ValidateRequest(subjects=("L1.H1", "L2.H0"), claim=claim, dataset=str(pairs), n=12, region=mask))
    assert (on_file.typed_subjects, on_file.claim, on_file.dataset) == ("L1.H1, L2.H0", claim, str(pairs))
    assert on_file.n == 12 and on_file.painted_region is True and on_file.question is None
    scenes = stored(ValidateRequest(subjects=("L1.H1",), claim=claim, dataset="scenes", n=30))
    assert scenes.dataset is None and scenes.painted_region is False  # the generated scenes record no file


def test_the_results_own_parameters_read_back_too():
    """A session stores the result's parameters beside the request's: a visual patch names its token sets."""
    recorded = RecordedParameters.from_parameters({"token_sets": {"painted region": [1, 2], "all": [0]}})
    assert recorded.token_sets == ("painted region", "all")


def test_what_is_not_recorded_or_of_another_type_reads_as_not_recorded():
    assert RecordedParameters.from_parameters(None) == RecordedParameters()
    assert RecordedParameters.from_parameters({}) == RecordedParameters()
    assert RecordedParameters.from_parameters([1, 2]) == RecordedParameters()  # not an object
    odd = RecordedParameters.from_parameters(
        {
            "question": 3,
            "typed_target": "blue",  # without its foil: a run of an older session, not the fields as typed
            "max_new_tokens": True,
            "n": "12",
            "positions": ["region"],
            "reference_images": ["a.png", 4],
            "token_sets": ["painted region"],
            "painted_region": "yes",
            "answer_token_ids": [1, 2],  # without the rest of the answer text
        }
    )
    assert odd == RecordedParameters(typed_target="blue")
    assert odd.typed_fields is None
    assert RecordedParameters.from_parameters({"n": 12.0, "max_new_tokens": 5}).n == 12
