"""The Megatron trainer (hetrl.trainer_megatron) against transformers, the JAX model and the JAX
trainer; two-rank tensor / data parallelism against one rank; the HF weight mapping;
dist_checkpointing resume in a fresh process; the CPU test shim.

megatron keeps process-global state (torch.distributed, parallel_state, the RNG tracker), so
everything that builds megatron objects runs in worker subprocesses: this file is also the
worker (``python tests/test_trainer_megatron.py WORKER OUT_DIR CKPT_QWEN3 CKPT_QWEN2 [BATCH...]``)
and workers write their results as safetensors + JSON into OUT_DIR (two-rank workers get RANK,
WORLD_SIZE and MASTER_PORT in the environment). The parent process never imports megatron. Checkpoints are the tiny ones of conftest_models (init_std 0.2, perturbed
norms), so distributions are peaked and every weight matters.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
SRC = HERE.parents[1] / "src" / "hetrl"
sys.path.insert(0, str(HERE.parent))

from conftest_models import CONFIGS  # noqa: E402
from factories import log_softmax, sampler_info, truncated_distribution  # noqa: E402
from hetrl.core.correction import LossInputs, PRESETS, grpo_advantages, policy_loss  # noqa: E402
from hetrl.core.schema import Rollout, RolloutBatch, SamplingParams, SamplingSupport, collate  # noqa: E402
from hetrl.models import ModelConfig, load_state_dict  # noqa: E402
from hetrl.parity import reference_logprobs, transformers_logits, update_relative_error  # noqa: E402

ARCHS = ("qwen3", "qwen2")
WORKER_TIMEOUT_S = 240
LR, ADAM_EPS = 1e-3, 1e-3  # a large ε makes the first Adam update depend on g, not only on sign(g)
PARITY_FP32 = dict(compute_dtype="fp32", micro_batch_size=3, optimizer=dict(learning_rate=LR, eps=ADAM_EPS, grad_clip=None))
PARITY_BF16 = dict(compute_dtype="bf16", distributed_optimizer=True, optimizer=dict(learning_rate=LR))
RESUME_CONFIGS = {
    "bf16_distributed": dict(compute_dtype="bf16", micro_batch_size=4, distributed_optimizer=True,
                             optimizer=dict(learning_rate=LR, warmup_steps=2)),
    "fp32": dict(compute_dtype="fp32", optimizer=dict(learning_rate=LR, weight_decay=0.1, warmup_steps=2)),
}
"""Trainer specs: :class:`MegatronTrainerConfig` keys plus ``correction_preset`` /
``correction_overrides`` and ``checkpoint``, passed beside it (:func:`_make_trainer`)."""
VARIANTS = {  # (preset, overrides) of further fp32 qwen3 runs: another reduction, PPO-clip
    "sequence_mean": ("mis", {"reduction": "sequence_mean"}),
    "ppo_clip": ("none", {"ppo_clip": (0.2, 0.28)}),
}
MULTI_PROCESS = {"tp2": dict(tensor=2), "dp2": dict(data=2)}  # mesh sizes  # two ranks each, gloo on the CPU
# stated bounds of |Δ log p|, BF16 megatron vs FP32 transformers: mean over the full vocabulary,
# mean over the next tokens, max of either
BF16_FULL_MEAN_BOUND, BF16_TOKEN_MEAN_BOUND, BF16_MAX_BOUND = 5e-2, 5e-2, 0.5


# ====================================================================== rollouts sampled from the model
def right_padded_ids(vocab: int, lengths=(16, 11, 6, 2), seed=0) -> tuple[np.ndarray, np.ndarray]:
    """Ids [B, L] int32 and the key mask [B, L] of right-padded random sequences."""
    rng = np.random.default_rng(seed)
    L = max(lengths)
    mask = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
    return np.where(mask, rng.integers(3, vocab, (len(lengths), L)), 0).astype(np.int32), mask


def model_rollout(next_logits, rng: np.random.Generator, vocab: int, *, kept: bool, noise: float, env_every: int,
                  group_id: str, rollout_id: str, reward: float, prompt_len: int, response_len: int) -> Rollout:
    """A valid rollout sampled token by token from ``softmax((z + σ·ε)/T)`` (then top-k/top-p when
    ``kept``), z = ``next_logits(prefix)`` the model's next-token logits: a sampler that differs
    from the trainer by logit noise of scale σ = ``noise``. Every ``env_every``-th response token
    is an env token (random id, ``loss_mask`` False, empty support)."""
    sampling = (SamplingParams(temperature=float(rng.choice([0.8, 1.0])), top_p=0.9, top_k=8) if kept
                else SamplingParams(temperature=1.0, top_p=1.0, top_k=0))
    ids = list(rng.integers(3, vocab, prompt_len))
    mask = np.ones(response_len, bool)
    if env_every:
        mask[env_every - 1 :: env_every] = False
    lps, spans, span_lps = [], [], []
    for t in range(response_len):
        if not mask[t]:
            ids.append(int(rng.integers(3, vocab)))
            lps.append(0.0), spans.append([]), span_lps.append([])
            continue
        z = next_logits(np.asarray(ids, np.int32)).astype(np.float64) + noise * rng.normal(size=vocab)
        if kept:
            support, logq = truncated_distribution(z, sampling)
            pick = int(rng.choice(len(support), p=np.exp(logq) / np.exp(logq).sum()))
            token, lp = int(support[pick]), logq[pick]
            spans.append(support.tolist()), span_lps.append(logq.tolist())
        else:
            logq = log_softmax(z / sampling.temperature)
            token = int(rng.choice(vocab, p=np.exp(logq) / np.exp(logq).sum()))
            lp = logq[token]
            head = np.argsort(-logq, kind="stable")[:5]
            spans.append(head.tolist()), span_lps.append(logq[head].tolist())
        ids.append(token)
        lps.append(float(np.float32(lp)))
    return Rollout(
        rollout_id=rollout_id, group_id=group_id, prompt_ids=np.asarray(ids[:prompt_len], np.int32),
        response_ids=np.asarray(ids[prompt_len:], np.int32), loss_mask=mask, sampler_logprobs=np.asarray(lps, np.float32),
        policy_version=np.zeros(response_len, np.int32), reward=reward, finish_reason="stop", sampling=sampling,
        sampler=sampler_info("b200-bf16" if noise == 0 else "mi300x-fp8"),
        support=SamplingSupport.from_lists(spans, span_lps, kind="kept" if kept else "head"),
    ).validate(vocab)


def model_batch(next_logits, vocab: int, seed: int, rows: int = 8) -> RolloutBatch:
    """``rows`` rollouts in groups of two: kept supports and full-vocabulary heads, samplers equal
    to the model (σ = 0), slightly off (σ = 0.01) or far off (σ = 0.5, masked by MIS), some with
    env tokens; rewards differ within most groups so advantages are not all zero."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for b in range(rows):
        rollouts.append(model_rollout(
            next_logits, rng, vocab, kept=b % 4 != 1, noise=(0.0, 0.0, 0.01, 0.5)[b % 4], env_every=3 if b % 3 == 2 else 0,
            group_id=f"g{b // 2}", rollout_id=f"r{b}", reward=float((b + b // 6) % 2), prompt_len=int(rng.integers(2, 5)),
            response_len=int(rng.integers(4, 9)),
        ))
    return collate(rollouts, length_multiple=4)


# ====================================================================== parent-side fixtures


@pytest.fixture(scope="module")
def batches(hf_models):
    """Two rollout batches per architecture, sampled from the transformers model."""
    out = {}
    for arch in ARCHS:
        model = hf_models[arch]
        next_logits = lambda ids, model=model: transformers_logits(model, ids[None], np.ones((1, len(ids)), bool))[0, -1]  # noqa: E731
        out[arch] = [model_batch(next_logits, CONFIGS[arch].vocab_size, seed) for seed in (0, 1)]
    return out


@pytest.fixture(scope="module")
def batch_files(batches, tmp_path_factory) -> dict[str, list[str]]:
    directory = tmp_path_factory.mktemp("batches")
    files = {}
    for arch, items in batches.items():
        files[arch] = []
        for i, batch in enumerate(items):
            path = directory / f"{arch}_{i}.safetensors"
            path.write_bytes(batch.to_bytes())
            files[arch].append(str(path))
    return files


def run_worker(name: str, out: pathlib.Path, tiny: dict, files: dict) -> tuple[dict, dict]:
    """Run worker ``name`` in a fresh interpreter (guarded by a timeout); returns its JSON and
    its arrays."""
    from safetensors.numpy import load_file

    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(HERE), name, str(out), str(tiny["qwen3"]), str(tiny["qwen2"]),
            *files["qwen3"], *files["qwen2"]]
    start = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert proc.returncode == 0, f"worker {name} failed ({proc.returncode}):\n{proc.stderr[-8000:]}"
    print(f"worker {name}: {time.time() - start:.1f}s")
    return json.loads((out / "result.json").read_text()), load_file(out / "arrays.safetensors")


@pytest.fixture(scope="module")
def parity(tiny_checkpoints, batch_files, tmp_path_factory):
    return run_worker("parity", tmp_path_factory.mktemp("parity"), tiny_checkpoints, batch_files)


@pytest.fixture(scope="module")
def resumed(tiny_checkpoints, batch_files, tmp_path_factory):
    """(first run: step, save, step; second, fresh process: restore, step)."""
    run_dir = tmp_path_factory.mktemp("resume")
    first = run_worker("resume-save", run_dir / "first", tiny_checkpoints, batch_files)
    second = run_worker("resume-load", run_dir / "second", tiny_checkpoints, batch_files)
    return first, second


@pytest.fixture(scope="module")
def multi_process(tiny_checkpoints, batch_files, tmp_path_factory):
    """{name: [(json, arrays) of rank 0, of rank 1]} for the two-rank runs of MULTI_PROCESS."""
    from safetensors.numpy import load_file

    out = {}
    for name in MULTI_PROCESS:
        directory = tmp_path_factory.mktemp(name)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = []
        for rank in range(2):
            env = os.environ | dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            args = [sys.executable, str(HERE), f"multi-{name}", str(directory / f"rank{rank}"), str(tiny_checkpoints["qwen3"]),
                    str(tiny_checkpoints["qwen2"]), *batch_files["qwen3"], *batch_files["qwen2"]]
            procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        start = time.time()
        try:
            errors = [p.communicate(timeout=WORKER_TIMEOUT_S)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert all(p.returncode == 0 for p in procs), f"{name} failed:\n" + "\n".join(e[-4000:] for e in errors)
        print(f"workers {name}: {time.time() - start:.1f}s")
        out[name] = [(json.loads((directory / f"rank{r}" / "result.json").read_text()),
                      load_file(directory / f"rank{r}" / "arrays.safetensors")) for r in range(2)]
    return out


def reference_loss(logits, batch: RolloutBatch, xp_asarray, config=PRESETS["hetrl"], old_logprobs=None) -> float:
    """policy_loss (preset hetrl by default) on ``logits`` (any namespace via ``xp_asarray``)."""
    arr = {k: xp_asarray(v) for k, v in batch.arrays.items()}
    advantages = grpo_advantages(arr["reward"], arr["group_index"], batch.batch_size)
    inputs = LossInputs(
        logits=logits, target_ids=arr["target_ids"], loss_mask=arr["loss_mask"], sampler_logprobs=arr["sampler_logprobs"],
        support_ids=arr["support_ids"], support_mask=arr["support_mask"], support_logprobs=arr["support_logprobs"],
        support_kept=arr["support_kept"], advantages=advantages, temperature=arr["temperature"], old_logprobs=old_logprobs,
    )
    return float(policy_loss(inputs, config)[0])


# ====================================================================== weight mapping (in process, no megatron)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_bit_exact(arch, tp, tiny_checkpoints):
    import torch

    from hetrl.trainer_megatron.weights import hf_to_megatron, megatron_to_hf

    config = ModelConfig.load(tiny_checkpoints[arch])
    hf = load_state_dict(tiny_checkpoints[arch])
    shards = [hf_to_megatron(config, hf, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = megatron_to_hf(config, shards)
    assert sorted(back) == sorted(hf)
    for name, arr in hf.items():
        assert back[name].dtype == arr.dtype and np.array_equal(back[name].view(np.uint32), arr.view(np.uint32)), name
    # the fused layouts, spelled out for layer 0 of tensor-parallel rank tp-1
    r, d, nh, ng = tp - 1, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    groups = [np.concatenate([q[g * (nh // ng) * d:(g + 1) * (nh // ng) * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
              for g in range(ng)]
    local_groups = groups[r * ng // tp:(r + 1) * ng // tp]
    np.testing.assert_array_equal(shards[r]["decoder.layers.0.self_attention.linear_qkv.weight"].numpy(), np.concatenate(local_groups))
    gate, up = (np.split(hf[f"model.layers.0.mlp.{p}_proj.weight"], tp)[r] for p in ("gate", "up"))
    np.testing.assert_array_equal(shards[r]["decoder.layers.0.mlp.linear_fc1.weight"].numpy(), np.concatenate([gate, up]))
    assert ("output_layer.weight" in shards[0]) == (arch == "qwen3")
    assert all(t.dtype == torch.float32 for t in shards[0].values())


def test_pipeline_stages_and_bf16_round_trip(tiny_checkpoints):
    import ml_dtypes

    from hetrl.trainer_megatron.weights import StageLayout, hf_to_megatron, megatron_to_hf

    config = ModelConfig.load(tiny_checkpoints["qwen2"])  # tied: the last stage holds a copy of the embedding
    hf = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_state_dict(tiny_checkpoints["qwen2"]).items()}
    stages = [StageLayout(0, 1, True, False), StageLayout(1, 1, False, True)]
    parts = [megatron_to_hf(config, [hf_to_megatron(config, hf, s)], s) for s in stages]
    assert "output_layer.weight" in hf_to_megatron(config, hf, stages[1])
    assert set(parts[0]) & set(parts[1]) == {"model.embed_tokens.weight"}
    merged = parts[0] | parts[1]
    assert sorted(merged) == sorted(hf)
    for name, arr in hf.items():
        assert merged[name].dtype == ml_dtypes.bfloat16 and np.array_equal(merged[name].view(np.uint16), arr.view(np.uint16)), name


def test_mapping_rejects_bad_inputs(tiny_checkpoints):
    from hetrl.models import CheckpointError
    from hetrl.trainer_megatron.weights import hf_to_megatron

    config = ModelConfig.load(tiny_checkpoints["qwen3"])
    hf = load_state_dict(tiny_checkpoints["qwen3"])
    with pytest.raises(CheckpointError, match="q_norm"):
        hf_to_megatron(config, {k: v for k, v in hf.items() if "0.self_attn.q_norm" not in k})
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor-parallel size 4"):
        hf_to_megatron(config, hf, tp_rank=0, tp_size=4)


# ====================================================================== parity (worker "parity")
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logprobs_match_transformers_and_jax(arch, parity, hf_models, tiny_checkpoints):
    import jax.numpy as jnp

    from hetrl.models.qwen_jax import load_hf

    _, arrays = parity
    ids, mask = right_padded_ids(CONFIGS[arch].vocab_size)
    ours = arrays[f"{arch}.fp32.logprobs_full"]
    ref = log_softmax(transformers_logits(hf_models[arch], ids, mask).astype(np.float64))
    jax_logits = np.asarray(load_hf(tiny_checkpoints[arch])(jnp.asarray(ids), attention_mask=jnp.asarray(mask))[0])
    jax_ref = log_softmax(jax_logits.astype(np.float64))
    assert ours.shape == ref.shape == (*ids.shape, CONFIGS[arch].vocab_size)
    assert np.exp(ref[mask]).max(-1).mean() > 0.05  # peaked: the comparison means something
    for name, other in (("transformers", ref), ("jax", jax_ref)):
        diff = np.abs(ours - other)[mask].max()
        print(f"{arch} fp32 megatron vs {name}: max |Δ log p| = {diff:.2e}")
        assert diff < 1e-5, (name, diff)


@pytest.mark.slow
def test_parity_can_fail(parity, hf_models):
    """A naive [q; k; v] fusion instead of megatron's per-group layout is far from transformers."""
    _, arrays = parity
    ids, mask = right_padded_ids(CONFIGS["qwen3"].vocab_size)
    ref = log_softmax(transformers_logits(hf_models["qwen3"], ids, mask).astype(np.float64))
    assert np.abs(arrays["qwen3.naive_qkv.logprobs_full"] - ref)[mask].max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_logprobs_match_transformers(arch, parity, batches, hf_models):
    _, arrays = parity
    batch = batches[arch][0]
    ref = reference_logprobs(transformers_logits(hf_models[arch], batch.input_ids, batch.attention_mask), batch)
    ours = arrays[f"{arch}.fp32.logprobs_batch"]
    m = batch.loss_mask
    assert batch.support_kept.any() and not batch.support_kept.all()
    assert np.abs(ours - ref)[m].max() < 1e-5
    # replay changes the kept rows: the full-vocabulary log-probs there are different
    full = log_softmax(transformers_logits(hf_models[arch], batch.input_ids, batch.attention_mask).astype(np.float64)
                       / batch.temperature[:, None, None].astype(np.float64))
    full_a = np.take_along_axis(full, batch.target_ids[..., None].astype(np.int64), -1)[..., 0]
    assert np.abs(ours - full_a)[m & batch.support_kept[:, None]].max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_equals_policy_loss_of_transformers_and_jax_logits(arch, parity, batches, hf_models, tiny_checkpoints):
    import jax.numpy as jnp
    import torch

    from hetrl.models.qwen_jax import load_hf

    result, _ = parity
    batch = batches[arch][0]
    ours = result[f"{arch}.fp32.metrics"]["loss"]
    ref = reference_loss(torch.from_numpy(transformers_logits(hf_models[arch], batch.input_ids, batch.attention_mask)), batch, torch.from_numpy)
    jax_logits = load_hf(tiny_checkpoints[arch])(jnp.asarray(batch.input_ids), attention_mask=jnp.asarray(batch.attention_mask))[0]
    jax_ref = reference_loss(jax_logits, batch, jnp.asarray)
    print(f"{arch} loss megatron {ours:.8f} transformers {ref:.8f} jax {jax_ref:.8f}")
    assert abs(ref) > 1e-3  # the batch carries signal
    assert abs(ours - ref) < 1e-5 and abs(ours - jax_ref) < 1e-5
    metrics = result[f"{arch}.fp32.metrics"]
    assert 0 < metrics["mismatch/masked_frac/sequence"] < 1 and metrics["grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sequence_mean_and_ppo_clip_losses(variant, parity, batches, hf_models):
    """The per-token-loss bookkeeping also gives the sequence mean over micro-batches, and the
    PPO-clip path takes old log-probs from logprobs()."""
    import torch

    from hetrl.core.correction import correction_preset

    result, arrays = parity
    batch = batches["qwen3"][0]
    preset, overrides = VARIANTS[variant]
    logits = transformers_logits(hf_models["qwen3"], batch.input_ids, batch.attention_mask)
    old = None
    if variant == "ppo_clip":
        old = torch.from_numpy(reference_logprobs(logits, batch, replay=False).astype(np.float32) * batch.loss_mask)
        assert np.abs(arrays["qwen3.ppo_clip.old_logprobs"] - old.numpy())[batch.loss_mask].max() < 1e-5
    ref = reference_loss(torch.from_numpy(logits), batch, torch.from_numpy, correction_preset(preset, **overrides), old)
    assert abs(ref) > 1e-3 and abs(result[f"qwen3.{variant}.loss"] - ref) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logprobs_close_to_fp32_transformers(arch, parity, hf_models, tiny_checkpoints):
    """BF16 megatron (Float16Module: BF16 weights and activations, FP32 softmax) against FP32
    transformers, on the full vocabulary and on the next tokens; JAX BF16 compute (FP32 weights)
    is reported alongside for scale."""
    import jax.numpy as jnp

    from hetrl.models.qwen_jax import Numerics, load_hf, with_numerics

    result, arrays = parity
    ids, mask = right_padded_ids(CONFIGS[arch].vocab_size)
    ref = log_softmax(transformers_logits(hf_models[arch], ids, mask).astype(np.float64))
    ours = arrays[f"{arch}.bf16.logprobs_full"]
    jax_bf16 = with_numerics(load_hf(tiny_checkpoints[arch]), Numerics(compute_dtype=jnp.bfloat16))
    jax_ours = log_softmax(np.asarray(jax_bf16(jnp.asarray(ids), attention_mask=jnp.asarray(mask))[0], np.float64))
    tok = lambda lp: np.take_along_axis(lp[:, :-1], ids[:, 1:, None].astype(np.int64), -1)[..., 0][mask[:, 1:]]  # noqa: E731
    full, nxt = np.abs(ours - ref)[mask], np.abs(tok(ours) - tok(ref))
    jax_full, jax_nxt = np.abs(jax_ours - ref)[mask], np.abs(tok(jax_ours) - tok(ref))
    print(f"{arch} |Δ log p| vs fp32 transformers, full vocab mean/max: megatron bf16 {full.mean():.2e}/{full.max():.2e}"
          f" jax bf16 {jax_full.mean():.2e}/{jax_full.max():.2e}; next token mean/max: megatron bf16"
          f" {nxt.mean():.2e}/{nxt.max():.2e} jax bf16 {jax_nxt.mean():.2e}/{jax_nxt.max():.2e}")
    assert 1e-4 < full.mean() < BF16_FULL_MEAN_BOUND and full.max() < BF16_MAX_BOUND
    assert nxt.mean() < BF16_TOKEN_MEAN_BOUND and nxt.max() < BF16_MAX_BOUND
    metrics = result[f"{arch}.bf16.metrics"]
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["update_skipped"] == 0
    assert result[f"{arch}.bf16.export_dtype"] == "bfloat16"
    # BF16 weights move where the update exceeds half a BF16 ulp: every matrix does; norm weights
    # near 1 (ulp 2^-7) may not after one step of lr 1e-3 (the FP32 master copy still moves)
    assert all(name.endswith("norm.weight") for name in result[f"{arch}.bf16.unmoved"]), result[f"{arch}.bf16.unmoved"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_export_through_the_model_is_bit_exact(arch, parity, tiny_checkpoints):
    _, arrays = parity
    hf = load_state_dict(tiny_checkpoints[arch])
    exported = {k[len(f"{arch}.export."):]: v for k, v in arrays.items() if k.startswith(f"{arch}.export.")}
    assert sorted(exported) == sorted(hf)
    for name, arr in hf.items():
        assert np.array_equal(exported[name].view(np.uint32), arr.view(np.uint32)), name


@pytest.mark.slow
def test_adamw_step_matches_jax_trainer(parity, batches, tiny_checkpoints):
    """One fp32 AdamW step of the Megatron trainer against the JAX trainer on the same batch:
    the same loss and the same parameter update Δθ (relative error per tensor)."""
    pytest.importorskip("hetrl.trainer_jax")
    from hetrl.trainer_jax import JaxTrainer, JaxTrainerConfig, MeshConfig

    result, arrays = parity
    arch = "qwen3"
    config = JaxTrainerConfig(compute_dtype="fp32", mesh=MeshConfig(data=1, fsdp=1, tensor=1),
                              optimizer=dict(learning_rate=LR, eps=ADAM_EPS, grad_clip=None))
    trainer = JaxTrainer.from_hf(tiny_checkpoints[arch], config)
    before = trainer.export_hf_weights()
    metrics = trainer.train_step(batches[arch][0])
    after = trainer.export_hf_weights()
    assert abs(metrics["loss"] - result[f"{arch}.fp32.metrics"]["loss"]) < 1e-5
    assert all(not np.array_equal(after[name], before[name]) for name in before)
    meg_after = {name: arrays[f"{arch}.after_step.{name}"] for name in before}
    worst, name = update_relative_error(before, meg_after, before, after)
    print(f"AdamW update, megatron vs jax trainer: worst relative error {worst:.2e} ({name})")
    assert worst < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MULTI_PROCESS))
def test_two_ranks_match_one(name, multi_process, parity, batches):
    """Tensor parallelism 2 (sharded weights, gathered logits and export) and data parallelism 2
    (half the rows each, advantages over all rows, token mean over both ranks) give the
    single-process FP32 loss, log-probs and update."""
    (_, single), arch = parity, "qwen3"
    single_loss = parity[0][f"{arch}.fp32.metrics"]["loss"]
    rows = batches[arch][0].batch_size
    for rank, (result, arrays) in enumerate(multi_process[name]):
        assert abs(result["loss"] - single_loss) < 1e-5, (rank, result["loss"], single_loss)
        local = slice(rank * rows // 2, (rank + 1) * rows // 2) if name == "dp2" else slice(None)
        mask = batches[arch][0].loss_mask[local]
        assert np.abs(arrays["logprobs"] - single[f"{arch}.fp32.logprobs_batch"][local])[mask].max() < 1e-5
        for key in (k for k in arrays if k.startswith("after_step.")):
            before = single[f"{arch}.export.{key[len('after_step.'):]}"].astype(np.float64)
            ours, ref = arrays[key] - before, single[f"{arch}.{key}"] - before
            assert np.linalg.norm(ours - ref) <= 1e-4 * np.linalg.norm(ref), (rank, key)
        np.testing.assert_array_equal(arrays["after_step.model.norm.weight"],
                                      multi_process[name][0][1]["after_step.model.norm.weight"])
        # the export streamed in buckets: one per unit (embedding, each layer, final norm and output),
        # together the whole export, bit for bit, each tensor once
        buckets: dict[int, dict[str, np.ndarray]] = {}
        for key, value in arrays.items():
            if key.startswith("bucket"):
                index, _, tensor = key[len("bucket"):].partition(".")
                buckets.setdefault(int(index), {})[tensor] = value
        assert len(buckets) == CONFIGS[arch].num_hidden_layers + 2
        assert sum(len(b) for b in buckets.values()) == len({k for b in buckets.values() for k in b})
        whole = {k[len("after_step."):]: v for k, v in arrays.items() if k.startswith("after_step.")}
        streamed = {k: v for b in buckets.values() for k, v in b.items()}
        assert sorted(streamed) == sorted(whole) and all(np.array_equal(streamed[k], whole[k]) for k in whole)


# ====================================================================== resume (workers "resume-save", "resume-load")
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RESUME_CONFIGS))
def test_dist_checkpoint_resumes_exactly(name, resumed):
    (first, first_arrays), (second, second_arrays) = resumed
    assert first[f"{name}.saved"] and not first[f"{name}.saved_unforced"]
    assert second[f"{name}.steps_on_disk"] == [1]  # the interrupted save of step 2 is not a checkpoint
    assert second[f"{name}.restored_step"] == 1
    assert first[f"{name}.loss_after_save"] == second[f"{name}.loss_after_restore"]
    assert first[f"{name}.loss_after_save"] != first[f"{name}.loss_before_save"]
    assert first[f"{name}.learning_rate_after_save"] == second[f"{name}.learning_rate_after_restore"] > 0
    keys = [k for k in first_arrays if k.startswith(f"{name}.")]
    assert keys
    for key in keys:
        np.testing.assert_array_equal(first_arrays[key], second_arrays[key])


# ====================================================================== the CPU shim
SHIM_CHECK_NOOP = """
import sys, torch
torch.cuda.is_available = lambda: True                      # simulate a CUDA machine
import megatron.core.tensor_parallel.random as mcore_random
modules = (torch.cuda, torch.cuda.random, mcore_random, torch.Tensor)
def snapshot():
    return [dict(vars(m)) for m in modules], torch._C._len_torch_function_stack()
before = snapshot()
from hetrl.trainer_megatron.cpu_shim import apply_cpu_shim_if_needed
assert apply_cpu_shim_if_needed() is False
after = snapshot()
assert before[1] == after[1] == 0, "a torch-function mode was pushed"
for module, old, new in zip(modules, before[0], after[0]):
    changed = sorted(k for k in set(old) | set(new) if old.get(k, None) is not new.get(k, None))
    assert not changed, (module, changed)
print("noop ok")
"""

SHIM_CHECK_ACTIVE = """
import torch
from hetrl.trainer_megatron.cpu_shim import apply_cpu_shim_if_needed
assert not torch.cuda.is_available()
assert apply_cpu_shim_if_needed() is True and apply_cpu_shim_if_needed() is True
assert torch.zeros(2, device="cuda").device.type == "cpu" and torch.ones(1).cuda().device.type == "cpu"
assert torch.ones(1).to("cuda:0").device.type == "cpu" and torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"   # not from megatron: untouched
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
torch.manual_seed(0)
state = torch.get_rng_state()
with get_cuda_rng_tracker().fork():
    forked = torch.rand(4)
outer = torch.rand(4)
torch.set_rng_state(state)
assert torch.equal(outer, torch.rand(4)), "the fork leaked into the default stream"
assert not torch.equal(forked, outer), "the fork did not switch streams"
with get_cuda_rng_tracker().fork():
    forked_again = torch.rand(4)
assert not torch.equal(forked, forked_again), "the forked stream did not advance"
print("active ok")
"""


@pytest.mark.parametrize("script", [SHIM_CHECK_NOOP, SHIM_CHECK_ACTIVE], ids=["noop-with-cuda", "active-without-cuda"])
def test_cpu_shim(script):
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_no_use_of_shim_internals_outside_it():
    """Outside cpu_shim.py, the shim is reached only through ``from ...cpu_shim import
    apply_cpu_shim_if_needed``: no module import of it, no other name, none of its private
    names (scanned over src/ and tests/)."""
    shim = SRC / "trainer_megatron" / "cpu_shim.py"
    tree = ast.parse(shim.read_text())
    private = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name.startswith("_")}
    private |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name) and t.id.startswith("_")}
    assert {"_CudaOnCpuMode", "_STATE"} <= private
    offenders, users = [], []
    for path in sorted({*SRC.rglob("*.py"), *HERE.parent.rglob("*.py")} - {shim}):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("cpu_shim"):
                names = {a.name for a in node.names}
                (users if names == {"apply_cpu_shim_if_needed"} else offenders).append(f"{path.name}: from-import {names}")
            elif isinstance(node, ast.ImportFrom) and any(a.name == "cpu_shim" for a in node.names):
                offenders.append(f"{path.name}: imports the module from {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.endswith("cpu_shim") for a in node.names):
                offenders.append(f"{path.name}: imports the module")
            elif isinstance(node, (ast.Name, ast.Attribute)):
                ident = node.id if isinstance(node, ast.Name) else node.attr
                if ident in private and ident not in defined:
                    offenders.append(f"{path.name}: uses {ident}")
    assert offenders == []
    assert any(u.startswith("model.py") for u in users)  # the one entry into megatron applies it


def test_a_single_process_group_does_not_take_the_fixed_default_port():
    """Two single-rank Megatron runs side by side (an experiment grid's ``--jobs 2``) once both
    bound torch's default MASTER_PORT 29500 and the second died with EADDRINUSE. With 29500
    held here (or by anything else), a single process without WORLD_SIZE/MASTER_PORT must still
    start its process group."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 29500))
        holder.listen()
    except OSError:  # already taken by someone else: the condition under test holds anyway
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code = ("import torch; from hetrl.trainer_megatron.model import initialize_parallel; "
            "initialize_parallel(); print('world', torch.distributed.get_world_size())")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S)
    finally:
        holder.close()
    assert proc.returncode == 0 and "world 1" in proc.stdout, proc.stderr[-3000:]


# ====================================================================== workers (run in subprocesses)
def _load_batches(paths: list[str]) -> dict[str, list[RolloutBatch]]:
    return {"qwen3": [RolloutBatch.from_bytes(pathlib.Path(p).read_bytes()) for p in paths[:2]],
            "qwen2": [RolloutBatch.from_bytes(pathlib.Path(p).read_bytes()) for p in paths[2:]]}


def _make_trainer(ckpt, spec: dict):
    """A MegatronTrainer on ``ckpt`` built from ``spec`` (see :data:`RESUME_CONFIGS`)."""
    from hetrl.core.checkpoints import CheckpointConfig
    from hetrl.core.correction import correction_preset
    from hetrl.trainer_megatron import MegatronTrainer, MegatronTrainerConfig

    spec = dict(spec)
    correction = correction_preset(spec.pop("correction_preset", "hetrl"), **spec.pop("correction_overrides", {}))
    checkpoint = CheckpointConfig.model_validate(spec.pop("checkpoint", {}))
    return MegatronTrainer.from_hf(ckpt, MegatronTrainerConfig.model_validate(spec), correction=correction,
                                   checkpoint=checkpoint)


def worker_parity(out: pathlib.Path, ckpts: dict[str, str], batches: dict[str, list[RolloutBatch]]) -> tuple[dict, dict]:
    """Per architecture: an FP32 trainer (logits, replayed log-probs, export, one step) and a
    BF16 trainer with the distributed optimizer (logits, one step); for qwen3 also the logits
    under a naive [q; k; v] fusion."""
    import torch

    from hetrl.trainer_megatron.model import forward_logits, unwrap
    from hetrl.trainer_megatron.weights import hf_to_megatron

    result, arrays = {}, {}
    for arch in ARCHS:
        ids, mask = (torch.from_numpy(a) for a in right_padded_ids(CONFIGS[arch].vocab_size))
        batch = batches[arch][0]

        def full_logprobs(trainer) -> np.ndarray:
            with torch.no_grad():
                return torch.log_softmax(forward_logits(trainer.model.module, ids.long(), mask).double(), -1).numpy()

        fp32 = _make_trainer(ckpts[arch], PARITY_FP32)
        arrays[f"{arch}.fp32.logprobs_full"] = full_logprobs(fp32)
        arrays[f"{arch}.fp32.logprobs_batch"] = fp32.logprobs(batch)
        arrays.update({f"{arch}.export.{k}": v for k, v in fp32.export_hf_weights().items()})
        result[f"{arch}.fp32.metrics"] = fp32.train_step(batch)
        arrays.update({f"{arch}.after_step.{k}": v for k, v in fp32.export_hf_weights().items()})
        if arch == "qwen3":
            hf = load_state_dict(ckpts[arch])
            state = hf_to_megatron(fp32.model_config, hf)
            for i in range(fp32.model_config.num_hidden_layers):
                qkv = [hf[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
                state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.from_numpy(np.concatenate(qkv))
            unwrap(fp32.model).load_state_dict(state, strict=False)
            arrays["qwen3.naive_qkv.logprobs_full"] = full_logprobs(fp32)
            for variant, (preset, overrides) in VARIANTS.items():
                trainer = _make_trainer(ckpts[arch],
                                        PARITY_FP32 | {"correction_preset": preset, "correction_overrides": overrides})
                old = trainer.logprobs(batch) if variant == "ppo_clip" else None
                if old is not None:
                    arrays["qwen3.ppo_clip.old_logprobs"] = old
                result[f"qwen3.{variant}.loss"] = trainer.train_step(batch, old_logprobs=old)["loss"]

        bf16 = _make_trainer(ckpts[arch], PARITY_BF16)
        arrays[f"{arch}.bf16.logprobs_full"] = full_logprobs(bf16)
        before = bf16.export_hf_weights()
        result[f"{arch}.bf16.metrics"] = bf16.train_step(batch)
        after = bf16.export_hf_weights()
        result[f"{arch}.bf16.export_dtype"] = str(after["model.norm.weight"].dtype)
        result[f"{arch}.bf16.unmoved"] = sorted(k for k in before if np.array_equal(before[k], after[k]))
    return result, arrays


def _resume_trainer(ckpt: str, name: str, directory: pathlib.Path):
    return _make_trainer(ckpt, {**RESUME_CONFIGS[name], "checkpoint": {"directory": str(directory)}})


def worker_resume_save(out: pathlib.Path, ckpts: dict[str, str], batches: dict[str, list[RolloutBatch]]) -> tuple[dict, dict]:
    result, arrays = {}, {}
    first, second = batches["qwen3"]
    for name in sorted(RESUME_CONFIGS):
        trainer = _resume_trainer(ckpts["qwen3"], name, out.parent / f"ckpt_{name}")
        result[f"{name}.loss_before_save"] = trainer.train_step(first)["loss"]
        result[f"{name}.saved"] = trainer.save()
        metrics = trainer.train_step(second)
        result[f"{name}.saved_unforced"] = trainer.save(force=False)  # checkpoint.every = 0: explicit saves only
        (out.parent / f"ckpt_{name}" / "2.partial").mkdir()  # a save of step 2 killed halfway
        (out.parent / f"ckpt_{name}" / "2.partial" / "metadata.json").write_text("{")
        result[f"{name}.loss_after_save"] = metrics["loss"]
        result[f"{name}.learning_rate_after_save"] = metrics["learning_rate"]
        arrays.update({f"{name}.{k}": v.astype(np.float32) for k, v in trainer.export_hf_weights().items()})
    return result, arrays


def worker_resume_load(out: pathlib.Path, ckpts: dict[str, str], batches: dict[str, list[RolloutBatch]]) -> tuple[dict, dict]:
    result, arrays = {}, {}
    for name in sorted(RESUME_CONFIGS):
        trainer = _resume_trainer(ckpts["qwen3"], name, out.parent / f"ckpt_{name}")
        result[f"{name}.steps_on_disk"] = trainer.checkpoint_steps()
        result[f"{name}.restored_step"] = trainer.restore()
        metrics = trainer.train_step(batches["qwen3"][1])
        result[f"{name}.loss_after_restore"] = metrics["loss"]
        result[f"{name}.learning_rate_after_restore"] = metrics["learning_rate"]
        arrays.update({f"{name}.{k}": v.astype(np.float32) for k, v in trainer.export_hf_weights().items()})
    return result, arrays


def worker_multi(name: str, out: pathlib.Path, ckpts: dict[str, str], batches: dict[str, list[RolloutBatch]]) -> tuple[dict, dict]:
    """One rank of a two-rank run: PARITY_FP32 with the parallel sizes of MULTI_PROCESS[name],
    on this rank's rows of the qwen3 batch."""
    import dataclasses

    trainer = _make_trainer(ckpts["qwen3"], PARITY_FP32 | {"mesh": MULTI_PROCESS[name]})
    batch = batches["qwen3"][0]
    rows = trainer.local_rows(batch.batch_size)
    local = dataclasses.replace(batch, **{k: v[rows] for k, v in batch.arrays.items()}, rollout_ids=batch.rollout_ids[rows])
    arrays = {"logprobs": trainer.logprobs(local)}
    metrics = trainer.train_step(local)
    arrays.update({f"after_step.{k}": v for k, v in trainer.export_hf_weights().items()})
    buckets = list(trainer.export_hf_buckets(bucket_bytes=1))  # every unit closes its bucket
    arrays.update({f"bucket{i}.{k}": v for i, bucket in enumerate(buckets) for k, v in bucket.items()})
    return metrics, arrays


WORKERS = {"parity": worker_parity, "resume-save": worker_resume_save, "resume-load": worker_resume_load,
           **{f"multi-{name}": partial(worker_multi, name) for name in MULTI_PROCESS}}


def _worker_main(argv: list[str]) -> None:
    from safetensors.numpy import save_file

    name, out = argv[0], pathlib.Path(argv[1])
    ckpts = {"qwen3": argv[2], "qwen2": argv[3]}
    result, arrays = WORKERS[name](out, ckpts, _load_batches(argv[4:]))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, out / "arrays.safetensors")
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
