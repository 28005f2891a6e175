"""The way back to Flax: fold interventions into weights, check a tree against a native
model, save and load exported variables."""
