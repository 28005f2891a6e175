"""flaxlens.extend: the extension points, for those who add a site or a kind of intervention.

`import flaxlens as fl` holds the everyday verbs; this namespace holds what one needs to
teach them something new without editing flaxlens (docs/architecture.md, "Extension
points", works through both):

- **A site object** (a view of calls' values: some heads, some features) implements
  `SiteObject` (it can be captured) and, for each further capability, a smaller protocol:
  `Intervenable` (interventions take it as their site), `Sweepable` (`fl.sweep` sweeps
  its units), `PathPatchable` (`fl.path_patch` takes it). It says which calls it reads
  (`sites_of`, `select_sites`, `Site`) and which `Edit`s they run (`RecordingEdit` for
  edits that record captures through `active_probing`). A tool given a site object without
  the capability it needs refuses it (`refuse_site_object`).
- **A kind of intervention** implements `InterventionKind`: its computation (given an
  `Edited`), its operands' names, what training learns, the operand `where=` may place
  (`Region`), and its folding rule (`Adds`, `Multiplies`, `MapsFeatures`, `Unfoldable`).
  `fl.Intervention(kind=MyKind(), ...)` then runs, is placed, captured, trained and folded
  as the built-in kinds are; `fl.save_interventions` refuses it, so that loading a file
  never runs code of one's own.

The protocols declare; subclassing them is optional. Each is checked with `isinstance`.

Example:
  >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
  >>> from flaxlens import extend
  >>> class Negate:
  ...   name, maker, operand_names = "negate", "Negate", ()
  ...   region, source, fold = None, None, extend.Unfoldable("it negates the value")
  ...   def learned(self, count): return ()
  ...   def compute(self, edited, operands): return -edited.value
  >>> isinstance(Negate(), extend.InterventionKind)
  True
  >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
  >>> variables = model.init(jax.random.key(0), x)
  >>> tree = fl.unflaxify(model, variables, x)
  >>> edit = fl.Intervention(operands=(), where_arrays=(), at="layers_0", kind=Negate())
  >>> _, cache = fl.run(tree, x, interventions=[edit], capture="layers_0")
  >>> hidden = nn.Dense(3).apply({"params": variables["params"]["layers_0"]}, x)
  >>> bool((cache["layers_0"] == -hidden).all())
  True
"""

# isort: off
# Sites and site objects.
from flaxlens.tools.base._sites import Site as Site
from flaxlens.tools.base._sites import sites_of as sites_of
from flaxlens.tools.base._sites import select_sites as select_sites
from flaxlens.tools.base._sites import check_part as check_part
from flaxlens.tools.base._site_objects import SiteObject as SiteObject
from flaxlens.tools.base._site_objects import Intervenable as Intervenable
from flaxlens.tools.base._site_objects import Sweepable as Sweepable
from flaxlens.tools.base._site_objects import PathPatchable as PathPatchable
from flaxlens.tools.base._site_objects import SweepOptions as SweepOptions
from flaxlens.tools.base._site_objects import SweptUnits as SweptUnits
from flaxlens.tools.base._site_objects import PathSites as PathSites
from flaxlens.tools.base._site_objects import refuse_site_object as refuse_site_object

# Edits of a call.
from flaxlens.core._edit import Edit as Edit
from flaxlens.core._edit import RecordingEdit as RecordingEdit
from flaxlens.core._probes import active_probing as active_probing
from flaxlens.core._probes import scan_iterations as scan_iterations

# Kinds of intervention.
from flaxlens.tools.base._kinds import InterventionKind as InterventionKind
from flaxlens.tools.base._kinds import Edited as Edited
from flaxlens.tools.base._kinds import Region as Region
from flaxlens.tools.base._kinds import Adds as Adds
from flaxlens.tools.base._kinds import Multiplies as Multiplies
from flaxlens.tools.base._kinds import MapsFeatures as MapsFeatures
from flaxlens.tools.base._kinds import Unfoldable as Unfoldable
from flaxlens.tools.base._kinds import check_fits as check_fits
# isort: on

__all__ = [
  # Sites and site objects.
  "Site",
  "sites_of",
  "select_sites",
  "check_part",
  "SiteObject",
  "Intervenable",
  "Sweepable",
  "PathPatchable",
  "SweepOptions",
  "SweptUnits",
  "PathSites",
  "refuse_site_object",
  # Edits of a call.
  "Edit",
  "RecordingEdit",
  "active_probing",
  "scan_iterations",
  # Kinds of intervention.
  "InterventionKind",
  "Edited",
  "Region",
  "Adds",
  "Multiplies",
  "MapsFeatures",
  "Unfoldable",
  "check_fits",
]
