"""Coverage-guided fuzzing of the rollout decoder and validator with atheris (libFuzzer).

Run by tests/test_rollout_fuzz.py for a bounded number of inputs (``-runs=N``), or by hand for
longer: ``python tests/fuzz_rollouts_atheris.py CORPUS_DIR -max_total_time=600``. The corpus
is seeded with a valid message. An input crashes the target when decoding raises anything, or
an error is not a RolloutError naming a field, or a decoded rollout fails validation.
"""

import sys

import atheris

with atheris.instrument_imports(include=["hetrl.core.schema"]):
    from hetrl.core.schema import RolloutError, decode_rollouts_lenient

VOCAB = 50


def target(data: bytes) -> None:
    rollouts, errors = decode_rollouts_lenient(data, vocab_size=VOCAB)
    for err in errors:
        if type(err) is not RolloutError or not err.field:
            raise AssertionError(f"unexpected error {err!r}")
    for r in rollouts:
        r.validate(VOCAB)


if __name__ == "__main__":
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()
