"""Parallel techniques applied from outside to ltx-core's single-GPU models.

Each technique is a module of its own with one entry point (``apply_*``), a ``remove_*`` where the
technique changes the model in place, and a docstring that says what it is, when to use it and
what it costs. A technique module knows nothing of the others: ``mgpu_backend.ltx.parallelize``
is the one place that composes them per stage, in a fixed order, and undoes them. All cross-rank
traffic goes through ``comm.Comm``.
"""
