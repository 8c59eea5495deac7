"""Built-in pattern families.  Importing this package registers each with the engine.

One module per family; a family is a ``fusion_backend.match.engine.Pattern`` subclass decorated with
``register_pattern``.  Third-party families register the same way from their own modules.
"""

from . import (  # noqa: F401
    conv_batch_norm,
    conv_channel_reduce,
    conv_epilogue,
    conv_global_mean,
    conv_group_norm,
    conv_layer_norm,
)
