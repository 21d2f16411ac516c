"""``environment.name: coding`` in the loop: train and held-out splits from task files
(hetrl.envs.task_files.task_splits, hetrl.orchestrator.loop)."""

import json

import pytest

from hetrl.config import ConfigError, load_config
from hetrl.envs.task_files import TaskSetError, load_task_file, task_splits
from hetrl.orchestrator.local import LocalOrchestrator
from hetrl.orchestrator.preflight import check_runnable
from hetrl.samplers.faults import Slow


def _mbpp(i: int, name: str, op: str) -> dict:
    return {"task_id": i, "text": f"Return x {op} 1.", "code": f"def {name}(x):\n    return x {op} 1",
            "test_list": [f"assert {name}(1) == 1 {op} 1", f"assert {name}(5) == 5 {op} 1"]}


TRAIN = [_mbpp(1, "inc", "+"), _mbpp(2, "dec", "-"), _mbpp(3, "dbl", "*"), _mbpp(4, "half", "//")]
HELD = [_mbpp(5, "mod", "%"), _mbpp(6, "pw", "**")]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_task_splits_from_two_files_or_held_out_by_seed(tmp_path):
    train, held = _write(tmp_path / "train.jsonl", TRAIN), _write(tmp_path / "held.jsonl", HELD)
    splits = task_splits(train, held)
    assert [t.task_id for t in splits.train] == ["mbpp-1", "mbpp-2", "mbpp-3", "mbpp-4"]
    assert [t.task_id for t in splits.heldout] == ["mbpp-5", "mbpp-6"] and splits.train_pass(3) == splits.train
    one = task_splits(train, heldout_fraction=0.25, seed=1)
    assert len(one.heldout) == 1 and len(one.train) == 3
    assert {t.task_id for t in one.train} | {t.task_id for t in one.heldout} == {t.task_id for t in splits.train}
    assert task_splits(train, heldout_fraction=0.25, seed=1) == one
    assert {task_splits(train, heldout_fraction=0.25, seed=s).heldout[0].task_id for s in range(12)} != {one.heldout[0].task_id}
    with pytest.raises(TaskSetError, match="1 task ids are both in train"):
        task_splits(train, _write(tmp_path / "overlap.jsonl", [TRAIN[0]]))


def test_a_coding_config_names_existing_task_sets(tmp_path):
    config = load_config("tiny_mixed.yaml", [f"output_dir={tmp_path}",
                                             "environment={name: coding, options: {train: nope.jsonl}}"])
    with pytest.raises(ConfigError, match="environment.options.train: no task set 'nope.jsonl'"):
        check_runnable(config)
    with pytest.raises(ConfigError, match="options.coding.max_turn"):
        load_config("tiny_mixed.yaml", ["environment={name: coding, options: {train: realcode, coding: {max_turn: 2}}}"])
    for name in ("qwen3_tpu_jax.yaml", "qwen3_b200_megatron.yaml"):  # the cluster examples' coding section
        options = load_config(name).environment.options
        assert (options.train, options.heldout, options.coding.max_turns) == ("realcode", "humaneval", 4)


class _Recording(Slow):
    """Records the prompt ids of every first-turn request the loop's samplers get."""

    def __init__(self, inner, seen):
        super().__init__(inner, 0.0)
        self.seen = seen

    def generate(self, requests):
        self.seen.extend(tuple(r.prompt_ids.tolist()) for r in requests)
        return super().generate(requests)


@pytest.mark.slow
def test_the_loop_trains_on_the_train_file_and_evaluates_the_held_out_file(tmp_path):
    train, held = _write(tmp_path / "train.jsonl", TRAIN), _write(tmp_path / "held.jsonl", HELD)
    config = load_config("tiny_mixed.yaml", [
        f"output_dir={tmp_path / 'run'}", "steps=2", "async.batch_groups=2", "async.group_size=2",
        "async.max_new_tokens=16", "fleet.pools=[{name: a, accelerator: h100, weight_precision: bf16}]",
        f"environment={{name: coding, options: {{train: {train}, heldout: {held}, eval: {{every: 1, tasks: 2}}, "
        "coding: {max_turns: 1}}}",
    ])
    seen: list[tuple] = []
    orchestrator = LocalOrchestrator(config, wrap_sampler=lambda pool, index, s: _Recording(s, seen), console=False)
    result = orchestrator.run()
    assert len(result.trained) >= 4 and not result.final.get("stopped")
    prompts = {tuple(orchestrator.runner.prompt_ids(t).tolist()): t.task_id
               for t in load_task_file(train) + load_task_file(held)}
    trained_on = {prompts[p] for p in seen if p in prompts}
    assert trained_on and trained_on <= {"mbpp-1", "mbpp-2", "mbpp-3", "mbpp-4"}
    evaluated = [json.loads(line)["task_id"] for f in sorted((tmp_path / "run" / "generations").glob("eval-*.jsonl"))
                 for line in f.read_text().splitlines()]
    assert evaluated and set(evaluated) == {"mbpp-5", "mbpp-6"}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/success" in m for m in metrics)
