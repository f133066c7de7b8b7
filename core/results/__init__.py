"""The result vocabulary (readout: Target, Readout, RESULT_TYPES) and the audit rows with their tables."""
