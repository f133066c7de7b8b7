"""The window's claims half: the Claims tab (a claim about a head or route checked
with the seven-step chain, :func:`core.validate.validate`) and the Attention tab's
actions on the selected head (Non-unique…, QK/OV).

Each is a request (:mod:`core.requests`) run by the window's one request path (a
worker, then the session's record), is recorded in the session with its
audit rows (kinds ``validate``, ``nonunique``, ``qk-ov``) and is restored from the
History. A claim is checked on a model, not on an input: the Claims panel shows
it only while that model is the one picked (another model clears it). The head
actions are about the shown input: their result joins the shown run
(``workspace.add_result``) and a header over it turns amber when the input moves on.
"""

from __future__ import annotations

from app.components import RunInput, RunView
from app.components.selection import is_head
from app.panels.claims_panel import ClaimsPanel
from app.panels.head_methods_panel import HeadMethodsPanel
from app.run_frame import RunFrame
from app.samples import bundled_pairs_file
from app.session_view import HEAD_METHOD_KINDS, restore_claim_choices
from core.requests import NonuniqueRequest, QkOvRequest, ValidateRequest


class ClaimsMixin:
    """Expects the window's ``workspace``, ``selection``, ``model_cache``, ``session``, ``tabs``,
    ``attention_panel``, ``counterfactual_panel``, ``model_picker``, ``_run_request``, ``_asked``,
    ``_made_for``, ``_has_image``, ``is_busy``, ``model_choice``, ``set_model_choice``, ``show_error``,
    ``_refuse_until``, ``_recheck_refusal`` and ``_selected_other_than``.

    Attributes:
        claim_made_for: the model (spec and fingerprint) the shown claim was checked on, or None.
        last_validation, last_head_method: the last results run here (for tests and scripts).
    """

    claim_made_for: RunInput | None = None
    last_validation = None
    last_head_method = None

    def _build_claims_widgets(self) -> None:
        """The Claims panel and the head actions (in the Attention tab, under a header of their own)."""
        self.claims_panel = ClaimsPanel(self.selection)
        self.claims_panel.bundled = bundled_pairs_file().parent
        self.claims_panel.run_requested.connect(self.run_claim)
        self.head_methods = HeadMethodsPanel(self.selection)
        self.head_methods.nonunique_requested.connect(self.run_nonunique)
        self.head_methods.qk_ov_requested.connect(self.run_qk_ov)
        view = RunView(self.workspace, HEAD_METHOD_KINDS, "head methods")
        view.changed.connect(lambda cleared: self.head_methods.clear_result() if cleared else None)
        self.head_methods_frame = RunFrame(self.head_methods, view)
        self.attention_panel.add_side(self.head_methods_frame)
        self.workspace.events.input_changed.connect(self._follow_claim_model)
        panel = self.claims_panel  # a refusal about a field goes once the field is filled (_refuse_until)
        panel.subject_edit.textChanged.connect(self._recheck_refusal)
        panel.claim_edit.textChanged.connect(self._recheck_refusal)
        panel.dataset_combo.currentIndexChanged.connect(self._recheck_refusal)
        panel.region_check.toggled.connect(self._recheck_refusal)

    # ----- Claims --------------------------------------------------------

    def _refuse_claim(self, message: str, met) -> bool:
        """The claim cannot run as stated: the reason in the panel and the error line until ``met()``."""
        return self._refuse_until(self.claims_panel, message, met)

    def run_claim(self) -> bool:
        """Check the Claims panel's claim on its subjects and data in the background; False, with
        the reason in the panel and the error line, when it cannot run as stated."""
        if self.is_busy():
            return False
        panel = self.claims_panel
        subjects, claim, dataset = panel.subjects(), panel.claim(), panel.dataset()
        if not subjects:
            return self._refuse_claim(
                "name a head or route (L1.H1, L1.H0+L1.H1), or select a head in Attention or DLA",
                lambda: bool(panel.subjects()),
            )
        if not claim:
            return self._refuse_claim(
                "state the claim: what the head or route is said to do, and on which inputs",
                lambda: bool(panel.claim()),
            )
        if dataset is None:
            return self._refuse_claim(
                "choose the dataset folder (holding a pairs JSONL), or another dataset",
                lambda: panel.dataset() is not None,
            )
        region = self.counterfactual_panel.mask() if panel.uses_region() else None
        if region is not None and not region.any():
            return self._refuse_claim(
                "painted region: paint one in the Counterfactual tab, or untick its box",
                lambda: not panel.uses_region() or self.counterfactual_panel.mask().any(),
            )
        request = ValidateRequest(
            subjects=tuple(subjects), claim=claim, dataset=dataset, n=panel.n(), n_side=max(1, panel.n() // 3),
            region=region,
        )  # fmt: skip
        asked = self.workspace.input  # as Run was pressed

        def show(validation, _run_id) -> None:
            self.last_validation = validation
            self.claim_made_for = self._made_for(asked)
            panel.show_message("")
            panel.show_validation(validation)

        self._run_request(request, show, failed=self._claim_failed)
        panel.show_message(f"running: the seven-step chain on {', '.join(subjects)}…")
        return True

    def _claim_failed(self, message: str) -> None:
        self.claims_panel.show_message(message, error=True)

    def _follow_claim_model(self, fields: tuple) -> None:
        """Another model picked (or other weights loaded): the claim checked on the previous one goes."""
        made_for = self.claim_made_for
        if made_for is None or not {"model_spec", "model_dtype", "model_device", "model_fingerprint"}.intersection(
            fields
        ):
            return
        now = self.workspace.input
        other_weights = made_for.model_fingerprint and now.model_fingerprint not in (None, made_for.model_fingerprint)
        if made_for.model_choice() != now.model_choice() or other_weights:
            self.claim_made_for = None
            self.claims_panel.clear_result(
                f"the claim shown was checked on {made_for.model_label()}; the model is now "
                f"{now.model_label() if now.model_spec else 'none'}: run it again, or restore it from the History"
            )

    def _restore_claim(self, run) -> bool:
        """Show a recorded ``validate`` run in the Claims tab, its model picked (it has no image)."""
        validation = run.readout  # a core.validate.Validation
        spec = run.model_spec or validation.model
        self.model_picker.setCurrentText(spec)
        dtype, device = self._dtype_and_device_for(spec, run.dtype_and_device)  # as restore_run picks them
        missing = self.set_model_choice(dtype, device)
        if missing:  # a device this machine lacks
            self.show_error("; ".join(missing))
        self.claim_made_for = RunInput(
            model_spec=spec, model_fingerprint=validation.fingerprint or None, model_dtype=dtype, model_device=device
        )
        not_restored = restore_claim_choices(self.claims_panel, run, validation)
        self.claims_panel.show_validation(validation)
        self.claims_panel.show_message(
            not_restored or f"run #{run.id} of {run.created}, restored from the History", error=bool(not_restored)
        )
        if not_restored:
            self.show_error("; ".join([*missing, not_restored]))
        self.history_panel.show_current(run.id)
        self.statusBar().showMessage(f"run #{run.id} ({run.kind}) of {run.created} shown in the Claims tab")
        return True

    # ----- the selected head's actions (Attention tab) ---------------------

    def _selected_head(self) -> str | None:
        """The selected head's name, or None with the reason in the head panel and the error line."""
        selected = self.selection.current
        if selected is None:
            message = "select a head first: Read out, then click a head in Attention (or a head's bar in DLA)"
        elif selected.stale:
            message = f"{selected.name} was selected in another read-out than the one shown: select it again"
        elif not is_head(selected.name):
            message = f"{selected.name} is not an attention head: select a head (L1.H2) in Attention or DLA"
        else:
            return selected.name
        self._refuse_until(self.head_methods, message, self._selected_other_than(selected))
        return None

    def run_nonunique(self) -> bool:
        """Non-unique attention of the selected head on the shown input (off the painted region, or off
        the tokens holding half its image attention); False, with the reason, when nothing runs."""
        if self.is_busy() or not self._has_image():
            return False
        head = self._selected_head()
        if head is None:
            return False
        mask = self.counterfactual_panel.mask()
        mask = mask if mask.any() else None
        asked = self.workspace.input
        region = "painted region" if mask is not None else None
        request = NonuniqueRequest(**self._asked(), head=head, mask=mask, mask_name=region)

        def show(result, run_id: int | None) -> None:
            self.last_head_method = result  # with the head, the region rule, the model and the input
            self.head_methods.show_message("")
            self.head_methods.show_nonunique(result)
            self.workspace.add_result("nonunique", result, run_id, self._made_for(asked))

        self._run_request(request, show, failed=self._head_failed)
        self.head_methods.show_message(f"running: non-unique attention of {head}…")
        return True

    def run_qk_ov(self) -> bool:
        """The selected head's QK / OV circuits: the weight level, and the activation level on the shown
        input; False, with the reason, when nothing runs."""
        if self.is_busy() or not self._has_image():
            return False
        head = self._selected_head()
        if head is None:
            return False
        asked, request = self.workspace.input, QkOvRequest(**self._asked(), head=head)

        def show(result, run_id: int | None) -> None:
            self.last_head_method = result
            self.head_methods.show_message("")
            self.head_methods.show_qk_ov(result)
            self.workspace.add_result("qk-ov", result, run_id, self._made_for(asked))

        self._run_request(request, show, failed=self._head_failed)
        self.head_methods.show_message(f"running: QK / OV of {head}…")
        return True

    def _head_failed(self, message: str) -> None:
        self.head_methods.show_message(message, error=True)

    def _draw_head_method(self, result) -> None:
        """A recorded ``nonunique`` or ``qk-ov`` result (its Readout) in the head panel, its head
        selected in Attention."""
        if result.kind == "qk-ov":
            self.attention_panel.select_head(*result.block_and_head)
            self.head_methods.show_qk_ov(result)
        else:
            if result.block is not None and result.head is not None:
                self.attention_panel.select_head(result.block, result.head)
            self.head_methods.show_nonunique(result)
