"""One module per family of rules. Importing this package declares every rule; the
order of the imports is the order of the catalogue, so it is kept by hand."""

# isort: skip_file
from . import scaled as scaled
from . import straight_through as straight_through
from . import stop_gradient as stop_gradient
from . import gradient as gradient
