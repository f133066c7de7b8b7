"""Functional labels and the validation chain (docs/METHODS.md §4.5, §4.11).

A functional label ("moves the asked colour from the target object to the
answer position") is a behaviour summary measured on a distribution, never an
architectural type. So a :class:`Label` is always stored with its
:class:`InputCondition` (dataset, split, templates, kinds, filters, n, seeds)
and refuses to exist without one.

The evidence for a label is a :class:`ValidationChain`: the seven steps of
4.11 as a checklist per candidate head or route, each step with its measured
evidence (numbers, n, the held-out split), its status (``passed`` / ``failed`` /
``not tested``) and the baselines it was compared with (a matched random head,
the other heads of the same layer, entropy-matched heads, position
baselines). :meth:`ValidationChain.status` turns the checklist into one of
:data:`CHAIN_STATUSES` with the reason:

* steps 1-4 pass -> ``mechanism candidate`` (observation only);
* and step 5 passes -> ``candidate with intervention``;
* and steps 6 and 7 pass -> ``supported``. Nothing less is shown as supported.

What the steps test is derived from the claim's specification
(:mod:`.spec`, :class:`ClaimSpec`): its query and source positions, located on
each input by :mod:`.relations`, its pattern relation, content claim,
counterfactual and predicted effect. The shipped ones (:data:`SHIPPED`:
attribute-moving, object-name-copying, previous-token, induction,
sink-delimiter) run on the synthetic shape scenes (:mod:`core.zoo.scenes`),
whose ground-truth object masks make the visual relations checkable; the
candidates are found on one split (``val``) and tested on another
(``heldout``). Conventions: ``S`` is the logit difference of the relation's
answer and foil at its query (the dataset's answer minus foil at the answer
position, or the copied token minus a foil word); DLA is the
frozen-final-norm-scale DLA of :mod:`core.methods.contributions`; ablations
edit the head's ``z`` at the query only (the write the claim is about),
through :class:`core.forward.edits.Edit`.

A subject is a head (:class:`HeadRef`) or a route (:class:`RouteRef`: several
heads of one block taken together, for a function the heads of a block share):
every step runs on either; :func:`find_routes` proposes the routes worth
testing, and a route's baselines are routes of the same size
(:class:`BaselinePlan`).

The package, lowest first: :mod:`.chain` (the chain model), :mod:`.stats`,
:mod:`.spec` (claim specifications), :mod:`.setting` (pass rules, subjects),
:mod:`.samples` (what the chain reads of one input), :mod:`.relations` (where a
relation is read on it), :mod:`.power`, :mod:`.observations`, :mod:`.context`
(:class:`ChainContext`, baselines), :mod:`.steps` (the seven steps,
:func:`run_chain`) and :mod:`.candidates`. What draws the scenes
(:func:`scene_samples`, :func:`swap_attribute`, :func:`attribute_context`)
lives beside them in :mod:`core.zoo.label_scenes`: core.methods does not
import the zoo. The command and its library call, which read any dataset
into the chain, are :mod:`core.validate` and ``vlm-readout validate``.
"""

from core.methods.validation.candidates import find_candidates, find_routes
from core.methods.validation.chain import (
    BASELINE_KINDS,
    CHAIN_STATUSES,
    SCHEMA_VERSION,
    STEP_STATUSES,
    STEP_TITLES,
    Baseline,
    ChainStatus,
    ChainStep,
    InputCondition,
    Label,
    LabelError,
    ValidationChain,
)
from core.methods.validation.context import BaselinePlan, ChainContext
from core.methods.validation.observations import (
    ChainCancelled,
    HeadObservations,
    RunNumbers,
    SwapObservations,
    head_edit,
    mean_ablation_value,
    observe_counterfactuals,
    observe_heads,
    observe_swaps,
    run_edited,
    z_norms,
)
from core.methods.validation.relations import Counterfactual, Row, Unreadable, locate
from core.methods.validation.samples import ChainSample, RegionObject, SwapScene
from core.methods.validation.setting import (
    ATTRIBUTE_TEMPLATES,
    CRITERIA,
    FOLLOW_RATE_MIN,
    HIT_P_MAX,
    HIT_RATIO_MIN,
    PREDICT_R_MIN,
    REGION_MIN_COVER,
    RELATION,
    SIDE_KINDS,
    HeadRef,
    RouteRef,
    Subject,
    relation_heads,
    text_heads,
    visual_heads,
)
from core.methods.validation.spec import SHIPPED, ClaimSpec, SpecError
from core.methods.validation.steps import (
    STEP_FUNCTIONS,
    run_chain,
    step1_pattern,
    step2_content,
    step3_prediction,
    step4_swap,
    step5_ablation,
    step6_baselines,
    step7_side_effects,
)

__all__ = [
    "ATTRIBUTE_TEMPLATES",
    "BASELINE_KINDS",
    "CHAIN_STATUSES",
    "CRITERIA",
    "FOLLOW_RATE_MIN",
    "HIT_P_MAX",
    "HIT_RATIO_MIN",
    "PREDICT_R_MIN",
    "REGION_MIN_COVER",
    "RELATION",
    "SCHEMA_VERSION",
    "SHIPPED",
    "SIDE_KINDS",
    "STEP_FUNCTIONS",
    "STEP_STATUSES",
    "STEP_TITLES",
    "Baseline",
    "BaselinePlan",
    "ChainCancelled",
    "ChainSample",
    "ChainContext",
    "ChainStatus",
    "ChainStep",
    "ClaimSpec",
    "Counterfactual",
    "HeadObservations",
    "HeadRef",
    "InputCondition",
    "Label",
    "LabelError",
    "RegionObject",
    "RouteRef",
    "Row",
    "RunNumbers",
    "SpecError",
    "Subject",
    "SwapObservations",
    "SwapScene",
    "Unreadable",
    "ValidationChain",
    "find_candidates",
    "find_routes",
    "head_edit",
    "locate",
    "mean_ablation_value",
    "observe_counterfactuals",
    "observe_heads",
    "observe_swaps",
    "run_chain",
    "run_edited",
    "step1_pattern",
    "step2_content",
    "step3_prediction",
    "step4_swap",
    "step5_ablation",
    "step6_baselines",
    "step7_side_effects",
    "relation_heads",
    "text_heads",
    "visual_heads",
    "z_norms",
]
