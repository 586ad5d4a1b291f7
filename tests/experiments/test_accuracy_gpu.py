"""The GPU config's path of the accuracy harness, run under CPU JAX (``configs/accuracy_gpu.py``).

The planned run (each method on its own, batches from the memory plan, compression prefilled in
sub-batches whose compacted caches are joined, samples batched across tasks) with the decode
step forced to one device program, as on a GPU, gives the same predictions in float32 as the
per-layer step and as the shared-prefill loop the CPU configs run: dense, Quest, RESA-Quest and
SnapKV at keep 0.5 on tiny-random.
"""

import dataclasses
import json
import os

import pytest

from configs import accuracy_gpu
from experiments.common import quick
from experiments.tasks import accuracy, planned, ruler


def _config(**kw):
  c = accuracy_gpu.get_config()
  with c.unlocked():
    c.quick = True
  c = quick.resolve(c, accuracy_gpu.get_config)
  with c.unlocked():
    c.update(kw)
  return c


def _predictions(records):
  return {(r["method"], r["task"], r["seed"]): r["prediction"] for r in records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("accuracy_gpu")
  shared = accuracy.run(_config(batch_plan=False, batch_size=2, decode_step="per_layer"),
                        str(root / "shared"), write=False)
  program = accuracy.run(_config(decode_step="program", prefill_batch=1), str(root / "program"),
                         write=False)
  per_layer = accuracy.run(_config(decode_step="per_layer"), str(root / "per_layer"),
                           write=False)
  return shared, program, per_layer


def test_one_program_step_equals_per_layer_and_the_shared_loop(runs):
  shared, program, per_layer = runs
  cfg = _config()
  assert len(program) == len(cfg.methods) * len(cfg.tasks) * cfg.num_samples
  assert {r["method"] for r in program} == {"dense", "quest@0.1", "resa-quest@0.1",
                                            "snapkv@0.5"}
  assert _predictions(program) == _predictions(per_layer) == _predictions(shared)
  assert all(r["new_tokens"] > 0 for r in program)


def test_planned_records_carry_the_plan_and_the_path(runs):
  _, program, per_layer = runs
  assert {r["decode_step"] for r in program} == {"program"}
  assert {r["decode_step"] for r in per_layer} == {"per_layer"}
  for r in program + per_layer:
    # both tasks of the length in one batch (batched across tasks), nothing padded
    assert r["batch_size"] == r["rows_run"] == r["plan_batch"] == 4 and r["plan_source"] == "plan"
    assert r["peak_bytes"] is None  # a CPU reports no device memory
    assert r["plan_bytes"] > r["plan_kept_bytes"] > 0 and r["oom_retries"] == 0
  snap = [r for r in program if r["method"] == "snapkv@0.5"]
  assert {r["plan_prefill_batch"] for r in snap} == {1}  # four sub-batches, joined
  assert all(0 < r["kv_kept"] < r["context_tokens"] for r in snap)
  dense = next(r for r in program if r["method"] == "dense")
  assert snap[0]["plan_kept_bytes"] < dense["plan_kept_bytes"]  # the compacted cache


def test_query_agnostic_planned_equals_the_shared_loop(tmp_path):
  kw = dict(protocol="query_agnostic", methods=("quest", "snapkv@0.5"),
            tasks=("niah_single_1",), max_new_tokens=4)
  shared = accuracy.run(_config(batch_plan=False, batch_size=2, **kw), str(tmp_path / "a"),
                        write=False)
  program = accuracy.run(_config(decode_step="program", batch_size=2, prefill_batch=1, **kw),
                         str(tmp_path / "b"), write=False)
  assert _predictions(program) == _predictions(shared)
  assert {r["plan_source"] for r in program} == {"override"}


def test_batches_are_balanced_and_padded_to_one_shape():
  assert [len(b) for b in planned.batches(list(range(28)), 13)] == [10, 10, 8]
  assert [len(b) for b in planned.batches(list(range(4)), 8)] == [4]
  assert planned.batches([], 3) == []
  assert planned.padded([1, 2], 4) == [1, 2, 2, 2]


def test_sample_cache_gives_back_the_same_samples(tmp_path):
  cfg = _config(sample_cache=str(tmp_path), tasks=("niah_single_1", "qa"), num_samples=1)
  from experiments.common import modelzoo
  prompter = ruler.Prompter(modelzoo.smollm2_tokenizer(), chat=cfg.chat)
  made = accuracy._dataset(cfg, prompter)  # pylint: disable=protected-access
  files = os.listdir(tmp_path)
  assert len(files) == 1 and json.load(open(tmp_path / files[0]))["ident"]["n"] == 1
  again = accuracy._dataset(cfg, prompter)  # pylint: disable=protected-access
  assert [dataclasses.asdict(s) for s in again] == [dataclasses.asdict(s) for s in made]
  assert again == made


def test_random_shape_models_take_a_real_tokenizer(tmp_path, monkeypatch):
  from experiments.common import checks, modelzoo
  from experiments.latency_lib import shapes
  assert modelzoo.parse_random("random:llama-3.1-8b") == ("llama-3.1-8b", None)
  assert modelzoo.parse_random("random:llama-3.1-8b:/x/tok") == ("llama-3.1-8b", "/x/tok")
  assert modelzoo.parse_random("tiny-random") is None
  with pytest.raises(ValueError, match="unknown shape 'nosuch'.*random:llama-3.1-8b"):
    modelzoo.parse_random("random:nosuch")
  checks.check_model("random:llama-3.1-8b")
  with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
    checks.check_model(f"random:llama-3.1-8b:{tmp_path}")
  modelzoo.smollm2_tokenizer().save(str(tmp_path))  # what ruler_gpu.sh prepare carries
  small = dict(shapes.SHAPES["tiny"], vocab_size=49152)
  monkeypatch.setitem(shapes.SHAPES, "tiny-49k", small)
  model = modelzoo.load_model(f"random:tiny-49k:{tmp_path}", dtype="float32")
  assert model.tokenizer.vocab_size <= model.config.vocab_size == 49152
  assert model.config.eos_token_ids == tuple(model.tokenizer.eos_ids) and model.config.num_layers == 2
  assert model.encode("hello") == modelzoo.smollm2_tokenizer().encode("hello")
  with pytest.raises(ValueError, match="do not fit tiny's vocabulary"):
    modelzoo.load_model("random:tiny")
