"""JAX's pytree definitions, as the artifact files rebuild them.

Checked with jax 0.8.1–0.10.2. `jax.tree_util.PyTreeDef.from_node_data_and_children`
(public API from jax 0.8) rebuilds a definition from a node's type and data and its
children's definitions; jax 0.7.x has no public way to do it, so there loading an
artifact that holds a pytree definition raises `UnsupportedFlaxFeatureError`.
"""

from __future__ import annotations

from flaxlens._compat import Internal

FROM_NODE_DATA_AND_CHILDREN = Internal("jax.tree_util", "PyTreeDef.from_node_data_and_children")
