"""Hugging Face checkpoint I/O: safetensors state dicts as numpy arrays under HF names.

Every backend converts from and to this one form (``dict[str, np.ndarray]`` keyed by HF names,
``model.layers.{i}.self_attn.q_proj.weight`` etc.). The safetensors format is read and written
here directly (an 8-byte little-endian header length, a JSON header, raw little-endian buffers) so
BF16 tensors round-trip as ``ml_dtypes.bfloat16`` without a framework; single files and sharded
checkpoints (``model.safetensors.index.json``) are both handled. No pickle is involved anywhere.

Integrity: :func:`save_state_dict` also writes a manifest (``hetrl.manifest.json``: size and
SHA-256 of every file it wrote, name, dtype and shape of every tensor), last, so it describes a
complete export. :func:`load_state_dict` checks a directory's manifest when it has one (and
demands one with ``require_manifest``) before trusting the files: a truncated, swapped or
tampered file, or a tensor of another name, dtype or shape, raises :class:`CheckpointError`
naming it. Pools that load published weights from a shared disk go through it.
"""

from __future__ import annotations

import hashlib
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
MANIFEST_FILE = "hetrl.manifest.json"
MANIFEST_VERSION = 1


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


# ====================================================================== manifests
def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: str | os.PathLike, files: Iterable[str], state: Mapping[str, np.ndarray]) -> None:
    """Write ``directory/hetrl.manifest.json`` for ``files`` (names in ``directory``) holding
    ``state`` (atomically: temp file, then rename)."""
    directory = pathlib.Path(directory)
    manifest = {
        "hetrl_manifest": MANIFEST_VERSION,
        "files": {name: {"size": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
                  for name in sorted(files)},
        "tensors": {name: {"dtype": _NAMES[np.dtype(arr.dtype)], "shape": list(arr.shape)}
                    for name, arr in sorted(state.items())},
    }
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST_FILE)


def verify_manifest(directory: str | os.PathLike, *, required: bool = False) -> dict | None:
    """Check size and SHA-256 of every file in ``directory``'s manifest; return the manifest
    (None when there is none and not ``required``). Raises :class:`CheckpointError` naming the
    first file that is missing, of another size or of another checksum."""
    path = pathlib.Path(directory) / MANIFEST_FILE
    if not path.exists():
        if required:
            raise CheckpointError(f"{directory}: no {MANIFEST_FILE}; refusing weights that cannot be verified")
        return None
    try:
        manifest = json.loads(path.read_text())
        files, tensors = manifest["files"], manifest["tensors"]
        if manifest.get("hetrl_manifest") != MANIFEST_VERSION or not isinstance(files, dict) or not isinstance(tensors, dict):
            raise ValueError(f"not a version-{MANIFEST_VERSION} manifest")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: corrupt manifest: {err}") from None
    for name, want in files.items():
        file = pathlib.Path(directory) / name
        if pathlib.PurePath(name).name != name or not file.is_file():
            raise CheckpointError(f"{directory}: file {name!r} of the manifest is missing")
        if file.stat().st_size != want.get("size"):
            raise CheckpointError(f"{file}: size {file.stat().st_size} differs from the manifest's {want.get('size')}")
        if _sha256(file) != want.get("sha256"):
            raise CheckpointError(f"{file}: SHA-256 checksum differs from the manifest's (corrupt or tampered)")
    return manifest


def _check_against_manifest(directory: pathlib.Path, manifest: dict, files: Iterable[str],
                            state: Mapping[str, np.ndarray]) -> None:
    """The ``files`` read must be the manifest's (checked by :func:`verify_manifest`), and
    ``state`` must hold its tensors with their dtypes and shapes."""
    unlisted = sorted(set(files) - set(manifest["files"]))
    if unlisted:
        raise CheckpointError(f"{directory}: file {unlisted[0]!r} is not in the manifest (left from another export?)")
    tensors = manifest["tensors"]
    for name in sorted(set(tensors) ^ set(state)):
        where = "missing from the files" if name in tensors else "not in the manifest"
        raise CheckpointError(f"{directory}: tensor {name!r} is {where}")
    for name, arr in state.items():
        got = {"dtype": _NAMES[arr.dtype.newbyteorder("=")], "shape": list(arr.shape)}
        if got != tensors[name]:
            raise CheckpointError(f"{directory}: tensor {name!r} is {got['dtype']} {got['shape']}, "
                                  f"the manifest says {tensors[name].get('dtype')} {tensors[name].get('shape')}")


# ====================================================================== checkpoint directories
def load_state_dict(directory: str | os.PathLike, *, require_manifest: bool = False) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory (single file or sharded), checked against its
    manifest when it has one (:func:`verify_manifest`; ``require_manifest``: it must have one)."""
    directory = pathlib.Path(directory)
    manifest = verify_manifest(directory, required=require_manifest)
    index = directory / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [INDEX_FILE] + sorted(set(weight_map.values()))
        out: dict[str, np.ndarray] = {}
        for shard in files[1:]:
            if pathlib.PurePath(shard).name != shard:
                raise CheckpointError(f"{index}: shard name {shard!r} must be a plain file name")
            out.update(read_safetensors(directory / shard, [k for k, v in weight_map.items() if v == shard]))
    else:
        files = [SINGLE_FILE]
        if not (directory / SINGLE_FILE).exists():
            raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        out = read_safetensors(directory / SINGLE_FILE)
    if manifest is not None:
        _check_against_manifest(directory, manifest, files, out)
    return out


def save_state_dict(directory: str | os.PathLike, state: Mapping[str, np.ndarray], max_shard_bytes: int = 4 << 30) -> None:
    """Write ``state`` in HF layout: one file, or shards plus an index past ``max_shard_bytes``,
    then the manifest (:func:`write_manifest`)."""
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
        write_manifest(directory, [SINGLE_FILE], state)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / fname, shard, meta)
        weight_map.update({k: fname for k in shard})
    total = sum(a.nbytes for a in state.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_manifest(directory, sorted(set(weight_map.values())) + [INDEX_FILE], state)


VERSION_FILE = "hetrl_version.txt"
"""The file of a trainer's HF export that holds the weight version (the trainer's step)."""


def save_hf_export(directory: str | os.PathLike, config: ModelConfig, state: Mapping[str, np.ndarray],
                   version: int) -> pathlib.Path:
    """A trainer's HF export of ``state`` at weight ``version``: ``config.json``, the
    safetensors (:func:`save_state_dict`) and :data:`VERSION_FILE`. Returns ``directory``."""
    directory = pathlib.Path(directory)
    config.save(directory)
    save_state_dict(directory, state)
    (directory / VERSION_FILE).write_text(f"{version}\n")
    return directory
