"""The optimizer: global-norm clipping, then AdamW on a warmup (+ linear or cosine decay) schedule.

Update for gradient g at step t (0-based), with ``η_t`` from :func:`learning_rate_schedule`:
``g ← g · min(1, c / ‖g‖₂)`` (global norm over all parameters, ``c = grad_clip``), then AdamW
``m ← β1 m + (1−β1) g``, ``v ← β2 v + (1−β2) g²``, ``θ ← θ − η_t (m̂ / (√v̂ + ε) + λ θ)`` with
bias-corrected ``m̂, v̂``; λ applies to matrices only unless ``decay_vectors``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from hetrl.core.training import OptimizerConfig

__all__ = ["learning_rate_schedule", "make_optimizer"]


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """``η_t = η · min(1, (t+1)/W) · d_t`` with W = ``warmup_steps`` (no warmup factor when 0),
    ``d_t = 1`` (constant), or with ``x = clip((t−W)/(T−W), 0, 1)`` and ``r = η_min/η``
    (``min_learning_rate / learning_rate``), ``T = decay_steps``: ``d_t = r + (1−r)·(1 − x)``
    (linear) or ``d_t = r + (1−r)·½(1 + cos(π·x))`` (cosine). The first step already moves."""
    lr, warmup = config.learning_rate, config.warmup_steps
    r = config.min_learning_rate / lr

    def schedule(step):
        t = jnp.asarray(step, jnp.float32)
        rate = jnp.asarray(lr, jnp.float32)
        if warmup:
            rate = rate * jnp.minimum(1.0, (t + 1.0) / warmup)
        if config.schedule != "constant":
            progress = jnp.clip((t - warmup) / (config.decay_steps - warmup), 0.0, 1.0)
            left = 1.0 - progress if config.schedule == "linear" else 0.5 * (1.0 + jnp.cos(math.pi * progress))
            rate = rate * (r + (1.0 - r) * left)
        return rate

    return schedule


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` (if set) chained with AdamW on the schedule."""
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(config),
        b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
        mask=None if config.decay_vectors else (lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)),
    )
    if config.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
