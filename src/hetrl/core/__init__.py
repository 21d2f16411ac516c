"""Backend-agnostic core: rollout schema, correction math, precision formats, array binding.

Importing this package imports neither jax nor torch; functions dispatch on the namespace of
the arrays they are given (see :mod:`hetrl.core.xp`).
"""

from hetrl.core import correction, precision, schema, xp
from hetrl.core.correction import PRESETS, CorrectionConfig, LossInputs, correction_preset, policy_loss
from hetrl.core.schema import Rollout, RolloutBatch, RolloutError, SamplerInfo, SamplingParams, SamplingSupport, collate

__all__ = [
    "correction", "precision", "schema", "xp",
    "PRESETS", "CorrectionConfig", "LossInputs", "correction_preset", "policy_loss",
    "Rollout", "RolloutBatch", "RolloutError", "SamplerInfo", "SamplingParams", "SamplingSupport", "collate",
]
