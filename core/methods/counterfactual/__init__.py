"""Region counterfactuals (docs/METHODS.md §4.12, §4.11): fill a pixel region of the
ORIGINAL image, run the edited image through the model's own processor and
forward, and report what happened to the answer, with the routing read-outs
for the same region beside it.

* A region is an ``(H, W)`` bool mask on the original image (``True`` = in the
  region): :func:`mask_from_box`, :func:`mask_from_polygon`,
  :func:`mask_from_png` (white = region), :func:`mask_from_scene_object`.
* Fills (:class:`Fill`): ``mean`` (the image's mean colour), ``constant``,
  ``blur`` (Gaussian, sigma = ``radius`` px), ``noise`` (seeded i.i.d.
  Gaussian with the image's per-channel mean and std), ``inpaint`` (harmonic:
  the region solves Laplace's equation with the surrounding pixels as
  boundary values), ``paste`` (the same region of another image, resized to
  this one). Every fill changes the region's pixels only; the rest of the
  image stays bit-identical.
* Answer effect (:class:`AnswerEffect`): change in the answer logit, in the
  answer-minus-foil logit difference, in the answer probability, and whether
  the argmax changed; with the original and edited values.
* Routing (:class:`RegionRouting`), read from ONE capture of the original
  image: the answer row's attention mass on the visual tokens that overlap the
  region, each token weighted by ``area(token box & mask) / area(token box)``;
  rollout mass weighted the same way; and frozen-scale DLA through those
  tokens (:func:`core.methods.contributions.source_contributions`, summed over
  blocks and heads, weighted the same way). These show routing and the direct
  write only: the counterfactual is the causal read-out.
* :func:`region_agreement`: over many regions of one image, how well
  attention-on-region predicts the causal drop (Spearman and Pearson), and the
  regions where they disagree most.
* :func:`occlusion_sweep`: every patch (or k x k block of patches) filled in
  turn, batched; a patch-grid map of the answer effect. An interpolated map
  exists only on request (:meth:`OcclusionMap.interpolated`) and always carries
  ``interpolated: "visual smoothing, not a causal pixel mask"``.
* :func:`object_fill_effects`: the target-versus-distractor check on synthetic
  scenes with ground-truth masks (the scenes:
  :func:`core.zoo.distractor_scenes.scenes_with_distractor`).

The package, lowest first: ``regions`` (masks), ``fills``, ``effect`` (answer
numbers, routing, one region, many regions), ``sweep`` (occlusion) and
``objects`` (target versus distractor); every public name is re-exported here.
"""

from core.methods.counterfactual.effect import (
    DLA_CONVENTION,
    SCHEMA_VERSION,
    TOKEN_WEIGHT,
    AnswerEffect,
    Cancel,
    HeadMass,
    Progress,
    RegionAgreement,
    RegionCounterfactual,
    RegionRouting,
    RegionRow,
    TokenRouting,
    answer_effect,
    answer_logits,
    answer_numbers,
    counterfactual_audit,
    overlap_weights,
    region_agreement,
    region_counterfactual,
    resolve_tokens,
    token_routing,
)
from core.methods.counterfactual.fills import (
    FILLS,
    IN_MEMORY_SOURCE,
    Fill,
    as_fill,
    fill_region,
    gaussian_blur,
    harmonic_inpaint,
    mean_color,
)
from core.methods.counterfactual.objects import ObjectFillEffects, closest_area_distractor, object_fill_effects
from core.methods.counterfactual.regions import (
    RegionError,
    check_mask,
    mask_from_box,
    mask_from_boxes,
    mask_from_png,
    mask_from_polygon,
    mask_from_scene_object,
)
from core.methods.counterfactual.sweep import (
    INTERPOLATED_FLAG,
    InterpolatedHeatmap,
    OcclusionMap,
    occlusion_sweep,
    sweep_cells,
)
from core.methods.stats import pearson, spearman  # re-exported: region_agreement's correlations

__all__ = [
    "SCHEMA_VERSION",
    "FILLS",
    "INTERPOLATED_FLAG",
    "TOKEN_WEIGHT",
    "DLA_CONVENTION",
    "Progress",
    "Cancel",
    "RegionError",
    "check_mask",
    "mask_from_box",
    "mask_from_polygon",
    "mask_from_png",
    "mask_from_scene_object",
    "mask_from_boxes",
    "gaussian_blur",
    "harmonic_inpaint",
    "Fill",
    "IN_MEMORY_SOURCE",
    "mean_color",
    "as_fill",
    "fill_region",
    "AnswerEffect",
    "answer_numbers",
    "answer_effect",
    "resolve_tokens",
    "answer_logits",
    "overlap_weights",
    "TokenRouting",
    "RegionRouting",
    "HeadMass",
    "token_routing",
    "counterfactual_audit",
    "RegionCounterfactual",
    "region_counterfactual",
    "pearson",
    "spearman",
    "RegionRow",
    "RegionAgreement",
    "region_agreement",
    "sweep_cells",
    "InterpolatedHeatmap",
    "OcclusionMap",
    "occlusion_sweep",
    "closest_area_distractor",
    "ObjectFillEffects",
    "object_fill_effects",
]
