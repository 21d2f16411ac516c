"""``hetrl eval MODEL --tasks SOURCE [--samples k]``: pass@k of a checkpoint on a task set.

``MODEL`` is an HF checkpoint directory (``config.json``, safetensors, ``tokenizer.json``) or a run
folder (its ``hf/latest`` export; ``runs/x/hf/step-<n>`` works too). ``SOURCE`` is a task set of
:func:`hetrl.envs.task_files.load_tasks`: ``humaneval``, ``realcode``, ``synthetic`` (held out),
``synthetic:train``, a HumanEval/MBPP-format JSONL file or a repository-task directory.

Every task is played ``--samples`` times (episodes of the coding environment, multi-turn as in
training) by the embedded sampler in its exact fp32 profile; sandboxes of a batch run in parallel
(``--workers``). Sampling settings are those of training unless given: a run folder's
``async.sampling``, ``async.max_new_tokens`` and coding options (``config.yaml``); a warm start's
evaluation settings (``warmstart.json``, whose suite is also the ``synthetic`` sources' suite);
else the defaults of :class:`~hetrl.core.schema.SamplingParams` and
:class:`~hetrl.envs.coding.CodingEnvConfig`.

Written to ``--out`` (default ``runs/eval/<model>-<source>``): ``results.jsonl`` (per task:
``n``, ``correct``, ``pass@k`` for each k, mean reward), ``episodes.jsonl`` (every episode's
prompt, completion, reward and success) and ``summary.json`` (the means, the settings). pass@k is
the unbiased estimator (:func:`hetrl.orchestrator.evaluation.pass_at_k`) averaged over tasks.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["add_arguments", "run", "resolve_checkpoint", "evaluate"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an HF checkpoint directory, or a run folder (its hf/latest)")
    parser.add_argument("--tasks", required=True, metavar="SOURCE",
                        help="humaneval | realcode | synthetic | synthetic:train | a HumanEval/MBPP .jsonl file | "
                             "a repository-task directory")
    parser.add_argument("--samples", type=int, default=1, help="episodes per task (n of pass@k; default 1)")
    parser.add_argument("--k", default=None, help="comma-separated k of pass@k (default 1 and the powers of ten up to n)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    parser.add_argument("--temperature", type=float, default=None, help="default: as in training")
    parser.add_argument("--top-p", type=float, default=None, help="default: as in training")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (top_k=1; needs --samples 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per turn; default: as in training")
    parser.add_argument("--max-turns", type=int, default=None, help="answers per episode; default: as in training")
    parser.add_argument("--workers", type=int, default=4, help="episodes graded at once (sandboxes in parallel)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's random stream")
    parser.add_argument("--out", default=None, help="output directory (default runs/eval/<model>-<source>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to evaluate and the settings it was trained with: ``sampling`` (a
    SamplingParams), ``max_new_tokens``, ``coding`` (a CodingEnvConfig), ``suite`` (a SuiteConfig
    or None for the default suite)."""

    directory: pathlib.Path
    name: str
    sampling: Any
    max_new_tokens: int
    coding: Any
    suite: Any


def resolve_checkpoint(model: str) -> Checkpoint:
    """The checkpoint directory of ``model`` and its training-time settings (module docstring);
    :class:`~hetrl.errors.UserError` when it is neither a checkpoint nor a run folder."""
    from hetrl.core.schema import SamplingParams
    from hetrl.envs.coding import CodingEnvConfig
    from hetrl.errors import UserError

    path = pathlib.Path(model)
    if (path / "hf" / "latest").exists():
        run_dir, directory = path, path / "hf" / "latest"
    elif path.parent.name == "hf" and (path.parent.parent / "config.yaml").exists():
        run_dir, directory = path.parent.parent, path
    else:
        run_dir, directory = None, path
    if not (directory / "config.json").is_file() or not (directory / "tokenizer.json").is_file():
        raise UserError(f"{model}: not an HF checkpoint (config.json, tokenizer.json, safetensors) nor a run folder "
                        "with hf/latest")
    directory = directory.resolve()
    name = (run_dir or path).resolve().name
    if run_dir is not None:
        from hetrl.config import SyntheticEnvironmentSection, load_config

        config = load_config(run_dir / "config.yaml")
        env = config.environment
        if isinstance(env, SyntheticEnvironmentSection):
            coding, suite = env.options.coding, env.options.suite or (
                config.model.warmstart.suite if config.model.warmstart else None)
        else:
            coding, suite = env.options, None
        return Checkpoint(directory, name, config.async_.sampling, config.async_.max_new_tokens, coding, suite)
    warmstart = directory / "warmstart.json"
    if warmstart.is_file():
        from hetrl.warmstart.config import WarmstartConfig

        c = WarmstartConfig.model_validate(json.loads(warmstart.read_text())["config"])
        return Checkpoint(directory, name, SamplingParams(temperature=c.eval.temperature), c.eval.max_new_tokens,
                          CodingEnvConfig(max_turns=c.eval.max_turns), c.suite)
    return Checkpoint(directory, name, SamplingParams(), 512, CodingEnvConfig(), None)


def _ks(spec: str | None, n: int) -> list[int]:
    from hetrl.errors import UserError

    if spec is None:
        return sorted({1, *(10 ** i for i in range(1, 4) if 10 ** i <= n)})
    try:
        ks = sorted({int(k) for k in spec.split(",")})
    except ValueError:
        raise UserError(f"--k {spec!r}: give comma-separated integers, e.g. 1,5,10") from None
    if ks[0] < 1 or ks[-1] > n:
        raise UserError(f"--k {spec!r}: each k must be between 1 and --samples ({n})")
    return ks


