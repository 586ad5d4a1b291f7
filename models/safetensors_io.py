"""Safetensors files read tensor by tensor into aligned numpy buffers (and written likewise).

The format: an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}`` relative to the data section, plus ``__metadata__``), then the raw little-endian
bytes. ``Checkpoint`` parses the headers of an HF directory's files and ``readinto``s each
tensor's bytes (or a range of its rows) straight into a fresh 64-byte aligned buffer, because:

- ``safetensors.safe_open`` cannot give bfloat16 to numpy, and its flax framework makes a jax
  array per tensor on top of the bytes it read (a second copy);
- a plain ``read`` leaves no memory-mapped pages of the file in the process (a mapping's touched
  pages count in its resident set until unmapped: a whole checkpoint's worth);
- XLA's CPU client aliases a 64-byte aligned, C-contiguous numpy array instead of copying it
  (``jax.device_put``), so on a CPU the loaded params are these very buffers.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
ALIGN = 64  # bytes: what XLA's CPU client needs to alias a host buffer


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on an ``ALIGN``-byte boundary."""
  dtype = np.dtype(dtype)
  n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(n + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start:start + n].view(dtype).reshape(shape)


def is_aligned(x: np.ndarray) -> bool:
  return x.flags.c_contiguous and x.ctypes.data % ALIGN == 0


def read_header(filename: str) -> tuple[int, dict]:
  """``(offset of the data section, header without __metadata__)`` of one file."""
  with open(filename, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return 8 + n, header


class Checkpoint:
  """The tensors of an HF directory: ``model.safetensors``, or the shards listed in
  ``model.safetensors.index.json``. Files stay open until ``close`` (or the ``with`` ends)."""

  def __init__(self, path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted({os.path.join(path, fn) for fn in json.load(f)["weight_map"].values()})
      for fn in files:
        if not os.path.exists(fn):
          raise FileNotFoundError(f"shard {fn} listed in {index} is missing")
    elif os.path.exists(single):
      files = [single]
    else:
      raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    self._entries = {}  # name -> (file, dtype, shape, absolute start, end)
    for fn in files:
      base, header = read_header(fn)
      for name, e in header.items():
        if e["dtype"] not in DTYPES:
          raise ValueError(f"tensor {name!r} in {fn} has dtype {e['dtype']}, not one of "
                           f"{sorted(DTYPES)}")
        start, end = e["data_offsets"]
        self._entries[name] = (fn, np.dtype(DTYPES[e["dtype"]]), tuple(e["shape"]),
                               base + start, base + end)
    self._handles = {}

  @property
  def names(self) -> list[str]:
    return sorted(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name][2]

  def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
    """Tensor ``name`` (or its rows ``[start, stop)`` on axis 0) as a new aligned array."""
    fn, dtype, shape, start, end = self._entries[name]
    if rows is not None:
      row_bytes = (end - start) // max(shape[0], 1)
      start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
      shape = (rows[1] - rows[0],) + shape[1:]
    out = aligned_empty(shape, dtype)
    if fn not in self._handles:
      self._handles[fn] = open(fn, "rb", buffering=0)  # pylint: disable=consider-using-with
    f = self._handles[fn]
    f.seek(start)
    view, done = memoryview(out.reshape(-1).view(np.uint8)), 0
    while done < end - start:
      n = f.readinto(view[done:])
      if not n:
        raise ValueError(f"{fn} ends inside tensor {name!r}")
      done += n
    return out

  def close(self):
    for f in self._handles.values():
      f.close()
    self._handles.clear()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def write_file(filename: str, specs: dict[str, tuple[tuple[int, ...], np.dtype]],
               fill: Callable[[str], np.ndarray], metadata: dict | None = None) -> None:
  """Writes a safetensors file holding ``specs`` (``name -> (shape, dtype)``), one tensor at a
  time: ``fill(name)`` is called once per name, in order, and its array written out before the
  next (so writing a large file holds one tensor in memory)."""
  header, offset = {}, 0
  for name, (shape, dtype) in specs.items():
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + n]}
    offset += n
  header["__metadata__"] = metadata or {"format": "pt"}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(filename, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, (shape, dtype) in specs.items():
      arr = np.ascontiguousarray(fill(name), dtype=dtype)
      if arr.shape != tuple(shape):
        raise ValueError(f"fill({name!r}) gave shape {arr.shape}, expected {tuple(shape)}")
      f.write(arr.reshape(-1).view(np.uint8).data)


def shard(specs: dict[str, tuple], max_bytes: int) -> Iterable[dict[str, tuple]]:
  """``specs`` split in order into consecutive groups of at most ``max_bytes`` (a larger
  tensor alone), as transformers' ``save_pretrained(max_shard_size=...)`` shards."""
  group, size = {}, 0
  for name, (shape, dtype) in specs.items():
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if group and size + n > max_bytes:
      yield group
      group, size = {}, 0
    group[name] = (shape, dtype)
    size += n
  if group:
    yield group
