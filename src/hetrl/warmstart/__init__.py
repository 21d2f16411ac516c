"""Warm starts: a tiny policy trained from scratch on solved synthetic tasks (``hetrl warmstart``).

:mod:`~hetrl.warmstart.config` (settings, framework-free), :mod:`~hetrl.warmstart.train` (the
pipeline), :mod:`~hetrl.warmstart.command` (the CLI).
"""
