"""A GGUF file's metadata and tensor table, read directly from a memory map.

``gguf.GGUFReader`` builds a numpy view per item of every metadata field: the 49k-token
vocabulary and 48k merges of SmolLM2's file take ~6-8 s, Qwen2.5-0.5B's 152k tokens ~14 s, paid
by every process that loads the model or only its tokenizer. Here the metadata section (GGUF v2 /
v3, either byte order) is read with ``struct`` and ``numpy.frombuffer`` (0.1 s for SmolLM2,
0.4 s for Qwen2.5-0.5B) and the tensors are views into one ``numpy.memmap``, as the reader's
are. ``read_metadata`` returns what a ``GGUFReader``'s fields hold (``field.contents()``) for
the same file; ``read``'s tensors carry the reader's ``name``, ``tensor_type``, ``shape`` and
``data``.
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # GGUF's, unless ``general.alignment`` says otherwise
# GGUF value types (gguf.GGUFValueType) -> struct / numpy codes, without the byte order.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# Unquantised ggml types (gguf.GGMLQuantizationType) held as plain arrays; the others as bytes.
_PLAIN = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


class Tensor(NamedTuple):
  """One tensor: ``shape`` in GGUF's order (fastest axis first); ``data`` shaped as the reader
  shapes it (``reversed(shape)``, the last axis in bytes for quantised types)."""
  name: str
  tensor_type: int
  shape: np.ndarray
  data: np.ndarray


class _Cursor:
  """Reads values from ``buf`` at ``pos`` in byte order ``order`` (``"<"`` or ``">"``)."""

  def __init__(self, buf, order: str, pos: int):
    self.buf, self.order, self.pos = buf, order, pos

  def scalar(self, code: str):
    (v,) = struct.unpack_from(self.order + code, self.buf, self.pos)
    self.pos += struct.calcsize(code)
    return v

  def string(self) -> str:
    n = self.scalar("Q")
    if self.pos + n > len(self.buf):
      raise ValueError("a string runs past the end of the file")
    s = self.buf[self.pos:self.pos + n].decode("utf-8")
    self.pos += n
    return s

  def value(self, kind: int):
    if kind in _SCALARS:
      return self.scalar(_SCALARS[kind])
    if kind == _STRING:
      return self.string()
    if kind != _ARRAY:
      raise ValueError(f"GGUF value type {kind} at byte {self.pos} is not one of GGUF's")
    item, n = self.scalar("I"), self.scalar("Q")
    if item in _SCALARS:  # one frombuffer for the whole array
      dtype = np.dtype(self.order + _SCALARS[item])
      out = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
      self.pos += n * dtype.itemsize
      return out
    return [self.value(item) for _ in range(n)]


def _open(path: str, buf) -> tuple[_Cursor, int, int]:
  """A cursor after the header, and the tensor and key/value counts."""
  if buf[:4] != MAGIC or len(buf) < 24:
    raise ValueError(f"{path}: not a GGUF file (magic {buf[:4]!r})")
  order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
  version, n_tensors, n_kv = struct.unpack_from(order + "IQQ", buf, 4)
  if version not in (2, 3):
    raise ValueError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
  return _Cursor(buf, order, 24), n_tensors, n_kv


def _metadata(path: str, cur: _Cursor, n_kv: int) -> dict:
  out = {}
  try:
    for _ in range(n_kv):
      key = cur.string()
      out[key] = cur.value(cur.scalar("I"))
  except (struct.error, ValueError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: its metadata does not parse ({e}); a truncated file?") from None
  return out


def read_metadata(path: str) -> dict:
  """The metadata of the GGUF file at ``path`` (the ``GGUF.*`` header fields left out).

  Raises:
    ValueError: not a GGUF file, a version other than 2 and 3, or a metadata section that
      does not parse (a truncated file).
  """
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    cur, _, n_kv = _open(path, buf)
    return _metadata(path, cur, n_kv)


def read(path: str) -> tuple[dict, list[Tensor]]:
  """``(metadata, tensors)`` of the GGUF file at ``path``; tensor data are read-only views of a
  memory map (nothing is read until used).

  Raises:
    ValueError: as ``read_metadata``; a tensor table that does not parse, a duplicated tensor
      name or a tensor past the end of the file.
  """
  import gguf  # pylint: disable=g-import-not-at-top (the quantisation tables)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    cur, n_tensors, n_kv = _open(path, buf)
    meta = _metadata(path, cur, n_kv)
    table = []
    try:
      for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        table.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: its tensor table does not parse ({e})") from None
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // align) * align
  whole = np.memmap(path, mode="r")
  tensors, seen = [], set()
  for name, dims, kind, offset in table:
    if name in seen:
      raise ValueError(f"{path}: tensor {name!r} appears twice")
    seen.add(name)
    qtype = gguf.GGMLQuantizationType(kind)
    shape = tuple(reversed(dims))
    n = int(np.prod(dims))
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nbytes = n * type_size // block
    lo = start + offset
    if lo + nbytes > len(whole):
      raise ValueError(f"{path}: tensor {name!r} ends past the end of the file")
    raw = whole[lo:lo + nbytes]
    if kind in _PLAIN:
      data = raw.view(np.dtype(cur.order + _PLAIN[kind])).reshape(shape)
    else:
      data = raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
    tensors.append(Tensor(name, qtype, np.asarray(dims, np.uint64), data))
  return meta, tensors
