"""Weight transports (hetrl.orchestrator.transport) and the in-place embedded update.

* staging: the parameter arrays staged straight from HF weights equal, bit for bit, those of a
  model built from the quantized weights (the reference path), for plain-cast and quantizing
  formats, on values that exercise rounding ties and subnormals;
* in place: an update keeps the sampler's model (graph definition, flattening, compiled
  function) and afterwards generates exactly what a replica freshly built on the new weights does;
* once per format: a published set is validated once and quantized once per weight format, and
  every replica of that format holds the same arrays;
* shared disk: one export per version, the one every server replica is pointed at;
* Ray object store (real Ray, slow): the set is put once and each replica actor fetches it by
  reference, then samples what a local replica with the same weights samples;
* the loop's choice: each backend publishes to its embedded replicas through its own transport
  (one staging per distinct format) and to server pools through the shared disk.
"""

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

from hetrl.core.schema import SamplingParams
from hetrl.models.hf_io import CheckpointError, verify_manifest
from hetrl.models.qwen_jax import from_hf_state_dict
from hetrl.models.tiny import TINY_QWEN3, random_state_dict
from hetrl.orchestrator.transport import (OBJECT_STORE, InProcessTransport, SharedDiskTransport, WeightPublisher,
                                          object_ref)
from hetrl.samplers import embedded
from hetrl.samplers.base import GenerationRequest
from hetrl.samplers.embedded import (QUANTIZED_WEIGHT, EmbeddedSampler, compiled_programs, quantize_weights,
                                     stage_parameters, staging_key)
from hetrl.samplers.fleet import Fleet, PoolConfig
from hetrl.samplers.profiles import sampler_numerics
from hetrl.samplers.weight_set import WeightSet

SHAPES = dict(max_batch=4, batch_buckets=(4,))
BF16 = sampler_numerics("b200", "bf16")
FP8 = sampler_numerics("b200", "fp8_e4m3")
NUMERICS = [sampler_numerics("fp32"), BF16, FP8, sampler_numerics("b200", "nvfp4"), sampler_numerics("mi300x")]


def _weights(seed: int) -> dict[str, np.ndarray]:
    """Random HF weights with bf16 rounding ties (1 + 2^-8 lies halfway between two bf16
    values) and float32 subnormals planted in a quantized and an unquantized tensor."""
    w = random_state_dict(TINY_QWEN3, seed=seed, init_std=0.15)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        flat = w[name].reshape(-1)
        flat[:4] = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3e-39]
    return w


def _requests(n: int = 4) -> list[GenerationRequest]:
    rng = np.random.default_rng(1)
    return [GenerationRequest(f"r{i}", rng.integers(3, TINY_QWEN3.vocab_size, size=6).astype(np.int32),
                              SamplingParams(temperature=1.0, top_p=0.9), 8) for i in range(n)]


@pytest.mark.parametrize("numerics", NUMERICS, ids=lambda n: n.name)
def test_staged_parameters_equal_a_model_built_from_the_quantized_weights(numerics):
    w = _weights(0)
    dtype = embedded._DTYPES[numerics.param_format]
    reference = jax.tree.leaves(nnx.split(from_hf_state_dict(TINY_QWEN3, quantize_weights(w, numerics),
                                                             param_dtype=dtype))[1])
    staged = stage_parameters(w, TINY_QWEN3, numerics)
    assert len(staged) == len(reference)
    for a, b in zip(staged, reference):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_in_place_update_keeps_the_model_and_matches_a_fresh_replica():
    old, new = _weights(0), _weights(1)
    a = EmbeddedSampler(TINY_QWEN3, old, BF16, seed=5, **SHAPES)
    graphdef, treedef = a._graphdef, a._treedef
    before = a.generate(_requests())
    compiled = compiled_programs()
    a.update_weights(3, new)
    assert a._graphdef is graphdef and a._treedef is treedef  # the same model, only its arrays replaced
    a.reseed(5)
    after = a.generate(_requests())
    assert compiled_programs() == compiled  # no re-jit
    fresh = EmbeddedSampler(TINY_QWEN3, new, BF16, seed=5, version=3, **SHAPES).generate(_requests())
    for x, y in zip(after, fresh):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
        np.testing.assert_array_equal(x.policy_version, y.policy_version)
    assert all(np.all(g.policy_version == 3) for g in after)
    assert sum(not np.array_equal(x.token_ids, y.token_ids) for x, y in zip(before, after)) >= 2


