"""Core data model: structs, variables, layers, random streams, selectors."""
