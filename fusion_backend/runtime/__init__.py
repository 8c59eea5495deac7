"""What runs a rewritten graph and decides whether it should be rewritten at all.

``decision.py`` keeps a rewrite only where the fused op beats Inductor's code for its region (timed
by ``region_timing.py``, cached on disk); ``direct.py`` runs graphs of only fused ops and glue
without AOTAutograd or Inductor.
"""