def test_a_published_set_is_quantized_once_per_format_and_shared(monkeypatch):
    calls = []
    real = embedded.quantize_dequantize
    monkeypatch.setattr(embedded, "quantize_dequantize", lambda x, fmt: calls.append(fmt) or real(x, fmt))
    w0 = _weights(0)
    pools = [PoolConfig(name="bf16-a", accelerator="b200", weight_precision="bf16", replicas=2),
             PoolConfig(name="bf16-b", accelerator="b200", weight_precision="bf16", kv_precision="fp8_e4m3"),
             PoolConfig(name="fp8", accelerator="b200", weight_precision="fp8_e4m3", replicas=2)]
    replicas = [(p, EmbeddedSampler(TINY_QWEN3, w0, p.numerics(), pool=p.name, **SHAPES))
                for p in pools for _ in range(p.replicas)]
    fleet = Fleet(replicas)
    publisher = WeightPublisher(fleet, [InProcessTransport(TINY_QWEN3, [p.numerics() for p in pools])])
    calls.clear()
    published = publisher.publish(1, _weights(1))
    quantized = sum(bool(QUANTIZED_WEIGHT.fullmatch(n)) for n in published)
    assert calls == ["fp8_e4m3"] * quantized  # fp8 once; bf16 is a cast, the bf16 pools differ only in KV
    assert fleet.published_version == 1
    for r in fleet.replicas:  # what each replica's worker does before its next call
        r.sampler.update_weights(published.version, published)
    assert calls == ["fp8_e4m3"] * quantized  # loading quantized nothing again
    assert set(published.builds.values()) == {1} and len(published.builds) == 3  # the check + 2 formats
    by_format: dict[tuple, list] = {}
    for r in fleet.replicas:
        assert r.sampler.weight_version == 1
        by_format.setdefault(staging_key(TINY_QWEN3, r.sampler.numerics), []).append(r.sampler._leaves)
    assert len(by_format) == 2
    for group in by_format.values():
        assert all(a is b for leaves in group[1:] for a, b in zip(group[0], leaves))  # one copy per format
    bf16, fp8 = by_format.values()
    assert not any(a is b for a, b in zip(bf16, fp8))


def test_a_bad_set_is_refused_by_every_replica_and_changes_nothing():
    a = EmbeddedSampler(TINY_QWEN3, _weights(0), BF16, **SHAPES)
    leaves = a._leaves
    bad = WeightSet(1, {**_weights(1), "model.norm.weight": np.full(TINY_QWEN3.hidden_size, np.nan, np.float32)})
    for _ in range(2):  # a failed check stages nothing: the next replica checks again and fails again
        with pytest.raises(CheckpointError, match="model.norm.weight.*NaN"):
            a.update_weights(1, bad)
    assert a._leaves is leaves and a.weight_version == 0 and not bad.builds


def test_shared_disk_transport_exports_each_version_once(tmp_path):
    from hetrl.samplers.sglang import disk_export

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(TINY_QWEN3.model_dump_json())
    transport = SharedDiskTransport(TINY_QWEN3, tmp_path / "weights", base)
    published = WeightSet(4, _weights(2))
    transport.stage(published)
    directory = tmp_path / "weights" / "v00000004"
    verify_manifest(directory, required=True)
    assert (directory / "config.json").read_text() == TINY_QWEN3.model_dump_json()
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    # a server replica loading the set is pointed at that export; nothing is written again
    assert disk_export(4, published, TINY_QWEN3, tmp_path / "weights", base) == directory.resolve()
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp
    assert list(published.builds.values()) == [1]


