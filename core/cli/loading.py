"""Loading the model a command line names (:func:`load_from_args`)."""

from __future__ import annotations

import sys
import warnings


def load_from_args(args):
    """The model of ``--model`` (with the options of
    :func:`core.cli.args.add_model_args`: ``--device``, ``--dtype``, ...); each warning of the load
    (unexpected tensors in the weights, ...) is one ``warning: ...`` line on
    stderr."""
    # function-local: core.models.loading imports torch and transformers, and this
    # module is imported while the parser is built
    from core.models.loading import ModelLoadWarning, load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ModelLoadWarning)  # printed below, one line each
        loaded = load_model(
            args.model,
            device=args.device,
            dtype=args.dtype,
            allow_pickle=args.allow_pickle,
            trust_remote_code=args.trust_remote_code,
            allow_download=args.allow_download,
        )
    for note in loaded.info.get("warnings", []):
        print(f"warning: {' '.join(str(note).split())}", file=sys.stderr)
    return loaded
