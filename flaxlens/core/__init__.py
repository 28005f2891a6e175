"""The framework-neutral runtime: structs, variables, layers, selectors, call nodes and
their dispatch, running and isolating trees, and the interface adapters implement."""
