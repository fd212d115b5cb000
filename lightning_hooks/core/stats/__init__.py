"""The per-layer statistics, one module each: states, hooks, compute and tags."""
