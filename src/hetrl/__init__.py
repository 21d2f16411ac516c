"""hetrl: fully asynchronous RL for LLM policies on a heterogeneous sampler fleet.

See DESIGN.md for the layout. ``hetrl.core`` is framework-free; trainers and samplers live in
their own subpackages and meet in ``hetrl.orchestrator``.
"""

__version__ = "0.1.0"