def evaluate(ckpt: Checkpoint, source: str, *, samples: int, ks: list[int], sampling: Any, coding: Any,
             max_new_tokens: int, limit: int | None, workers: int, seed: int, out: pathlib.Path,
             progress: bool = True, stop=None) -> dict[str, Any]:
    """Play every task of ``source`` ``samples`` times and write the results to ``out`` (module
    docstring); returns the summary."""
    from hetrl.envs.task_files import hidden_paths, load_tasks

    tasks = list(load_tasks(source, ckpt.suite))[:limit]  # a bad source fails before the heavy imports

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from tokenizers import Tokenizer

    from hetrl.envs.base import ChatFormat
    from hetrl.envs.coding import CodingEnv
    from hetrl.envs.sandbox import DEFAULT_HIDDEN, Sandbox
    from hetrl.models.config import ModelConfig
    from hetrl.orchestrator.episodes import EpisodeRunner
    from hetrl.orchestrator.evaluation import evaluate_tasks, pass_at_k
    from hetrl.samplers.embedded import EmbeddedSampler
    from hetrl.samplers.profiles import sampler_numerics

    model_config = ModelConfig.load(ckpt.directory)
    tokenizer = Tokenizer.from_file(str(ckpt.directory / "tokenizer.json"))
    chat = ChatFormat.from_tokenizer(tokenizer)
    sandbox = Sandbox(coding.limits, require=coding.require_isolation, hidden=DEFAULT_HIDDEN + hidden_paths(source))
    stops = tuple(dict.fromkeys(i for i in (chat.im_end_id, model_config.eos_token_id) if i is not None))
    runner = EpisodeRunner(chat, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                           lambda: CodingEnv(coding, sandbox), max_new_tokens=max_new_tokens,
                           max_length=model_config.max_position_embeddings, vocab_size=model_config.vocab_size,
                           stop_token_ids=stops)
    sampler = EmbeddedSampler.from_checkpoint(ckpt.directory, sampler_numerics("fp32"), pool="eval", seed=seed,
                                              max_batch=32, batch_buckets=(32,))
    episodes: list[dict] = []
    columns = (TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress) as bar:
        job = bar.add_task("episodes", total=len(tasks) * samples)
        scores = evaluate_tasks(runner, sampler, [t for t in tasks for _ in range(samples)], sampling,
                                batch=32, episodes=episodes, stop=stop, workers=workers,
                                progress=lambda done, total: bar.update(job, completed=done))
    out.mkdir(parents=True, exist_ok=True)
    per_task = []
    for i, task in enumerate(tasks):
        mine = episodes[i * samples:(i + 1) * samples]
        correct = sum(e["success"] for e in mine)
        per_task.append({"task_id": task.task_id, "family": task.family, "n": samples, "correct": correct,
                         **{f"pass@{k}": pass_at_k(samples, correct, k) for k in ks},
                         "reward": sum(e["reward"] for e in mine) / samples})
    _write_jsonl(out / "results.jsonl", per_task)
    _write_jsonl(out / "episodes.jsonl", episodes)
    summary = {"model": str(ckpt.directory), "tasks": source, "n_tasks": len(tasks), "samples": samples,
               **{f"pass@{k}": sum(r[f"pass@{k}"] for r in per_task) / max(len(per_task), 1) for k in ks},
               "success": scores["success"], "reward": scores["reward"], "episodes": len(episodes),
               "sampling": sampling.model_dump(mode="json"), "max_new_tokens": max_new_tokens,
               "max_turns": coding.max_turns, "seed": seed, "isolation": sandbox.isolation.describe()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _write_jsonl(path: pathlib.Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from hetrl.errors import UserError
    from hetrl.stopping import Stopped, signal_handlers

    with signal_handlers("hetrl eval") as stop:
        try:
            for flag, value in (("--samples", args.samples), ("--limit", args.limit), ("--workers", args.workers)):
                if value is not None and value < 1:
                    raise UserError(f"{flag} {value}: needs at least 1")
            if args.greedy and args.samples > 1:
                raise UserError("--greedy gives every sample the same episode: use --samples 1")
            ckpt = resolve_checkpoint(args.model)
            ks = _ks(args.k, args.samples)
            update = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None}
            if args.greedy:
                update.update(temperature=1.0, top_k=1)
            try:
                sampling = ckpt.sampling.model_validate({**ckpt.sampling.model_dump(), **update})
                coding = ckpt.coding.model_copy(update={"max_turns": args.max_turns}) if args.max_turns else ckpt.coding
            except ValidationError as err:
                raise UserError(f"sampling settings: {err.errors()[0]['msg']}") from None
            source_name = pathlib.Path(args.tasks).name.split(".")[0].replace(":", "-")
            out = pathlib.Path(args.out) if args.out else pathlib.Path("runs/eval") / f"{ckpt.name}-{source_name}"
            summary = evaluate(ckpt, args.tasks, samples=args.samples, ks=ks, sampling=sampling, coding=coding,
                               max_new_tokens=args.max_new_tokens or ckpt.max_new_tokens, limit=args.limit,
                               workers=args.workers, seed=args.seed, out=out, progress=not args.no_progress,
                               stop=stop.is_set)
        except Stopped as err:
            print(f"hetrl eval: stopped by {signal.Signals(stop.signum or signal.SIGTERM).name} during {err.phase}; "
                  "nothing written", file=sys.stderr)
            return stop.exit_status
        except UserError as err:
            print(f"hetrl eval: {err}", file=sys.stderr)
            return 1
    passes = ", ".join(f"pass@{k} {summary[f'pass@{k}']:.3f}" for k in ks)
    print(f"{summary['tasks']}: {summary['n_tasks']} tasks x {args.samples} samples: {passes}; "
          f"mean reward {summary['reward']:.3f} -> {out}")
    return 0
