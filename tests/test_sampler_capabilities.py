"""The optional sampler capabilities (:class:`hetrl.samplers.base.Reseedable`,
:class:`hetrl.samplers.base.Abortable`): every wrapper forwards reseed and abort or says it
cannot, lockstep refuses a replica that cannot reseed, and the embedded engine's abort cuts a
running call between decode steps."""

import numpy as np
import pytest

from hetrl.config import ConfigError, load_config
from hetrl.core.schema import SamplingParams
from hetrl.orchestrator.local import LocalOrchestrator
from hetrl.samplers.base import (CapabilityMissing, Generation, GenerationRequest, SamplerHealth, abort, can_abort,
                                 can_reseed, reseed)
from hetrl.samplers.faults import ChaosConfig, ChaosLedger, ChaosSampler, Dies, Poisoned, Slow
from hetrl.samplers.fleet import PoolConfig

POOL = PoolConfig(name="b200-bf16", accelerator="b200", weight_precision="bf16")


class Plain:
    """A sampler without the reseed capability: the tokens it returns are drawn from its own stream."""

    def __init__(self, seed: int = 0):
        self._info = POOL.numerics().sampler_info(POOL.name, POOL.engine, "fake")
        self.rng = np.random.default_rng(seed)

    @property
    def info(self):
        return self._info

    def generate(self, requests):
        return [Generation(request_id=r.request_id, token_ids=self.rng.integers(100, size=2).astype(np.int32),
                           logprobs=np.full(2, -0.1, np.float32), policy_version=np.zeros(2, np.int32),
                           finish_reason="length", support=None, sampler=self._info) for r in requests]

    def update_weights(self, version, weights):
        pass

    def health(self):
        return SamplerHealth(healthy=True, weight_version=0)


class Seedable(Plain):
    supports_reseed = True

    def reseed(self, seed):
        self.rng = np.random.default_rng(seed)


class Stoppable(Plain):
    supports_abort = True

    def __init__(self):
        super().__init__()
        self.aborts = 0

    def abort(self):
        self.aborts += 1


REQUESTS = [GenerationRequest(f"g/{i}", np.array([1, 2], np.int32), SamplingParams(), 1) for i in range(8)]
WRAPPERS = [lambda s: Slow(s, 0.0), Poisoned, lambda s: ChaosSampler(s, ChaosConfig(poison_rate=0.5), 1, ChaosLedger())]


@pytest.mark.parametrize("wrap", WRAPPERS, ids=["slow", "poisoned", "chaos"])
def test_a_wrapper_has_reseed_exactly_when_its_inner_sampler_has_it(wrap):
    assert can_reseed(wrap(Seedable())) and can_reseed(Seedable())
    plain = wrap(Plain())
    assert not can_reseed(plain) and not can_reseed(Plain())
    with pytest.raises(CapabilityMissing, match="cannot reseed"):
        reseed(plain, 1)
    with pytest.raises(CapabilityMissing, match="cannot reseed"):
        plain.reseed(1)


@pytest.mark.parametrize("wrap", WRAPPERS + [Dies], ids=["slow", "poisoned", "chaos", "dies"])
def test_a_wrapper_has_abort_exactly_when_its_inner_sampler_has_it(wrap):
    inner = Stoppable()
    wrapped = wrap(inner)
    assert can_abort(wrapped) and not can_reseed(wrapped)
    abort(wrapped)
    wrapped.abort()
    assert inner.aborts == 2
    plain = wrap(Plain())
    assert not can_abort(plain) and not can_abort(Plain())
    with pytest.raises(CapabilityMissing, match="cannot abort"):
        abort(plain)
    with pytest.raises(CapabilityMissing, match="cannot abort"):
        plain.abort()


def test_dies_forwards_reseed_too():
    inner = Seedable()
    Dies(inner).reseed(7)
    assert inner.rng.integers(1 << 30) == np.random.default_rng(7).integers(1 << 30)


def _draws(sampler):
    out = sampler.generate(REQUESTS)
    return [(g.token_ids.tolist(), g.logprobs.tolist(), g.policy_version.tolist(), g.sampler.pool) for g in out]