def test_shared_disk_transport_keeps_only_the_newest_exports(tmp_path):
    """Versions are exported at publication whether or not a server replica is alive to load
    them (a dead pool loads nothing), so the export itself keeps the directory to the newest few."""
    from hetrl.samplers.sglang import KEEP_EXPORTS

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(TINY_QWEN3.model_dump_json())
    transport = SharedDiskTransport(TINY_QWEN3, tmp_path / "weights", base)
    versions = range(1, KEEP_EXPORTS + 3)
    for version in versions:
        transport.stage(WeightSet(version, _weights(version)))
    kept = sorted(int(d.name[1:]) for d in (tmp_path / "weights").glob("v[0-9]*"))
    assert kept == list(versions)[-KEEP_EXPORTS:]


@pytest.mark.slow
def test_ray_transport_puts_once_and_each_actor_fetches_by_reference():
    ray = pytest.importorskip("ray")
    from hetrl.orchestrator.ray_backend import HostActor, RaySampler
    from hetrl.orchestrator.transport import RayObjectStoreTransport

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="hetrl-ray-", dir="/tmp")
    ray.init(num_cpus=1, _temp_dir=temp, include_dashboard=False)
    try:
        w0, w1 = _weights(0), _weights(1)
        actors = [HostActor.remote(EmbeddedSampler, TINY_QWEN3, w0, BF16, seed=7, **SHAPES) for _ in range(2)]
        samplers = [RaySampler(actor) for actor in actors]
        published = WeightSet(2, w1)
        puts = []
        real_put = ray.put
        ray.put = lambda value, **kw: puts.append(len(value)) or real_put(value, **kw)
        try:
            RayObjectStoreTransport().stage(published)
            for s in samplers:
                s.update_weights(2, published)
        finally:
            ray.put = real_put
        assert puts == [len(w1)]  # one put of the whole set; the actors were sent its reference
        assert isinstance(published.staged(OBJECT_STORE, lambda ws: None), ray.ObjectRef)
        assert object_ref(published) is published.staged(OBJECT_STORE, lambda ws: None)
        assert [s.health().weight_version for s in samplers] == [2, 2]
        local = EmbeddedSampler(TINY_QWEN3, w1, BF16, seed=7, **SHAPES)
        for x, y in zip(samplers[1].generate(_requests()), local.generate(_requests())):
            np.testing.assert_array_equal(x.token_ids, y.token_ids)
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
            assert np.all(x.policy_version == 2)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_each_backend_publishes_through_its_transports(tmp_path):
    from hetrl.config import load_config
    from hetrl.orchestrator.local import LocalOrchestrator
    from hetrl.orchestrator.ray_backend import RayOrchestrator
    from hetrl.orchestrator.transport import RayObjectStoreTransport

    cfg = load_config("tiny_mixed_sglang.yaml", [f"output_dir={tmp_path}"])
    embedded_pools = [p for p in cfg.fleet.pools if p.engine == "embedded"]
    assert embedded_pools and len(embedded_pools) < len(cfg.fleet.pools)  # both kinds of pool
    formats = {(p.numerics().weight_format, p.numerics().param_format) for p in embedded_pools}
    for backend, transport in ((LocalOrchestrator, InProcessTransport), (RayOrchestrator, RayObjectStoreTransport)):
        orch = backend(cfg, console=False)
        orch.model_config, orch.model_dir = TINY_QWEN3, tmp_path / "model"  # what the set-up resolves
        embedded_side, disk = orch._transports()
        assert type(embedded_side) is transport and isinstance(disk, SharedDiskTransport)
        assert disk.root == orch.folder.weights and disk.model_dir == tmp_path / "model"
        if transport is InProcessTransport:  # one staging per distinct format among the embedded pools
            assert sorted((n.weight_format, n.param_format) for n in embedded_side.numerics) == sorted(formats)
