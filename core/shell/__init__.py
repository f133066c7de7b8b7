"""The process around the engine: command-line arguments, the terminal, the network switches, lazy names, dtypes."""
