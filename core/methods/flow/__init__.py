"""Information flow: interventions on the routes between positions.

- :mod:`core.methods.flow.positions`: the named position sets an edge or a
  patch is stated in (the image's visual tokens, a painted region's, the
  question's tokens, a word's, the last prompt token, the answer position).
- :mod:`core.methods.flow.knockout`: attention knockout over layer windows,
  every edge from a source set to a target set cut before the softmax on the
  model's own attention path, with rollout's reach beside it.
"""
