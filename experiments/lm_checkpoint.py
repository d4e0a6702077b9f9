"""Checkpoints of the byte-level language models (``experiments.mamba2_lm``,
``experiments.gdn_lm``): a folder of ``model.safetensors`` + ``config.json`` in the layout of
``transformers``' ``save_pretrained``.

The safetensors container is read and written here (an 8-byte little-endian header length, a
JSON header of ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian tensor
bytes), so the GPU machine needs no ``safetensors`` package; the tests check the files against
the library where it is installed. Each model module keeps what differs: its config and model
classes, the tensors that stay fp32, the name of its tied embedding.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from experiments._common import atomic_file

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "save_safetensors",
    "load_safetensors",
    "save_checkpoint",
    "read_config",
    "load_checkpoint",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write ``{name: tensor}`` as a safetensors file (names sorted, data in that order),
    atomically (a temporary name in the same folder, then a rename)."""
    path = Path(path)
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dtype not in _ST_NAMES:
            raise ValueError(f"tensors[{name!r}]: expected a tensor of dtype in "
                             f"{sorted(map(str, _ST_NAMES))}, got {getattr(t, 'dtype', t)!r}")
        t = t.detach().cpu().contiguous()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)  # the data starts 8-byte aligned
    with atomic_file(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load_safetensors(path) -> dict:
    """``{name: tensor}`` from a safetensors file (CPU tensors); ValueError naming the file on a
    malformed one."""
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{path}: expected a safetensors file, got {len(raw)} bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: expected a header of {n} bytes, the file has {len(raw)}")
    try:
        header = json.loads(raw[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: expected a JSON header, got {err}") from None
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        shape = info["shape"]
        numel = math.prod(shape)
        if end - start != numel * torch.tensor([], dtype=dtype).element_size() or end > len(data):
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {info['data_offsets']} "
                             f"that do not fit shape {shape} of {info['dtype']}")
        buf = bytearray(data[start:end])
        empty = torch.empty(0, dtype=torch.uint8)
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else empty
        out[name] = flat.view(dtype).reshape(shape).clone()
    return out


def save_checkpoint(model, folder, keep_fp32: tuple, dtype, metadata: dict | None) -> Path:
    """Write ``config.json`` (``model.config.to_dict()`` and ``torch_dtype``) and
    ``model.safetensors`` into ``folder``: tensors whose name contains one of ``keep_fp32`` in
    fp32, the others in ``dtype``; a tied ``lm_head.weight`` is left out. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        keep = any(k in name for k in keep_fp32)
        tensors[name] = t.to(torch.float32 if keep else dtype)
    save_safetensors(tensors, folder / WEIGHTS_NAME, metadata)
    config = model.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with atomic_file(folder / CONFIG_NAME) as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def read_config(folder, config_cls):
    """``config_cls.from_dict`` of a checkpoint folder's ``config.json``; ValueError in one
    line."""
    path = Path(folder) / CONFIG_NAME
    try:
        return config_cls.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: expected JSON, got {err}") from None


def load_checkpoint(folder, model_cls, config_cls, *, tied_from: str, expected_what: str,
                    ignored_prefixes: tuple = (), dtype=torch.float32, device=None):
    """A ``model_cls(config)`` from a folder holding ``config.json`` (read by ``config_cls``)
    and ``model.safetensors``; parameters in ``dtype``. A tied ``lm_head.weight`` is taken
    from ``tied_from``; tensors under ``ignored_prefixes`` are skipped; ``expected_what``
    names the tensors in the error of a mismatched file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"model: expected a folder with {CONFIG_NAME} and {WEIGHTS_NAME}, got "
                         f"{str(folder)!r} (not a folder)")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise ValueError(f"model: expected {folder / name} to exist, it does not")
    config = read_config(folder, config_cls)
    tensors = load_safetensors(folder / WEIGHTS_NAME)
    model = model_cls(config)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        tensors.setdefault("lm_head.weight", tensors.get(tied_from))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(k for k in set(tensors) - set(expected)
                        if not k.startswith(ignored_prefixes))
    if missing or unexpected:
        raise ValueError(f"{folder / WEIGHTS_NAME}: expected {expected_what}, missing "
                         f"{missing[:4]}, unexpected {unexpected[:4]}")
    for name, t in expected.items():
        if tuple(tensors[name].shape) != tuple(t.shape):
            raise ValueError(f"{folder / WEIGHTS_NAME}: tensor {name!r} expected shape "
                             f"{list(t.shape)} from config.json, got {list(tensors[name].shape)}")
    model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items() if k in expected})
    return model.to(dtype=dtype, device=device)