def test_a_reseeded_chaos_sampler_repeats_its_samples_and_its_faults():
    ledger = ChaosLedger()
    config = ChaosConfig(poison_rate=0.5, slow_rate=0.5, slow_s=0.0)
    a, b = ChaosSampler(Seedable(1), config, 11, ledger), ChaosSampler(Seedable(2), config, 22, ledger)
    _draws(a)  # a's streams (samples and faults) are ahead of b's
    a.reseed(5)
    b.reseed(5)
    first = _draws(a)
    assert first == _draws(b) and ledger.counts["poisoned"] > 0
    a.reseed(6)
    assert _draws(a) != first


class _Stub(LocalOrchestrator):
    """A local orchestrator whose embedded replicas are :class:`Plain` or :class:`Seedable` fakes."""

    inner = Plain

    def _create_sampler(self, numerics, *, pool, seed):
        return self.inner()


def _config(tmp_path, schedule):
    extra = ["async.max_staleness=0"] if schedule == "lockstep" else []
    return load_config("tiny_homogeneous.yaml", [f"output_dir={tmp_path}", f"async.schedule={schedule}", *extra])


def test_lockstep_refuses_a_replica_that_cannot_reseed(tmp_path):
    cfg = _config(tmp_path, "lockstep")
    pool, numerics = cfg.fleet.pools[0], cfg.fleet.pools[0].numerics()
    with pytest.raises(ConfigError, match=f"Plain sampler of pool '{pool.name}' cannot reseed"):
        _Stub(cfg, console=False)._make_sampler(pool, numerics, 0)
    seedable = type("S", (_Stub,), {"inner": Seedable})
    with pytest.raises(ConfigError, match="Slow sampler .* cannot reseed"):  # a wrapper cannot add the capability
        _Stub(cfg, wrap_sampler=lambda p, i, s: Slow(s, 0.0), console=False)._make_sampler(pool, numerics, 0)
    assert can_reseed(seedable(cfg, wrap_sampler=lambda p, i, s: Slow(s, 0.0), console=False)._make_sampler(pool, numerics, 0))
    assert not can_reseed(_Stub(_config(tmp_path, "async"), console=False)._make_sampler(pool, numerics, 0))


def test_the_embedded_engine_aborts_a_running_call_between_decode_steps():
    """A call aborted while it decodes returns at once: every row ``abort`` with the tokens
    sampled so far, which are the first tokens of the same call left to run (same seed); a call
    started after the abort runs to its end."""
    import threading

    from hetrl.models.tiny import TINY_QWEN3, random_state_dict
    from hetrl.samplers.embedded import EmbeddedSampler
    from hetrl.samplers.profiles import sampler_numerics

    def engine():
        return EmbeddedSampler(TINY_QWEN3, random_state_dict(TINY_QWEN3, seed=0, init_std=0.15), sampler_numerics("fp32"),
                               seed=3, max_batch=2, batch_buckets=(2,))

    n = 512  # long enough that the abort lands while it decodes (checked every 128 steps)
    reqs = [GenerationRequest(f"a/{i}", np.array([5, 6, 7 + i], np.int32), SamplingParams(temperature=1.0, top_k=20), n)
            for i in range(2)]
    full = engine().generate(reqs)
    assert all(g.finish_reason == "length" and len(g.token_ids) == n for g in full)
    sampler = engine()
    assert can_abort(sampler)
    sampler.abort()  # nothing running: no effect on a later call
    out: list = []
    call = threading.Thread(target=lambda: out.extend(sampler.generate(reqs)))
    call.start()
    while sampler.health().in_flight == 0:
        pass
    abort(sampler)
    call.join(60)
    assert not call.is_alive()
    for cut, whole in zip(out, full):
        t = len(cut.token_ids)
        assert cut.finish_reason == "abort" and 1 <= t < n
        assert len(cut.logprobs) == len(cut.policy_version) == len(cut.support.offsets) - 1 == t
        np.testing.assert_array_equal(cut.token_ids, whole.token_ids[:t])
        np.testing.assert_allclose(cut.logprobs, whole.logprobs[:t], rtol=0, atol=1e-6)
    again = sampler.generate(reqs)  # a call after the abort is not affected
    assert all(g.finish_reason == "length" and len(g.token_ids) == n for g in again)
