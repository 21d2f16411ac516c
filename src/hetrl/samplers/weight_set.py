"""One published weight version as replicas receive it (DESIGN §5).

A :class:`WeightSet` is the trainer's HF-named arrays of one ``version`` (a read-only mapping,
so every :meth:`hetrl.samplers.base.Sampler.update_weights` and every wrapper takes it like a
plain ``dict``) plus the forms of those weights staged for the replicas: the parameter arrays of
one embedded weight format, the directory of a disk export, an object-store reference. A form is
built once per set and key (:meth:`WeightSet.staged`): the first caller builds it, concurrent
callers of the same key wait for it, later ones reuse it, so every replica of a format shares one
quantization and one copy. The set is dropped with its version (the fleet keeps only the newest),
and with it every staged form no replica still holds.

The transports of :mod:`hetrl.orchestrator.transport` stage forms at publication; a replica given
a set nobody staged for it (or a plain mapping) builds the form itself.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Hashable, Iterator, Mapping, TypeVar

import numpy as np

__all__ = ["WeightSet"]

T = TypeVar("T")


class WeightSet(Mapping[str, np.ndarray]):
    """HF-named weights of ``version`` and their staged forms (see the module docstring).

    ``builds`` counts how often each key's form was built (1 per key, by construction)."""

    def __init__(self, version: int, arrays: Mapping[str, np.ndarray]):
        self.version = int(version)
        self._arrays = arrays
        self._lock = threading.Lock()
        self._forms: dict[Hashable, Any] = {}
        self._building: dict[Hashable, threading.Lock] = {}
        self.builds: Counter = Counter()

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def staged(self, key: Hashable, build: Callable[["WeightSet"], T]) -> T:
        """The form of these weights under ``key``: ``build(self)`` the first time (thread-safe:
        one build per key, callers of other keys are not held up), the same object afterwards.
        A build that raises leaves nothing behind (the next caller tries again)."""
        with self._lock:
            if key in self._forms:
                return self._forms[key]
            gate = self._building.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                if key in self._forms:
                    return self._forms[key]
            form = build(self)
            with self._lock:
                self._forms[key] = form
                self.builds[key] += 1
                self._building.pop(key, None)
            return form
