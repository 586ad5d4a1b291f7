"""experiments.common.executables: a long run drops its compiled programs before the kernel's
mapping limit, and its results do not change."""

import io
import os

import jax
import jax.numpy as jnp
import pytest

from configs import accuracy_compression
from experiments.common import executables, quick
from experiments.tasks import accuracy

_LINUX = os.path.exists("/proc/self/maps")


@pytest.mark.skipif(not _LINUX, reason="needs /proc")
def test_releasing_gives_the_mappings_back():
  f = jax.jit(lambda x: jnp.tanh(x) * 3 - x)
  before = executables.mapping_count()
  for n in range(1, 41):  # 40 programs of their own shapes
    f(jnp.arange(n, dtype=jnp.float32)).block_until_ready()
  grown = executables.mapping_count()
  assert grown - before >= 40 * 2, (before, grown)
  out = io.StringIO()
  assert executables.release_if_crowded(1.0, limit=lambda: grown - 1, stream=out)
  assert f._cache_size() == 0  # pylint: disable=protected-access
  assert executables.mapping_count() < grown - 40, (grown, executables.mapping_count())
  assert "memory mappings (limit" in out.getvalue()


def test_below_the_share_nothing_is_released():
  f = jax.jit(lambda x: x + 1)
  f(jnp.ones(3))
  out = io.StringIO()
  assert not executables.release_if_crowded(0.5, count=lambda: 50, limit=lambda: 100,
                                            stream=out)
  assert f._cache_size() == 1 and not out.getvalue()  # pylint: disable=protected-access
  assert executables.release_if_crowded(0.5, count=lambda: 51, limit=lambda: 100, stream=out)


def test_unknown_count_or_limit_releases_nothing():
  assert not executables.release_if_crowded(count=lambda: None, limit=lambda: 10)
  assert not executables.release_if_crowded(count=lambda: 10 ** 9, limit=lambda: None)
  assert executables.mapping_count("/nonexistent/maps") is None


def test_limit_reader(tmp_path):
  good, bad = tmp_path / "good", tmp_path / "bad"
  good.write_text("65530\n")
  bad.write_text("many")
  assert executables.mapping_limit(str(good)) == 65530
  assert executables.mapping_limit(str(bad)) is None
  assert executables.mapping_limit(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_share_must_be_a_fraction(share):
  with pytest.raises(ValueError, match="share"):
    executables.release_if_crowded(share)


def _tiny_compression_config():
  c = accuracy_compression.get_config()
  with c.unlocked():
    c.quick = True
  c = quick.resolve(c, quick.module_get_config("accuracy_compression"))
  with c.unlocked():
    c.methods = ("dense", "snapkv", "compactor:head_budget=adakv")
    c.tasks = c.tasks[:1]
  return c


def test_accuracy_run_releasing_every_cell_answers_the_same(tmp_path, monkeypatch, capsys):
  """The harness releases between cells; releasing after every one (a limit of one mapping)
  compiles everything again and gives the same answers (Ada-KV's cache shapes change per batch,
  the case that crowded the real runs)."""
  cfg = _tiny_compression_config()
  plain = accuracy.run(cfg, str(tmp_path / "plain"))
  capsys.readouterr()
  monkeypatch.setattr(executables, "mapping_limit", lambda: 1)
  released = accuracy.run(cfg, str(tmp_path / "released"))
  err = capsys.readouterr().err
  assert err.count("released compiled programs") >= len(plain) // cfg.batch_size - 1, err
  strip = lambda recs: sorted((r["key"], r["prediction"], r["score"], r["kv_kept"])
                              for r in recs)
  assert strip(released) == strip(plain)
