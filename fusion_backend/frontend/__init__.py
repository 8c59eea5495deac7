"""The front end: Dynamo's FX nodes, however the user spelled them, become canonical ops.

``canonical.py`` defines the canonical op types (``Conv``, ``Pointwise``, ``Pool``, ``GlobalReduce``,
``BatchNorm``, ``Opaque``); ``normalize.py`` maps every supported spelling (modules, functionals,
methods, in-place variants, ``operator`` calls) onto them.  Patterns read only canonical ops.
"""
