"""Every rule eqxrules ships, one small module per family.

Importing a family defines its rules, and defining a rule registers it: the order of
the imports below is the order of the catalogue. What this package exports (each
rule class and its functional form) is read from the catalogue, so adding a rule
needs no edit here.
"""

# isort: skip_file
from . import scaled as scaled
from . import sign as sign
from . import quantize as quantize
from . import learned as learned
from . import floats as floats
from . import blocks as blocks
from . import nvfp4 as nvfp4
from . import fine_grained as fine_grained
from . import straight_through as straight_through
from . import categorical as categorical
from . import stop_gradient as stop_gradient
from . import gradient as gradient
from . import safe_norms as safe_norms
from . import safe_angles as safe_angles
from . import safe_masks as safe_masks
from . import safe_softmax as safe_softmax
from . import safe_eigh as safe_eigh
from .._registry import library_names

globals().update(library_names())
__all__ = list(library_names())  # pyright: ignore[reportUnsupportedDunderAll]
