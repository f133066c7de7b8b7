"""The request layer: one frozen dataclass per run kind, both what the CLI and the
app fill in and the executor of the run (:mod:`core.requests.base`).

    analyze         AnalyzeRequest          core.analyze.analyze
    generate        GenerateRequest         core.generate.generate
    counterfactual  CounterfactualRequest   core.methods.counterfactual.region_counterfactual
    sweep           SweepRequest            core.methods.counterfactual.occlusion_sweep
    ablation        AblationRequest         core.methods.interventions.run_interventions
    patching        PatchingRequest         core.methods.interventions.patch_visual_features
    nonunique       NonuniqueRequest        core.methods.nonunique.nonunique_of_input
    qk-ov           QkOvRequest             core.methods.qk_ov.qk_ov
    validate        ValidateRequest         core.validate.validate
    knockout        KnockoutRequest         core.methods.flow.knockout.knockout_sweep
    patch-grid      PatchGridRequest        core.methods.flow.patch_grid.patch_grid
    attribution-patching  AttributionPatchingRequest  core.methods.flow.attribution.attribution_patching
    audit           AuditRequest            core.dataset_audit (in one process)

:data:`REQUESTS` maps each name to its class; :class:`RecordedParameters` reads a stored
run's parameters back, typed (:mod:`core.requests.recorded`). Importing this package imports no
torch, numpy or PIL: a request imports the engine inside ``run`` (and ``parameters``
where it reads the engine's names), so that the parser and the window open light.
"""

from __future__ import annotations

from core.requests import (
    ablation,
    analyze,
    attribution,
    audit,
    counterfactual,
    generate,
    knockout,
    nonunique,
    patch_grid,
    patching,
    qk_ov,
    validate,
)
from core.requests.ablation import AblationRequest
from core.requests.analyze import AnalyzeRequest
from core.requests.attribution import AttributionPatchingRequest
from core.requests.audit import AuditRequest
from core.requests.base import (
    REQUESTS,
    TYPED_FOIL,
    TYPED_TARGET,
    AskedRequest,
    Cancel,
    Progress,
    Request,
    register_request,
)
from core.requests.counterfactual import CounterfactualRequest, FillRequest, SweepRequest
from core.requests.generate import GenerateRequest
from core.requests.knockout import KnockoutRequest
from core.requests.nonunique import NonuniqueRequest
from core.requests.patch_grid import PatchGridRequest
from core.requests.patching import PatchingRequest
from core.requests.qk_ov import QkOvRequest
from core.requests.recorded import RecordedParameters
from core.requests.validate import ValidateRequest

# the request modules, one per run kind (imported above so that REQUESTS holds every kind)
MODULES = (
    analyze,
    generate,
    counterfactual,
    ablation,
    patching,
    knockout,
    patch_grid,
    attribution,
    nonunique,
    qk_ov,
    validate,
    audit,
)

__all__ = [
    "MODULES",
    "REQUESTS",
    "TYPED_FOIL",
    "TYPED_TARGET",
    "AblationRequest",
    "AnalyzeRequest",
    "AskedRequest",
    "AttributionPatchingRequest",
    "AuditRequest",
    "Cancel",
    "CounterfactualRequest",
    "FillRequest",
    "GenerateRequest",
    "KnockoutRequest",
    "NonuniqueRequest",
    "PatchGridRequest",
    "PatchingRequest",
    "Progress",
    "QkOvRequest",
    "RecordedParameters",
    "Request",
    "SweepRequest",
    "ValidateRequest",
    "register_request",
]
