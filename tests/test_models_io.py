"""Model config and HF checkpoint I/O: exact round trips, interoperability, clear errors."""

import hashlib
import json
import re

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from hetrl.models import CheckpointError, ModelConfig, check_state_dict, expected_shapes, load_state_dict, save_state_dict
from hetrl.models.hf_io import read_safetensors, write_safetensors
from hetrl.models.tiny import TINY_QWEN2, TINY_QWEN3, build_tiny_checkpoint, random_state_dict


@pytest.fixture(scope="module", params=[TINY_QWEN3, TINY_QWEN2], ids=["qwen3", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return request.param, build_tiny_checkpoint(tmp_path_factory.mktemp(request.param.model_type), request.param)


def test_transformers_reads_our_checkpoint_exactly(checkpoint):
    config, path = checkpoint
    hf_config = transformers.AutoConfig.from_pretrained(path)
    assert ModelConfig.from_hf_dict(hf_config.to_dict()) == config
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = load_state_dict(path)
    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in ours
        theirs.pop("lm_head.weight")
    assert theirs.keys() == ours.keys()
    for k in ours:
        np.testing.assert_array_equal(theirs[k], ours[k], err_msg=k)
    assert config.parameter_count() == model.num_parameters()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "def f(xs): return sorted(xs)"
    assert tok.decode(tok(text).input_ids) == text
    assert len(tok) <= config.vocab_size


def test_state_dict_round_trips_in_one_file_and_in_shards(tmp_path):
    state = random_state_dict(TINY_QWEN3, seed=1)
    state["model.norm.weight"] = state["model.norm.weight"].astype(ml_dtypes.bfloat16)  # a BF16 tensor too
    save_state_dict(tmp_path / "one", state)
    save_state_dict(tmp_path / "shards", state, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    for d in ("one", "shards"):
        back = load_state_dict(tmp_path / d)
        assert back.keys() == state.keys()
        for k in state:
            assert back[k].dtype == state[k].dtype and np.array_equal(back[k].view(np.uint8), state[k].view(np.uint8)), k


def test_safetensors_files_interoperate_with_the_reference_library(tmp_path):
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, -2], dtype=np.int64)}
    write_safetensors(tmp_path / "ours.safetensors", tensors)
    theirs = safetensors.numpy.load_file(tmp_path / "ours.safetensors")
    safetensors.numpy.save_file(tensors, tmp_path / "theirs.safetensors")
    ours = read_safetensors(tmp_path / "theirs.safetensors")
    for k in tensors:
        np.testing.assert_array_equal(theirs[k], tensors[k])
        np.testing.assert_array_equal(ours[k], tensors[k])


def test_check_state_dict_names_the_problem():
    state = random_state_dict(TINY_QWEN3)
    check_state_dict(TINY_QWEN3, state)
    name = "model.layers.1.mlp.up_proj.weight"
    cases = [
        ({k: v for k, v in state.items() if k != name}, "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        ({**state, "model.layers.9.extra": np.zeros(2, np.float32)}, "unexpected tensor 'model.layers.9.extra'"),
        ({**state, name: state[name][:-1]}, f"tensor '{name}' has shape"),
        ({**state, name: np.full_like(state[name], np.nan)}, f"tensor '{name}' holds NaN"),
        ({**state, name: state[name].astype(np.int32)}, f"tensor '{name}' has dtype int32"),
    ]
    for bad, message in cases:
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
            check_state_dict(TINY_QWEN3, bad)
    assert "lm_head.weight" not in expected_shapes(TINY_QWEN2) and "lm_head.weight" in expected_shapes(TINY_QWEN3)
    assert "model.layers.0.self_attn.q_proj.bias" in expected_shapes(TINY_QWEN2)
    assert "model.layers.0.self_attn.q_norm.weight" in expected_shapes(TINY_QWEN3)


def test_corrupt_files_are_rejected_clearly(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.zeros((4, 4), np.float32)})
    raw = path.read_bytes()
    for name, data in [("short", raw[:5]), ("truncated", raw[:-8]), ("bad length", (10**9).to_bytes(8, "little") + raw[8:])]:
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match="safetensors|offsets"):
            read_safetensors(path)
    with pytest.raises(CheckpointError, match="neither"):
        load_state_dict(tmp_path)


def _tamper(directory, case):
    """Damage an export in one way; returns what the error must mention."""
    single = directory / "model.safetensors"
    if case == "flipped byte":  # same size, other content: only the checksum sees it
        raw = bytearray(single.read_bytes())
        raw[-1] ^= 0xFF
        single.write_bytes(bytes(raw))
        return "SHA-256"
    if case == "truncated":
        single.write_bytes(single.read_bytes()[:-4])
        return "size"
    if case == "missing file":
        single.unlink()
        return "missing"
    if case == "other dtype":  # a consistent file whose tensor is not the manifest's
        state = read_safetensors(single)
        name = "model.norm.weight"
        write_safetensors(single, {**state, name: state[name].astype(ml_dtypes.bfloat16)})
        manifest = json.loads((directory / "hetrl.manifest.json").read_text())
        manifest["files"]["model.safetensors"] = {"size": single.stat().st_size,
                                                  "sha256": hashlib.sha256(single.read_bytes()).hexdigest()}
        (directory / "hetrl.manifest.json").write_text(json.dumps(manifest))
        return "'model.norm.weight' is BF16"
    if case == "extra file":  # a stale index from another export is read, but is not in the manifest
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
        return "not in the manifest"
    if case == "corrupt manifest":
        (directory / "hetrl.manifest.json").write_text("{")
        return "corrupt manifest"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["flipped byte", "truncated", "missing file", "other dtype", "extra file",
                                  "corrupt manifest"])
def test_weights_are_verified_against_their_manifest_before_loading(tmp_path, case):
    state = random_state_dict(TINY_QWEN3, seed=2)
    save_state_dict(tmp_path, state)
    manifest = json.loads((tmp_path / "hetrl.manifest.json").read_text())
    assert set(manifest["tensors"]) == set(state) and set(manifest["files"]) == {"model.safetensors"}
    assert load_state_dict(tmp_path, require_manifest=True).keys() == state.keys()
    message = _tamper(tmp_path, case)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_state_dict(tmp_path)


def test_sharded_exports_are_verified_and_a_manifest_can_be_required(tmp_path):
    state = random_state_dict(TINY_QWEN3, seed=3)
    save_state_dict(tmp_path / "shards", state, max_shard_bytes=40_000)
    files = json.loads((tmp_path / "shards" / "hetrl.manifest.json").read_text())["files"]
    assert "model.safetensors.index.json" in files and len(files) > 3
    shard = tmp_path / "shards" / sorted(f for f in files if f.startswith("model-"))[1]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=re.escape(f"{shard.name}: SHA-256")):
        load_state_dict(tmp_path / "shards")
    write_safetensors(tmp_path / "model.safetensors", state)  # an export without a manifest
    assert load_state_dict(tmp_path).keys() == state.keys()
    with pytest.raises(CheckpointError, match="no hetrl.manifest.json"):
        load_state_dict(tmp_path, require_manifest=True)


def test_config_refuses_unsupported_features():
    hf = TINY_QWEN3.to_hf_dict()
    for change, message in [({"model_type": "llama"}, "model_type"), ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
                            ({"use_sliding_window": True}, "sliding"), ({"num_key_value_heads": 3}, "multiple"),
                            ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters")]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_dict({**hf, **change})
