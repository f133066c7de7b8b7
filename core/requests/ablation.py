"""The ablation request: remove or replace one component's write and re-run
(``vlm-readout ablate``, the Interventions box's Ablate).

The component is named as the read-outs name it (``L1.H2``, ``L1.mlp``, ``L1``:
:func:`core.methods.component_ablation.parse_component`); the ablation is
``zero``, ``mean`` (over reference images asked the same question) or
``resample`` (its value on one other image), at the answer position read out,
every position, or the painted region's visual tokens. The numbers are read at
the answer token read out (``answer_text``: teacher forcing), with the answer and
foil as typed (:meth:`AskedRequest.tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, never_cancelled, no_progress, register_request

if TYPE_CHECKING:
    from PIL import Image

    from core.methods.interventions import InterventionResult

# the word of each ablation in a result row's label ("L1.H2 zeroed at the answer position")
ABLATION_WORDS = {"zero": "zeroed", "mean": "mean-ablated", "resample": "resampled"}


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the mask is an array
class AblationRequest(AskedRequest):
    """Ablate ``component`` in the run of the asked image and question.

    Attributes:
        component: the engine's name (``L1.H2``, ``L1.mlp``, ``L1``).
        selected_in: the app's view it was selected in (``attention``, ``dla``, ``lens``; None: typed, the CLI).
        ablation: ``zero``, ``mean`` or ``resample``.
        positions: ``target`` (the answer position), ``all`` or ``region`` (the painted region's visual tokens).
        mask: ``(H, W)`` bool, the painted region (``region`` only).
        references: ``mean``: the reference images (paths), each asked the same question.
        reference_set: ``mean``: what they are ("bundled samples"; "" for a list given by hand).
        source_image: ``resample``: the other image's pixels, asked the same question.
        source_image_path: the file ``source_image`` was read from (None: pixels without a file).
    """

    name: ClassVar[str] = "ablation"

    component: str
    selected_in: str | None = None
    ablation: str = "zero"
    positions: str = "target"
    mask: Any = None
    references: tuple[str, ...] = ()
    reference_set: str = ""
    source_image: Image.Image | None = None
    source_image_path: str | None = None

    def __post_init__(self) -> None:
        """The choices that contradict each other are refused here, before any model runs
        (one line each; an unknown kind or positions names the ones there are)."""
        from core.errors import InterventionError
        from core.methods.component_ablation import KINDS, POSITIONS

        if self.ablation not in KINDS:
            raise InterventionError(f"ablation {self.ablation!r}: expected one of {', '.join(KINDS)}")
        if self.positions not in POSITIONS:
            raise InterventionError(f"positions {self.positions!r}: expected one of {', '.join(POSITIONS)}")
        if (self.mask is not None) != (self.positions == "region"):
            raise InterventionError("the painted region (a mask) goes with positions 'region', and only with it")
        if self.ablation == "mean" and not self.references:
            raise InterventionError("mean ablation needs reference images (each asked the same question)")
        if self.ablation != "mean" and self.references:
            raise InterventionError("reference images go with the mean ablation")
        if (self.ablation == "resample") != (self.source_image is not None):
            raise InterventionError("resample ablation needs a source image, and only it takes one")

    def ablation_parameters(self) -> dict[str, Any]:
        """What the ablation asks beyond the input: the component, the view it was selected in,
        the kind, the positions, and the mean's references or the resample's source image. The
        result holds them too (its parameters and audit row: :meth:`run`)."""
        from core.files.images import image_sha256

        asked = {
            "component": self.component.strip(),  # as parse_component names it
            "selected_in": self.selected_in,
            "ablation": self.ablation,
            "positions": self.positions,
        }
        if self.ablation == "mean":
            asked.update(
                reference_set=self.reference_set,
                n_references=len(self.references),
                reference_images=[str(r) for r in self.references],
            )
        elif self.ablation == "resample":
            asked.update(source_image=self.source_image_path, source_image_sha256=image_sha256(self.source_image))
        return asked

    def parameters(self) -> dict[str, Any]:
        return {**self.asked_parameters(), **self.ablation_parameters()}

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> InterventionResult | None:
        """Ablate (:func:`core.methods.component_ablation.ablation_edits`) and re-run
        (:func:`core.methods.interventions.run_interventions`). Mean ablation captures each
        reference image asked the same question, with the same answer tokens before the one
        read (cancellable between them: None when cancelled); resample captures the source once."""
        from core.files.images import load_image
        from core.forward.capture import capture
        from core.forward.geometry import painted_tokens
        from core.methods.component_ablation import ablation_edits, mixer_modules, parse_component
        from core.methods.interventions import run_interventions

        progress, cancel = progress or no_progress, cancel or never_cancelled
        adapter, prefix = loaded.adapter, self.answer_prefix

        def capture_of(image):
            inputs = adapter.prepare([image], [self.question], answer_prefix=prefix)
            return capture(loaded, None, "", pattern_layers=[], inputs=inputs), inputs

        base, inputs = capture_of(self.image)
        component = parse_component(self.component, base.block_names, mixer_modules(adapter))
        region = painted_tokens(adapter.visual_tokens(self.image.size), self.mask) if self.positions == "region" else []
        asked = self.ablation_parameters()
        # the result's parameters and audit row, in the order the app has always recorded them
        parameters = {
            "answer_prefix_ids": [int(t) for t in prefix],
            **{k: asked.pop(k) for k in ("component", "selected_in", "ablation", "positions")},
            **({"region_tokens": region} if self.positions == "region" else {}),
            **asked,
        }
        controls, references, source = [], [], None
        if self.ablation == "mean":
            n = len(self.references)
            for i, path in enumerate(self.references):
                if cancel():
                    return None
                progress(i, n + 1, f"reference {i + 1}/{n} for the mean…")
                references.append(capture_of(load_image(path))[0])
            of = f" ({self.reference_set})" if self.reference_set else ""
            controls.append(f"mean over {n} reference runs{of} asked the same question")
        elif self.ablation == "resample":
            source = capture_of(self.source_image)[0]
            controls.append("the component's value on one other image asked the same question (resample)")
        edits = ablation_edits(
            adapter,
            base,
            component,
            kind=self.ablation,
            positions=self.positions,
            region_tokens=region,
            references=references,
            source=source,
        )
        answer_id, foil_id = self.token_ids(adapter, base)
        where = {
            "target": "at the answer position",
            "all": "at every position",
            "region": f"at the painted region ({len(region)} visual tokens)",
        }[self.positions]
        label = f"{component.name} {ABLATION_WORDS[self.ablation]} {where}"
        progress(len(references), len(references) + 1, f"{label}…")
        return run_interventions(
            loaded,
            inputs,
            {label: edits},
            answer_id,
            foil_id,
            base=base,
            controls=controls,
            parameters=parameters,
            cancel=cancel,
        )
