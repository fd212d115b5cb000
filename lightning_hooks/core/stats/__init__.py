"""One module per per-layer statistic: its states, hooks, compute and tags."""
