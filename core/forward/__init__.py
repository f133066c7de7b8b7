"""One run of the model: the capture (hooks, attention rows, edits) and the visual-token geometry."""
