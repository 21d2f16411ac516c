"""The prompt pipeline (Grain): shuffled, per-process, batched, checkpointable.

Over a random-access prompt source of N records (any ``Sequence``: lists of dicts, an
``ArrayRecord`` data source, ...), the global stream is element ``i`` ↦ record
``π_e(i mod N)`` with epoch ``e = i div N`` and ``π_e`` a permutation seeded by ``seed + e``
(identity when not shuffling). Global batch ``k`` is stream elements ``[k·G, (k+1)·G)`` for
``G = batch_size``; process ``p`` of ``P`` takes the elements ``≡ p (mod P)`` of it, ``G/P``
records, so the union over processes, and thus training, does not depend on ``P``.

A batch is a ``list`` of records (prompts are ragged; collation happens after sampling). The
iterator's position is a small JSON state (``get_state`` / ``set_state``), which
:class:`hetrl.trainer_jax.checkpoint.TrainCheckpointer` stores with the model.
"""

from __future__ import annotations

from typing import Any, Sequence

import grain
import jax

from hetrl.trainer_jax.config import PromptDataConfig

__all__ = ["prompt_dataset", "prompt_iterator"]


def prompt_dataset(
    source: Sequence[Any],
    config: PromptDataConfig,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.IterDataset:
    """This process's batches (lists of ``config.batch_size / process_count`` records)."""
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if config.batch_size % count:
        raise ValueError(f"batch_size {config.batch_size} does not split over {count} processes")
    if len(source) < config.batch_size:
        raise ValueError(f"the prompt source holds {len(source)} records, fewer than one batch of {config.batch_size}")
    ds = grain.MapDataset.source(source)
    if config.shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(config.num_epochs)  # re-seeds the shuffle each epoch
    ds = ds[index::count]
    ds = ds.batch(config.batch_size // count, drop_remainder=True, batch_fn=list)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=config.prefetch))


def prompt_iterator(source: Sequence[Any], config: PromptDataConfig, **kwargs: Any) -> grain.DatasetIterator:
    """A fresh checkpointable iterator over :func:`prompt_dataset`."""
    return iter(prompt_dataset(source, config, **kwargs))
