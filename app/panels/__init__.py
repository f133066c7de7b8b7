"""The side panels of the main window: attention, DLA, lens, counterfactual, audit."""

READ_OUT = "Read out"  # the window's button (and Run menu action, Ctrl+R) that makes a read-out
NO_ANALYSIS = f"no analysis yet: press {READ_OUT}"  # what an empty read-out panel says
