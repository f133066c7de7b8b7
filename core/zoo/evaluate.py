"""Accuracy of a model on held-out synthetic scenes, per question kind.

``vlm-readout evaluate-zoo --model shapes-llava --n 2000 --json OUT`` (the
command is :mod:`core.cli.evaluate_zoo`) runs the model through the public path
(``load_model`` + the model's own processor) on samples ``0..n-1`` of the
``heldout`` split, whose seeds training never reads, and reports exact-match
accuracy per question kind and per template. The numbers in each model card
come from this command.
"""

from __future__ import annotations

import numpy as np

from core.zoo import scenes

# The accuracy each question kind must reach (issue 2's bars).
BARS = {"attribute": 0.95, "exist": 0.95, "count": 0.90, "relation": 0.90}


def _sampler(split: str, renderer: str):
    if renderer == "alt":
        from core.zoo.altrender import make_alt_sample

        return make_alt_sample
    if renderer != "main":
        raise ValueError(f"unknown renderer {renderer!r}: main or alt")
    return lambda i: scenes.make_sample(split, i)


def evaluate(
    loaded, n: int = 2000, split: str = "heldout", batch_size: int = 50, progress=None, renderer: str = "main"
) -> dict:
    """Per-kind and per-template exact-match accuracy on ``n`` samples.

    ``renderer="alt"`` draws the scenes with the independent renderer of
    :mod:`core.zoo.altrender` (its own seeds; ``split`` is ignored).
    """
    from core.answer import answer_batch

    make = _sampler(split, renderer)

    hits: dict[str, list[int]] = {}
    by_template: dict[str, list[int]] = {}
    by_objects: dict[int, list[int]] = {}
    for start in range(0, n, batch_size):
        samples = [make(i) for i in range(start, min(n, start + batch_size))]
        answers = answer_batch(
            loaded, [s.image for s in samples], [s.question for s in samples], top_k=1, batch_size=batch_size
        )
        for s, a in zip(samples, answers):
            ok = int(a.answer == s.answer)
            hits.setdefault(s.kind, []).append(ok)
            by_template.setdefault(s.template, []).append(ok)
            by_objects.setdefault(len(s.objects), []).append(ok)
        if progress is not None:
            progress(min(n, start + batch_size), n)
    table = {
        k: {
            "accuracy": float(np.mean(v)),
            "n": len(v),
            "bar": BARS.get(k),
            "meets_bar": bool(np.mean(v) >= BARS.get(k, 0)),
        }
        for k, v in sorted(hits.items())
    }
    return {
        "schema_version": 1,
        "model": loaded.spec,
        "fingerprint": loaded.fingerprint,
        **loaded.adapter.dtype_and_device(),  # what the accuracies were computed in
        "split": split if renderer == "main" else "alt-renderer",
        "renderer": renderer,
        "n": n,
        "overall": float(np.mean([x for v in hits.values() for x in v])),
        "by_kind": table,
        "by_template": {k: {"accuracy": float(np.mean(v)), "n": len(v)} for k, v in sorted(by_template.items())},
        "by_objects": {str(k): {"accuracy": float(np.mean(v)), "n": len(v)} for k, v in sorted(by_objects.items())},
    }


def markdown_table(result: dict) -> str:
    rows = ["| question kind | accuracy | n | bar |", "|---|---|---|---|"]
    for k, v in result["by_kind"].items():
        mark = "met" if v["meets_bar"] else "**missed**"
        rows.append(f"| {k} | {v['accuracy']:.4f} | {v['n']} | {v['bar']:.2f} ({mark}) |")
    rows.append(f"| overall | {result['overall']:.4f} | {result['n']} | |")
    return "\n".join(rows)
