"""What a window shows, read as the panels draw it: the workspace's shown run (the only copy of what is
on screen) and, for a claim (checked on a model, not on the input), the Validation panel's."""


def shown_result(window, *kinds: str):
    """The shown result of the first of ``kinds`` the window shows, or None."""
    if "validate" in kinds:
        run = window.validation_panel.claim_run
        return run.results.get("validate") if run is not None else None
    shown = window.workspace.shown
    results = shown.results if shown is not None else {}
    return next((results[k] for k in kinds if k in results), None)
