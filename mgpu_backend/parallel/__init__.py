"""Parallel techniques applied from outside to ltx-core's single-GPU models.

Each technique is a module of its own with one entry point (``apply_*``) and a docstring that says
what it is, when to use it and what it costs. All cross-rank traffic goes through ``comm.Comm``.
"""
