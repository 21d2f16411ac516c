"""Hugging Face checkpoint I/O: safetensors state dicts as numpy arrays under HF names.

Every backend converts from and to this one form (``dict[str, np.ndarray]`` keyed by HF names,
``model.layers.{i}.self_attn.q_proj.weight`` etc.). The safetensors format is read and written
here directly (an 8-byte little-endian header length, a JSON header, raw little-endian buffers) so
BF16 tensors round-trip as ``ml_dtypes.bfloat16`` without a framework; single files and sharded
checkpoints (``model.safetensors.index.json``) are both handled. No pickle is involved anywhere.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from hetrl.models.config import ModelConfig

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or state dict does not match what the model expects."""


# ====================================================================== names and shapes
def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the architecture with its shape."""
    H, I, V, hd = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H),
            p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def check_state_dict(config: ModelConfig, state: Mapping[str, np.ndarray]) -> None:
    """Raise :class:`CheckpointError` naming the first missing, unexpected, misshapen or
    non-floating / non-finite tensor."""
    expected = expected_shapes(config)
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    extra = [k for k in state if k not in expected]
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} for a {config.model_type} model")
    for name, shape in expected.items():
        arr = state[name]
        if tuple(arr.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
        if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype in (_DTYPES["BF16"],)):
            raise CheckpointError(f"tensor {name!r} has dtype {arr.dtype}, expected a float type")
        if not np.all(np.isfinite(arr.astype(np.float32))):
            raise CheckpointError(f"tensor {name!r} holds NaN or inf")


# ====================================================================== safetensors files
def read_safetensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of one ``.safetensors`` file (all, or only ``names``), as owned numpy arrays."""
    wanted = None if names is None else set(names)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header, base = _parse_header(buf, path)
        out = {}
        for name, info in header.items():
            if name == "__metadata__" or (wanted is not None and name not in wanted):
                continue
            start, end = info["data_offsets"]
            dtype = _DTYPES[info["dtype"]].newbyteorder("<")
            out[name] = np.frombuffer(buf[base + start : base + end], dtype=dtype).reshape(info["shape"]).copy()
    return out


def _parse_header(buf, path) -> tuple[dict, int]:
    if len(buf) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (too short)")
    n = int.from_bytes(buf[:8], "little")
    if n <= 0 or 8 + n > len(buf):
        raise CheckpointError(f"{path}: corrupt safetensors header length {n}")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except ValueError as err:
        raise CheckpointError(f"{path}: corrupt safetensors header: {err}") from None
    size = len(buf) - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        want = int(np.prod(info["shape"], dtype=np.int64)) * _DTYPES[info["dtype"]].itemsize
        if not (0 <= start <= end <= size) or end - start != want:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent offsets {info['data_offsets']}")
    return header, 8 + n


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as one ``.safetensors`` file (atomically: temp file, then rename)."""
    header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        arrays.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    tmp = pathlib.Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for data in arrays:
            f.write(data)
    os.replace(tmp, path)


# ====================================================================== checkpoint directories
def load_state_dict(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory (single file or sharded)."""
    directory = pathlib.Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        out: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if pathlib.PurePath(shard).name != shard:
                raise CheckpointError(f"{index}: shard name {shard!r} must be a plain file name")
            out.update(read_safetensors(directory / shard, [k for k, v in weight_map.items() if v == shard]))
        return out
    single = directory / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    return read_safetensors(single)


def save_state_dict(directory: str | os.PathLike, state: Mapping[str, np.ndarray], max_shard_bytes: int = 4 << 30) -> None:
    """Write ``state`` in HF layout: one file, or shards plus an index past ``max_shard_bytes``."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0], meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / fname, shard, meta)
        weight_map.update({k: fname for k in shard})
    total = sum(a.nbytes for a in state.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
