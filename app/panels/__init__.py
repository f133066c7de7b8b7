"""The side panels of the main window: attention, DLA, lens, counterfactual, audit."""
