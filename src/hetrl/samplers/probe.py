"""Measured sampler–trainer mismatch of a pool's numerics on a fixed checkpoint.

:func:`probe_mismatch` samples responses with the embedded engine under a pool's numerics
(weights, KV cache and linear-layer activations as the pool stores and computes them), recomputes
every sampled token's log-probability with the exact float32 forward (the trainer's view, no
quantization, one uncached pass over prompt + response), and reduces per token ``t``, with
``d_t = log p(a_t) − log q(a_t)`` (p: float32 recomputation, q: the pool's sampler)::

    abs_dlogp_mean = mean_t |d_t|        abs_dlogp_max = max_t |d_t|
    k3             = mean_t (exp(d_t) − 1 − d_t)     (≈ KL(q‖p) per token; tokens drawn from q)

Sampling is untruncated at temperature 1, so both log-probabilities are over the full vocabulary
(no support replay) and ``k3`` is the project's ``mismatch/k3`` for these rollouts. The same
``seed`` draws the same Gumbel noise in every pool (common random numbers), so pools differ in the
tokens they sample only where their distributions differ. :func:`warmstart_prompts` gives fixed
prompts for a warm-start checkpoint: its suite's held-out tasks as the coding environment shows them.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from hetrl.core.schema import SamplingParams
from hetrl.models.qwen_jax import load_hf
from hetrl.samplers.base import GenerationRequest
from hetrl.samplers.embedded import EmbeddedSampler
from hetrl.samplers.profiles import SamplerNumerics

__all__ = ["probe_mismatch", "warmstart_prompts"]


def probe_mismatch(directory: str | pathlib.Path, numerics: SamplerNumerics, prompts: Sequence[np.ndarray], *,
                   max_new_tokens: int = 32, seed: int = 0, max_batch: int = 16) -> dict[str, float]:
    """``{"abs_dlogp_mean", "abs_dlogp_max", "k3", "tokens"}`` of the pool ``numerics`` against the
    float32 recomputation, over responses (stopping at the checkpoint's eos token or after
    ``max_new_tokens``) to ``prompts`` (int token ids) sampled from the HF checkpoint at
    ``directory``; see the module docstring."""
    sampler = EmbeddedSampler.from_checkpoint(directory, numerics, seed=seed, max_batch=max_batch,
                                              batch_buckets=(max_batch,), head_size=0)
    stop = () if sampler.config.eos_token_id is None else (int(sampler.config.eos_token_id),)
    requests = [GenerationRequest(f"p{i}", np.asarray(p, np.int32), SamplingParams(temperature=1.0), max_new_tokens, stop)
                for i, p in enumerate(prompts)]
    gens = sampler.generate(requests)
    seqs = [np.concatenate([r.prompt_ids, g.token_ids]).astype(np.int32) for r, g in zip(requests, gens)]
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), np.int32)  # right padding: causal attention never reads it
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    graphdef, state = nnx.split(load_hf(directory))
    logp = np.asarray(_float32_logprobs(graphdef, state, ids))
    d = []
    for i, (r, g) in enumerate(zip(requests, gens)):
        n, m = len(r.prompt_ids), len(g.token_ids)
        p = logp[i, n - 1 : n - 1 + m][np.arange(m), g.token_ids]
        d.append(p.astype(np.float64) - np.asarray(g.logprobs, np.float64))
    d = np.concatenate(d)
    return {"abs_dlogp_mean": float(np.mean(np.abs(d))), "abs_dlogp_max": float(np.max(np.abs(d))),
            "k3": float(np.mean(np.expm1(d) - d)), "tokens": int(d.size)}


@functools.partial(jax.jit, static_argnums=0)
def _float32_logprobs(graphdef, state, ids):
    """log-softmax of the exact float32 forward's logits of ``ids [B, L]`` (one compile per
    model structure and shape, shared by every call)."""
    return jax.nn.log_softmax(nnx.merge(graphdef, state)(ids)[0], axis=-1)


def warmstart_prompts(directory: str | pathlib.Path, n: int) -> list[np.ndarray]:
    """The first ``n`` held-out tasks of the suite a warm-start checkpoint (``hetrl warmstart``,
    with its ``warmstart.json``) was trained on, as chat prompts (int32 token ids) with the
    generation prompt, as the coding environment shows them."""
    from tokenizers import Tokenizer

    from hetrl.envs.base import ChatFormat
    from hetrl.envs.coding import CodingEnv, CodingEnvConfig
    from hetrl.envs.tasks_synthetic import synthetic_suite
    from hetrl.warmstart.config import WarmstartConfig
    from hetrl.warmstart.train import RESULT_FILE

    directory = pathlib.Path(directory)
    c = WarmstartConfig.model_validate(json.loads((directory / RESULT_FILE).read_text())["config"])
    chat = ChatFormat.from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    return [np.asarray(chat.encode(CodingEnv(CodingEnvConfig()).reset(t).messages, add_generation_prompt=True), np.int32)
            for t in synthetic_suite(c.suite).heldout[:n]]
