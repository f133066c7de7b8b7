"""Attention is not uniquely recoverable from outputs (docs/METHODS.md §4.10).

For one head at one query position the head's output is

    o = sum_j A_j v_j,      v_j = Norm(r_j) W_V^h + b_V^h   (d_head)

(read in the space the rest of the model sees: ``space="write"`` measures
``||(A' - A) V W_O^h||``, i.e. the head's write into the residual stream;
``space="z"`` the o_proj input). Other patterns ``A'`` can give nearly the same
output. This module searches for the ``A'`` that reproduces ``o`` within a
relative tolerance (``||o' - o|| / ||o|| <= tol``) while moving the most mass
off a source set ``S`` (default: the real pattern's argmax key), at three
constraint levels, reported side by side:

* **(a) simplex and mask**: ``A' >= 0``, ``sum A' = 1``, ``A'_j = 0`` on keys
  the model's mask hides. Convex (a linear objective over the simplex cut by
  an ellipsoid): solved by an interior-point method, so the result is an
  achieved ``A'`` *and* a proven bound (weak duality): no pattern within
  tolerance puts less than ``certified_min_source_mass`` on ``S``.
* **(b) bounded scores**: ``A' = softmax(s + delta)`` over the allowed keys,
  ``||delta||_inf <= B`` (logit units) around the model's real pre-softmax
  scores ``s``. Non-convex: a local search (penalty continuation with Adam
  and analytic gradients), so the moved mass is achieved, not a maximum; the
  bound alone (ignoring the output) caps what can be removed, and that cap
  is reported as the proven bound.
* **(c) legal query**: keys fixed as the model computed them, ``A' =
  softmax(score_transform(q' . k_j * scale))``. ``c-query`` optimises the
  post-rotation query ``q'`` freely and then checks whether any residual can
  produce it (``Norm(r)`` has a fixed RMS, so the reachable queries fill an
  ellipsoid, :class:`QueryMap`: ``query_reachable``); ``c-residual``
  searches only the reachable queries and returns a residual ``r'`` (with the
  real residual's RMS) whose query, recomputed through the real norm,
  ``W_Q``/``b_Q`` and the position rotation, gives the reported ``A'``.

Every level contains A itself (a: A; b: delta = 0; c: the real query), and
every search starts there, so the reported ``A'`` is never worse than A and
``start_error`` says how exactly each level reproduces A.

What this can say: whether a claim needs the *pattern's reality* (A is the
computed variable of the graph, true on this input whatever this finds) or
only the *output* (if an equally good output exists with the mass elsewhere,
the output alone does not show that the head needs this routing). What it
cannot say: which pattern the model "should" use, or that the source set
causes the answer (interventions do that).

The package, lowest first: ``query_map`` (level c's geometry: the query of a
residual through the norm, W_Q, b_Q and rotation; :class:`QueryMap`),
``problem`` (:class:`HeadProblem`, :func:`head_problem`), ``results``
(:class:`LevelResult`, :class:`NonuniqueResult`, their sentences and audit
row), ``local_search`` (the penalty continuation levels b and c share),
``level_a``, ``level_b``, ``level_c``, ``search`` (:func:`solve`,
:func:`nonunique_attention`) and ``of_input`` (:func:`nonunique_of_input`: one head
on one image and question, the command's and the app's call); every public name is
re-exported here.
"""

from core.methods.nonunique.of_input import TOP_TOKENS_RULE, nonunique_of_input, region_keys
from core.methods.nonunique.problem import HeadProblem, head_problem, visual_token_keys, with_values
from core.methods.nonunique.query_map import QueryMap
from core.methods.nonunique.results import DOES_NOT_SAY, LEVEL_NAMES, LevelResult, NonuniqueResult
from core.methods.nonunique.search import nonunique_attention, solve

__all__ = [
    "DOES_NOT_SAY",
    "LEVEL_NAMES",
    "HeadProblem",
    "LevelResult",
    "NonuniqueResult",
    "QueryMap",
    "TOP_TOKENS_RULE",
    "head_problem",
    "nonunique_attention",
    "nonunique_of_input",
    "region_keys",
    "solve",
    "visual_token_keys",
    "with_values",
]
