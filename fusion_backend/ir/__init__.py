"""The vocabulary every layer shares, importing nothing else of the package: the kernels, the fused
ops and the pattern layer all take their shape arithmetic from here (``shapes``)."""
