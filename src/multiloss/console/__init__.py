"""What a run says on the console: its config tree (`config_tree`), the third-party noise it silences (`noise`), a
multirun's summary table (`sweep_summary`). Imports nothing heavy: Hydra builds the sweep summary before every run."""
