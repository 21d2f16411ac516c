"""Helpers of the JAX-trainer tests, and a worker run in subprocesses (fake-device meshes,
multi-process runs, fresh-process restores), since XLA_FLAGS and jax.distributed must be set
before JAX starts.

    python tests/trainer_jax_worker.py sharded   CKPT BATCH OUT
    python tests/trainer_jax_worker.py multihost CKPT BATCH OUT PROCESS_ID NUM_PROCESSES PORT
    python tests/trainer_jax_worker.py resume    CKPT RUN_DIR OUT

Outputs are safetensors files: the exported HF weights plus ``loss`` (and ``loss.<mesh>``).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from factories import log_softmax, random_rollout, truncated_distribution
from hetrl.core.schema import Rollout, RolloutBatch, SamplingParams, SamplingSupport, collate

TRAIN_CONFIG = dict(
    compute_dtype="fp32",
    correction_preset="hetrl",
    optimizer=dict(learning_rate=1e-3, eps=1e-3, weight_decay=0.01, grad_clip=1.0),
)
RESUME_CONFIG = dict(
    compute_dtype="fp32",
    correction_preset="tis",
    optimizer=dict(learning_rate=1e-3, warmup_steps=2, weight_decay=0.01),
)
"""Trainer specs: the :class:`JaxTrainerConfig` keys plus ``correction_preset`` /
``correction_overrides`` and ``checkpoint``, which :func:`make_trainer` passes beside it."""
NUM_PROMPTS = 10
MESHES = {"2x2x1": (2, 2, 1), "1x2x2": (1, 2, 2)}


# ====================================================================== rollouts matched to a model
def _sampling(kept: bool, rng: np.random.Generator) -> SamplingParams:
    if kept:
        return SamplingParams(temperature=float(rng.choice([0.8, 1.0])), top_p=0.9, top_k=8)
    return SamplingParams(temperature=1.0, top_p=1.0, top_k=0)


def model_matched_batch(logits_fn, vocab: int, seed: int = 0, batch: int = 8,
                        noise: tuple[float, ...] = (0.0, 0.003, 0.3)) -> RolloutBatch:
    """A valid batch whose sampler log-probs come from the trainer's own logits plus noise.

    Token ids and masks are drawn by :func:`factories.random_rollout`; then, at every trainable
    token, the sampler distribution is ``softmax((z + σ·ε)/T)`` with ``z = logits_fn(input_ids)``
    and a per-row σ from ``noise``: even rows keep a top-k/top-p set (forced to contain the
    sampled token, renormalized), odd rows record a head of 5 of the full distribution. So the
    importance ratios range from exactly 1 to outside the MIS bounds, and every level of the
    correction is exercised. Rewards alternate within groups of two (non-zero advantages).
    """
    rng = np.random.default_rng(seed)
    drafts = []
    for b in range(batch):
        r, _ = random_rollout(rng, vocab=vocab, prompt_len=int(rng.integers(2, 5)), response_len=int(rng.integers(3, 8)),
                              sampling=_sampling(b % 2 == 0, rng), head_size=5, env_every=int(rng.choice([0, 3])),
                              pool=("b200-bf16", "mi300x-fp8")[b % 2], group_id=f"g{b // 2}", rollout_id=f"r{b}")
        drafts.append(r)
    draft = collate(drafts, length_multiple=4)
    logits = np.asarray(logits_fn(draft.input_ids, draft.attention_mask), np.float64)
    rollouts = []
    for b, r in enumerate(drafts):
        sigma = float(noise[b % len(noise)])
        P, T = r.prompt_ids.shape[0], r.response_ids.shape[0]
        lps, span_ids, span_lps = [], [], []
        for t in range(T):
            if not r.loss_mask[t]:
                lps.append(0.0)
                span_ids.append([])
                span_lps.append([])
                continue
            a = int(r.response_ids[t])
            z = logits[b, P - 1 + t] + sigma * rng.normal(size=vocab)
            if r.sampling.truncated:
                kept, _ = truncated_distribution(z, r.sampling)
                if a not in kept:
                    kept[-1] = a
                logq = log_softmax(z[kept] / r.sampling.temperature)
                lps.append(float(logq[list(kept).index(a)]))
                span_ids.append(kept.tolist())
                span_lps.append(logq.tolist())
            else:
                logq = log_softmax(z / r.sampling.temperature)
                head = np.argsort(-logq, kind="stable")[:5]
                lps.append(float(logq[a]))
                span_ids.append(head.tolist())
                span_lps.append(logq[head].tolist())
        support = SamplingSupport.from_lists(span_ids, span_lps, kind="kept" if r.sampling.truncated else "head")
        rollouts.append(Rollout(
            rollout_id=r.rollout_id, group_id=r.group_id, prompt_ids=r.prompt_ids, response_ids=r.response_ids,
            loss_mask=r.loss_mask, sampler_logprobs=np.asarray(lps, np.float32), policy_version=r.policy_version,
            reward=float(b % 2), finish_reason="stop", sampling=r.sampling, sampler=r.sampler, support=support,
        ).validate(vocab))
    return collate(rollouts, length_multiple=4)


def step_prompts(step: int, batch: int = 4) -> list[dict]:
    """The prompts of the (0-based) ``step``: the next ``batch`` of ``NUM_PROMPTS`` ids, cycling."""
    return [{"prompt_id": (step * batch + i) % NUM_PROMPTS} for i in range(batch)]


def rollouts_for_prompts(prompts: list[dict], vocab: int) -> RolloutBatch:
    """Two rollouts per prompt (one group), drawn deterministically from the prompt id."""
    rollouts = []
    for p in prompts:
        rng = np.random.default_rng(1000 + p["prompt_id"])
        for k in range(2):
            r, _ = random_rollout(rng, vocab=vocab, prompt_len=3, response_len=5, sampling=_sampling(True, rng),
                                  group_id=f"p{p['prompt_id']}", rollout_id=f"p{p['prompt_id']}-{k}", logit_scale=0.5)
            rollouts.append(r.validate(vocab))
    return collate(rollouts, length_multiple=4, pool_names=("b200-bf16",))


def model_logits_fn(ckpt: str | pathlib.Path):
    """``fn(input_ids, attention_mask) -> logits`` of the float32 JAX model in ``ckpt``."""
    import jax
    from flax import nnx

    from hetrl.models.qwen_jax import load_hf

    graphdef, state = nnx.split(load_hf(ckpt))
    fwd = jax.jit(lambda s, ids, mask: nnx.merge(graphdef, s)(ids, attention_mask=mask)[0])
    return lambda ids, mask: np.asarray(fwd(state, ids, mask))


def read_batch(path: str | pathlib.Path) -> RolloutBatch:
    return RolloutBatch.from_bytes(pathlib.Path(path).read_bytes())


def write_result(path: str | pathlib.Path, weights: dict[str, np.ndarray], **scalars: float) -> None:
    from hetrl.models.hf_io import write_safetensors

    arrays = dict(weights) | {k: np.asarray([v], np.float64) for k, v in scalars.items()}
    write_safetensors(path, arrays)


def read_result(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    from hetrl.models.hf_io import read_safetensors

    return read_safetensors(path)


def make_trainer(ckpt, base: dict, *, mesh=None, **extra):
    """A JaxTrainer on ``ckpt`` built from the spec ``base | extra`` (see :data:`TRAIN_CONFIG`)."""
    from hetrl.core.checkpoints import CheckpointConfig
    from hetrl.core.correction import correction_preset
    from hetrl.trainer_jax import JaxTrainer, JaxTrainerConfig

    spec = dict(base | extra)
    correction = correction_preset(spec.pop("correction_preset", "hetrl"), **spec.pop("correction_overrides", {}))
    checkpoint = CheckpointConfig.model_validate(spec.pop("checkpoint", {}))
    return JaxTrainer.from_hf(ckpt, JaxTrainerConfig.model_validate(spec), correction=correction,
                              checkpoint=checkpoint, mesh=mesh)


# ====================================================================== subprocess modes
def run_sharded(ckpt: str, batch_path: str, out: str) -> None:
    """One step on each 4-device mesh of MESHES; weights of the last one, loss of each."""
    import jax

    from hetrl.trainer_jax import MeshConfig, make_mesh

    assert jax.device_count() == 4, jax.devices()
    batch = read_batch(batch_path)
    losses, weights = {}, {}
    for name, (d, f, t) in MESHES.items():
        trainer = make_trainer(ckpt, TRAIN_CONFIG, mesh=make_mesh(MeshConfig(data=d, fsdp=f, tensor=t)))
        assert any(len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(trainer.params))
        losses[f"loss.{name}"] = trainer.train_step(batch)["loss"]
        weights |= {f"{name}/{k}": v for k, v in trainer.export_hf_weights().items()}
    write_result(out, weights, **losses)


def run_multihost(ckpt: str, batch_path: str, out: str, process_id: str, num_processes: str, port: str) -> None:
    """One process of a multi-process run: join, build the 4-device mesh, step on own rows."""
    from hetrl.trainer_jax import DistributedConfig, MeshConfig, initialize_distributed, make_mesh

    initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=int(num_processes),
                                             process_id=int(process_id), initialization_timeout_s=60))
    import jax

    assert jax.process_count() == int(num_processes) and jax.device_count() == 4, (jax.process_count(), jax.devices())
    trainer = make_trainer(ckpt, TRAIN_CONFIG, mesh=make_mesh(MeshConfig(data=2, fsdp=2, tensor=1)))
    batch = read_batch(batch_path)
    rows = trainer.local_rows(batch.batch_size)
    assert rows.stop - rows.start == batch.batch_size // int(num_processes), rows
    local = RolloutBatch(**{k: v[rows] for k, v in batch.arrays.items()},
                         rollout_ids=batch.rollout_ids[rows], group_ids=batch.group_ids, pool_names=batch.pool_names)
    loss = trainer.train_step(local)["loss"]
    weights = trainer.export_hf_weights()
    if jax.process_index() == 0:
        write_result(out, weights, loss=loss, first_row=rows.start, num_rows=rows.stop - rows.start)


def run_resume(ckpt: str, run_dir: str, out: str) -> None:
    """Fresh process: restore the latest checkpoint, take the next step's batch."""
    trainer = make_trainer(ckpt, RESUME_CONFIG, checkpoint=dict(directory=run_dir))
    step = trainer.restore()
    loss = trainer.train_step(rollouts_for_prompts(step_prompts(step), trainer.model_config.vocab_size))["loss"]
    write_result(out, trainer.export_hf_weights(), loss=loss, restored_step=step)
    trainer.close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"sharded": run_sharded, "multihost": run_multihost, "resume": run_resume}[mode](*args)
