"""Edit and read the calls of a tree in one compiled run: interventions as data, captures,
sweeps over sites and values, attribution and gradients at a site."""
