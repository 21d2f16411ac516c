"""``hetrl warmstart``: train the tiny policy from scratch on solved tasks, save it, evaluate it.

Pipeline for a :class:`~hetrl.warmstart.config.WarmstartConfig` ``c``:

1. **transcripts**: for every train function of the suite ``c.suite`` and
   ``v < c.training.variants``, the task :func:`suite_task` (function, draw
   :func:`train_draw` ``(c.suite.seed, v)``) -- same function, fresh visible examples and hidden tests -- as
   the chat the coding environment shows (:meth:`CodingEnv.reset`), answered by its reference
   solution and ``<|im_end|>``. Held-out draws (and held-out functions, if the split is by
   function) never appear.
2. **tokenizer**: byte-level BPE of ``c.model.vocab_size`` trained on those transcripts
   (:func:`hetrl.models.tiny.train_tokenizer`); the chat format is the environment's
   (:class:`~hetrl.envs.base.ChatFormat`).
3. **SFT**: a randomly initialized Qwen3 (:class:`~hetrl.models.qwen_jax.QwenModel`), next-token
   cross-entropy on answer tokens only (:mod:`hetrl.trainer_jax.sft`), AdamW with clipping.
4. **save**: an HF checkpoint (config, safetensors, tokenizer) plus ``warmstart.json`` (the config,
   the training curve, the evaluation, wall times).
5. **evaluate**: held-out success and reward (:func:`hetrl.orchestrator.evaluation.evaluate_tasks`)
   with the embedded sampler in its exact fp32 profile, at ``c.eval.temperature`` and greedily.

The trainer (step 3) and the sampler (step 5) only meet through the saved HF weights.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hetrl.envs.base import ChatFormat
from hetrl.envs.coding import CodingEnv, CodingEnvConfig, FunctionTask
from hetrl.envs.tasks_synthetic import suite_programs, suite_task, synthetic_suite, train_draw
from hetrl.formatting import fmt
from hetrl.models.config import ModelConfig
from hetrl.models.tiny import SPECIAL_TOKENS, TINY_QWEN3, save_checkpoint, train_tokenizer
from hetrl.stopping import current
from hetrl.warmstart.config import WarmstartConfig

__all__ = ["RESULT_FILE", "model_config", "training_tasks", "run_warmstart", "evaluate_checkpoint"]

RESULT_FILE = "warmstart.json"
_TOKENIZER_SAMPLE = 4000  # transcripts the tokenizer is trained on


def model_config(c: WarmstartConfig) -> ModelConfig:
    """The Qwen3 config of ``c.model`` (pad ``<|endoftext|>`` = 0, eos ``<|im_end|>`` = 2)."""
    m = c.model
    return TINY_QWEN3.model_copy(update=dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, head_dim=m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings,
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"), eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
    ))


def training_tasks(c: WarmstartConfig) -> list[FunctionTask]:
    """Every train function x ``c.training.variants`` example draws (see the module docstring)."""
    train, _ = suite_programs(c.suite)
    return [suite_task(p, c.suite, train_draw(c.suite.seed, v)) for v in range(c.training.variants) for p in train]


def run_warmstart(c: WarmstartConfig, out_dir: str | pathlib.Path, *, console: bool = True) -> dict[str, Any]:
    """Run the pipeline of the module docstring into ``out_dir`` (written atomically: built in a
    sibling temporary directory, then renamed). Returns the ``warmstart.json`` content. A stop
    requested on :func:`hetrl.stopping.current` (SIGINT / SIGTERM) raises
    :class:`~hetrl.stopping.Stopped` at the next optimizer step or evaluation batch, leaving
    ``out_dir`` as it was."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hetrl.models.qwen_jax import QwenModel, to_hf_state_dict
    from hetrl.core.training import OptimizerConfig
    from hetrl.trainer_jax.optim import make_optimizer
    from hetrl.trainer_jax.sft import pack_examples, make_sft_step

    out_dir = pathlib.Path(out_dir)
    stop = current()
    started = time.perf_counter()
    env = CodingEnv(CodingEnvConfig(max_turns=c.eval.max_turns))
    tasks = training_tasks(c)
    prompts = [env.reset(t).messages for t in tasks]  # the environment's first observation of each task
    texts = [(ChatFormat.render(m, add_generation_prompt=True), t.reference) for m, t in zip(prompts, tasks)]
    rng = np.random.default_rng(c.seed)
    sample = rng.choice(len(texts), size=min(_TOKENIZER_SAMPLE, len(texts)), replace=False)
    tokenizer = train_tokenizer(c.model.vocab_size, [texts[i][0] + texts[i][1] for i in sample])
    chat = ChatFormat.from_tokenizer(tokenizer)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    examples = [(chat.encode(m, add_generation_prompt=True), encode(t.reference) + [chat.im_end_id])
                for m, t in zip(prompts, tasks)]
    fits = [e for e in examples if len(e[0]) + len(e[1]) - 1 <= c.training.seq_len]
    if len(fits) < len(examples) // 2:
        raise ValueError(f"training.seq_len={c.training.seq_len} fits only {len(fits)} of {len(examples)} transcripts")
    data = pack_examples(fits, c.training.seq_len, model_config(c).pad_token_id)
    prepared = time.perf_counter()

    config = model_config(c)
    model = QwenModel(config, rngs=nnx.Rngs(c.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    t = c.training
    tx = make_optimizer(OptimizerConfig(learning_rate=t.learning_rate, warmup_steps=t.warmup_steps, schedule="cosine",
                                        decay_steps=t.steps, min_learning_rate=0.1 * t.learning_rate,
                                        weight_decay=t.weight_decay))
    opt_state = tx.init(params)
    step = make_sft_step(graphdef, tx)
    curve: list[dict[str, float]] = []
    columns = (TextColumn("warm start"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, disable=not console) as progress:
        bar = progress.add_task("", total=t.steps)
        for i in range(t.steps):
            stop.check("the warm start")
            rows = rng.integers(0, data["input_ids"].shape[0], t.batch_size)
            params, opt_state, metrics = step(params, rest, opt_state, {k: jnp.asarray(v[rows]) for k, v in data.items()})
            if i % 25 == 0 or i == t.steps - 1:
                record = {"step": i + 1, **{k: float(v) for k, v in metrics.items()}}
                curve.append(record)
                progress.update(bar, description=f"loss {fmt(record['loss'])} acc {fmt(record['accuracy'])}")
            progress.update(bar, completed=i + 1)
    trained = time.perf_counter()

    state = to_hf_state_dict(nnx.merge(graphdef, params, rest))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        save_checkpoint(staging, config, state, tokenizer)
        scores = evaluate_checkpoint(staging, c, stop=stop.is_set)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result = {
        "key": c.key(), "config": c.model_dump(mode="json"), "train_transcripts": len(fits),
        "parameters": int(sum(np.size(v) for v in state.values())), "curve": curve, "eval": scores,
        "wall_s": {"prepare": prepared - started, "train": trained - prepared, "eval": time.perf_counter() - trained,
                   "total": time.perf_counter() - started},
        "jax": jax.__version__,
    }
    (staging / RESULT_FILE).write_text(json.dumps(result, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return result


def evaluate_checkpoint(directory: str | pathlib.Path, c: WarmstartConfig, *,
                        stop: Callable[[], bool] | None = None) -> dict[str, dict[str, float]]:
    """Held-out scores of the checkpoint at ``directory`` on ``c``'s suite: ``{"sampled":
    ... (over ``c.eval.samples`` episodes per task), "greedy": ...}`` (see :func:`hetrl.orchestrator.evaluation.evaluate_tasks`;
    ``stop``: raise :class:`~hetrl.stopping.Stopped` between batches once it is true)."""
    from tokenizers import Tokenizer

    from hetrl.core.schema import SamplingParams
    from hetrl.orchestrator.episodes import EpisodeRunner
    from hetrl.orchestrator.evaluation import evaluate_tasks
    from hetrl.samplers.embedded import EmbeddedSampler
    from hetrl.samplers.profiles import sampler_numerics

    directory = pathlib.Path(directory)
    config = ModelConfig.load(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    chat = ChatFormat.from_tokenizer(tokenizer)
    env_config = CodingEnvConfig(max_turns=c.eval.max_turns)
    runner = EpisodeRunner(chat, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                           lambda: CodingEnv(env_config), max_new_tokens=c.eval.max_new_tokens,
                           max_length=config.max_position_embeddings, vocab_size=config.vocab_size,
                           stop_token_ids=(chat.im_end_id,))
    heldout = synthetic_suite(c.suite).heldout[: c.eval.tasks]
    sampler = EmbeddedSampler.from_checkpoint(directory, sampler_numerics("fp32"), pool="eval", seed=c.seed,
                                              max_batch=32, batch_buckets=(32,))
    return {
        "sampled": evaluate_tasks(runner, sampler, list(heldout) * c.eval.samples,
                                  SamplingParams(temperature=c.eval.temperature), stop=stop),
        "greedy": evaluate_tasks(runner, sampler, heldout, SamplingParams(temperature=1.0, top_k=1), stop=stop),
    }
