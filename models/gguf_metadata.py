"""A GGUF file's key/value metadata, read without parsing its tensors.

``gguf.GGUFReader`` builds a numpy view per item of every field: the 49k-token vocabulary and
48k merges of SmolLM2's file take ~8 s, paid by every process that wants only its tokenizer.
This reads the metadata section (GGUF v2 / v3, either byte order) with ``struct`` and
``numpy.frombuffer`` in well under a second and returns what ``gguf_loader.read_metadata``
returns for the same file: ``{key: str | int | float | bool | list}``.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"GGUF"
# GGUF value types (gguf.GGUFValueType) -> struct / numpy codes, without the byte order.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
  """Reads values from ``buf`` at ``pos`` in byte order ``order`` (``"<"`` or ``">"``)."""

  def __init__(self, buf: bytes, order: str):
    self.buf, self.order, self.pos = buf, order, 0

  def scalar(self, code: str):
    (v,) = struct.unpack_from(self.order + code, self.buf, self.pos)
    self.pos += struct.calcsize(code)
    return v

  def string(self) -> str:
    n = self.scalar("Q")
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


def read(path: str) -> dict:
  """The metadata of the GGUF file at ``path`` (the ``GGUF.*`` header fields left out).

  Raises:
    ValueError: not a GGUF file, or a version other than 2 and 3.
  """
  with open(path, "rb") as f:
    head = f.read(24)
    if head[:4] != MAGIC:
      raise ValueError(f"{path}: not a GGUF file (magic {head[:4]!r})")
    order = "<" if struct.unpack_from("<I", head, 4)[0] & 0xFFFF else ">"
    version, _, kv_count = struct.unpack_from(order + "IQQ", head, 4)
    if version not in (2, 3):
      raise ValueError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    # The metadata section has no stored size: read in growing slices until it parses.
    size = 1 << 20
    while True:
      f.seek(24)
      buf = f.read(size)
      try:
        return _parse(buf, order, kv_count)
      except (struct.error, ValueError, UnicodeDecodeError) as e:
        if len(buf) < size:  # the whole file was read: it is malformed
          raise ValueError(f"{path}: its metadata does not parse ({e}); a truncated file?"
                           ) from None
        size *= 4


def _parse(buf: bytes, order: str, kv_count: int) -> dict:
  cur, out = _Cursor(buf, order), {}
  for _ in range(kv_count):
    key = cur.string()
    value = cur.value(cur.scalar("I"))
    if cur.pos > len(buf):  # a slice cut a value short
      raise ValueError("truncated")
    out[key] = value
  return out
