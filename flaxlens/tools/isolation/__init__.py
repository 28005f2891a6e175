"""Cut one call out of a run, with the inputs, state and rng it saw, and replay it exactly."""
