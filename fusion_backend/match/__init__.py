"""Matching and rewriting: the pattern registry and engine (``engine.py``: precedence order, disjoint
regions, near misses, the rewrite driver) and the graph surgery patterns share (``rewrite.py``).
Pattern families register with ``fusion_backend.match.engine.register_pattern``."""
