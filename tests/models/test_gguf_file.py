"""``models.gguf_file`` reads what ``gguf.GGUFReader`` reads (metadata of every value type,
plain and quantised tensors, both byte orders) and refuses malformed files clearly."""

import gguf
import numpy as np
import pytest

from models import gguf_file

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def reader_metadata(path) -> dict:
  """The reference: every key/value field of a ``gguf.GGUFReader`` as Python values."""
  fields = gguf.GGUFReader(str(path)).fields.items()
  return {k: f.contents() for k, f in fields if not k.startswith("GGUF.")}


def _write(path, endian):
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
  for kind, value in [(V.UINT8, 200), (V.INT8, -100), (V.UINT16, 60_000), (V.INT16, -30_000),
                      (V.UINT32, 4_000_000_000), (V.INT32, -2_000_000_000),
                      (V.FLOAT32, 0.1), (V.UINT64, 2**63 + 5), (V.INT64, -2**62),
                      (V.FLOAT64, 0.1), (V.BOOL, True), (V.STRING, "héllo {{ x }}")]:
    w.add_key_value(f"t.{kind.name.lower()}", value, kind)
  w.add_array("t.floats", [float(x) for x in rng.standard_normal(5).astype(np.float32)])
  w.add_array("t.ints", [int(x) for x in rng.integers(-9, 9, 7)])
  w.add_array("t.empty", [])
  # ~1.3 MiB of strings (cut inside them below)
  w.add_array("t.words", [f"wörd-{i}-" + "x" * (i % 70) for i in range(25_000)])
  w.add_uint32("t.after", 7)  # a field after the long one
  w.add_uint32("general.alignment", 64)
  x = rng.standard_normal((3, 64)).astype(np.float32)
  w.add_tensor("plain.f32", x)
  w.add_tensor("plain.f16", x[:2].astype(np.float16))
  w.add_tensor("plain.i32", rng.integers(-99, 99, (5,)).astype(np.int32))
  w.add_tensor("quant.q8_0", gguf.quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_equals_the_gguf_reader(tmp_path, endian):
  path = tmp_path / "meta.gguf"
  _write(path, endian)
  want = reader_metadata(path)
  got = gguf_file.read_metadata(str(path))
  assert got == want and list(got) == list(want)
  assert got["t.float32"] == float(np.float32(0.1)) and got["t.after"] == 7
  assert all(type(got[k]) is type(want[k]) for k in want)  # pylint: disable=unidiomatic-typecheck
  meta, tensors = gguf_file.read(str(path))
  theirs = gguf.GGUFReader(str(path)).tensors
  assert meta == want and [t.name for t in tensors] == [t.name for t in theirs]
  for ours, ref in zip(tensors, theirs):
    assert ours.tensor_type == ref.tensor_type and list(ours.shape) == list(ref.shape), ref.name
    assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape, ref.name
    assert np.array_equal(ours.data, ref.data), ref.name
  by = {t.name: t for t in tensors}  # values, not only the reader's bytes
  assert by["plain.f32"].data.shape == (3, 64) and by["quant.q8_0"].data.dtype == np.uint8
  np.testing.assert_allclose(gguf.quants.dequantize(by["quant.q8_0"].data, Q.Q8_0),
                             by["plain.f32"].data, atol=0.05)


def test_refuses_what_is_not_gguf_v2_or_v3(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGML" + bytes(20))
  with pytest.raises(ValueError, match="not a GGUF file"):
    gguf_file.read_metadata(str(bad))
  bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
  with pytest.raises(ValueError, match="GGUF version 1"):
    gguf_file.read_metadata(str(bad))
  good = tmp_path / "good.gguf"
  _write(good, gguf.GGUFEndian.LITTLE)
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(good.read_bytes()[:1 << 20])  # a file cut inside its metadata
  with pytest.raises(ValueError, match="does not parse .*a truncated file"):
    gguf_file.read_metadata(str(cut))
  cut.write_bytes(good.read_bytes()[:-100])  # the last tensor's data cut short (204 + 52 pad)
  assert gguf_file.read_metadata(str(cut))["t.after"] == 7
  with pytest.raises(ValueError, match="tensor 'quant.q8_0' ends past the end of the file"):
    gguf_file.read(str(cut))
