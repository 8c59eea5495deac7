"""Built-in pattern families.  Importing this package registers each with the engine.

One module per family; a family is a ``fusion_backend.match.engine.Pattern`` subclass decorated with
``register_pattern``.  Third-party families register the same way from their own modules.

The families are imported, and so registered, in the order they take a conv within one precedence
tier (``match.engine.Precedence``): ``conv_global_mean`` first, whose algebraic route never writes the
conv output; then the norm families and the reduction over the channels, which claim different ops
(their regions never share a conv, so their order only fixes the order of the regions and which near
miss of a conv is reported); ``conv_epilogue``, the plain chain, is a tier of its own below them all,
and ``batch_norm_conv``, which takes the norm and activation a conv reads, one above them all.
``attention`` claims no conv (its regions are attention calls), so its place orders nothing.
"""

# isort: off
from . import batch_norm_conv  # noqa: F401
from . import conv_global_mean  # noqa: F401
from . import conv_group_norm  # noqa: F401
from . import conv_layer_norm  # noqa: F401
from . import conv_batch_norm  # noqa: F401
from . import conv_channel_reduce  # noqa: F401
from . import conv_epilogue  # noqa: F401
from . import attention  # noqa: F401
# isort: on
