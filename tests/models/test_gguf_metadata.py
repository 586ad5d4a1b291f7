"""``models.gguf_metadata.read`` returns what ``gguf.GGUFReader`` reads, for every value type,
both byte orders and a metadata section longer than the first slice it reads."""

import gguf
import numpy as np
import pytest

from models import gguf_loader, gguf_metadata

V = gguf.GGUFValueType


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
  # ~1.3 MiB of strings: past the reader's first 1 MiB slice
  w.add_array("t.words", [f"wörd-{i}-" + "x" * (i % 70) for i in range(25_000)])
  w.add_uint32("t.after", 7)  # a field after the long one
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_equals_the_gguf_reader(tmp_path, endian):
  path = tmp_path / "meta.gguf"
  _write(path, endian)
  want = gguf_loader.read_metadata(gguf.GGUFReader(str(path)))
  got = gguf_metadata.read(str(path))
  assert got == want and list(got) == list(want)
  assert got["t.float32"] == float(np.float32(0.1)) and got["t.after"] == 7
  assert all(type(got[k]) is type(want[k]) for k in want)  # pylint: disable=unidiomatic-typecheck


def test_refuses_what_is_not_gguf_v2_or_v3(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGML" + bytes(20))
  with pytest.raises(ValueError, match="not a GGUF file"):
    gguf_metadata.read(str(bad))
  bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
  with pytest.raises(ValueError, match="GGUF version 1"):
    gguf_metadata.read(str(bad))
  good = tmp_path / "good.gguf"
  _write(good, gguf.GGUFEndian.LITTLE)
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(good.read_bytes()[:1 << 20])  # a file cut inside its metadata
  with pytest.raises(ValueError, match="does not parse .*a truncated file"):
    gguf_metadata.read(str(cut))
