"""The main job (``experiments.generate``): a long default prompt, the share each method
attends, a warning where a method is dense, and progress on every long step."""

import io
import os
import subprocess
import sys
import types

import jax
import pytest

from experiments.common import main_report, modelzoo, passage, sparsity, stages
from models import decode, llama
from models.config import ModelConfig, RopeConfig
from models.loading import Model
from sparse_attn import methods
from tests import readme, xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_prompt_is_a_long_passage_with_a_planted_fact_near_the_start():
  text = passage.default_prompt()
  n = len(modelzoo.smollm2_tokenizer().encode(text))
  assert 1000 <= n <= 2000, n
  assert text.endswith(passage.QUESTION) and text.count(passage.FACT) == 1
  assert text.index(passage.FACT) < len(text) // 10  # far from the local window
  assert passage.is_right('The password is "Marigold".') and not passage.is_right("Bingley")


def test_attended_share_and_dense_warning():
  quest = methods.make("quest", budget=0.1)
  long, short = sparsity.attended(quest, 1253), sparsity.attended(quest, 34)
  assert long.tokens < 1253 and "chosen" in long.describe() and "%" in long.describe()
  assert sparsity.dense_warning("quest", long) is None
  assert "attends all 34 tokens" in sparsity.dense_warning("quest", short)
  dense = sparsity.attended(methods.make("dense"), 1253)
  assert dense.share == 1.0 and sparsity.dense_warning("dense", dense) is None
  kept = sparsity.attended(methods.make("snapkv", ratio=0.75), 1000)
  assert kept.tokens == 250
  # what end_prefill keeps, ceil((1 - r) L): round would say 14 at L = 29
  assert sparsity.attended(methods.make("snapkv", ratio=0.5), 29).tokens == 15
  # a budget covering the prompt is the budget's fault, not the prompt's
  big = sparsity.dense_warning("quest@5000", sparsity.attended(methods.make("quest", budget=5000),
                                                               1253))
  assert "give a smaller budget" in big and "longer prompt" not in big
  assert "longer prompt" in sparsity.dense_warning("quest", short)


def _generation(prefill, decode_rate, n=16):
  return types.SimpleNamespace(prefill_tokens_per_second=prefill,
                               decode_tokens_per_second=decode_rate, tokens=[[0] * n])


def test_report_aligns_long_names_and_explains_a_slower_sparse_method():
  long = "quest+resa:lam=0.5+rect:f=32+retro:w=4@0.1"
  built = {"dense": methods.make("dense"), long: methods.make(long.split("@")[0], budget=0.1)}
  results = {"dense": _generation(250.0, 19.2), long: _generation(240.0, 17.2)}
  text = main_report.report(results, built, 1269, right={"dense": True, long: False},
                         cache_share=0.098)
  table = text.splitlines()[:3]
  starts = [ln.index("  ", len(long)) for ln in table[1:]]  # the name column ends at one place
  assert len(set(starts)) == 1 and table[2].startswith(long + " ")
  assert "   right  " in table[1] and "   wrong  " in table[2]
  assert f"note: {long} decodes slower than dense here: at 1269 tokens the KV cache is 10% of " \
         "the bytes a decode step reads" in text
  assert f"note: {long} prefills slower than dense" in text
  fast = main_report.report({"dense": _generation(250.0, 19.2), long: _generation(260.0, 25.0)},
                         built, 1269, cache_share=0.098)
  assert "note:" not in fast and "answer" not in fast
  assert main_report.verdict(long, {"dense": "a", long: "a"}, {"dense": True, long: False}) == (
      f"{long} gives the same text as dense; the planted password is 'marigold': dense answers "
      f"right, {long} answers wrong.")


def test_generate_reports_every_prefill_chunk_and_decoding():
  cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=1000.0))
  model = Model(cfg, llama.init_params(cfg, jax.random.key(0)), None, "tiny")
  out = io.StringIO()
  progress = stages.Stages("generate", every=0.0, stream=out).callback("dense")
  decode.generate(model, list(range(1, 41)), 4, methods.make("dense"), prefill_chunk=16,
                  stop_at_eos=False, progress=progress)
  lines = [ln.split("] ", 1)[1] for ln in out.getvalue().splitlines()]
  assert lines == ["dense: prefill chunk 1/3", "dense: prefill chunk 2/3",
                   "dense: prefill chunk 3/3", "dense: decoding 2/4 tokens",
                   "dense: decoding 3/4 tokens", "dense: decoding 4/4 tokens"]


@pytest.mark.slow  # SmolLM2 on a 1,270-token prompt, dense and Quest: ~35 s on 2 cores
def test_main_job_as_the_readme_gives_it_dense_answers_right():
  python, *args = readme.main_job()
  assert python == "python"
  run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=xla_env.default_optimization())
  assert run.returncode == 0, run.stderr[-2000:]
  assert "the planted password is 'marigold': dense answers right" in run.stdout, run.stdout
  row = next(ln for ln in run.stdout.splitlines() if ln.startswith("quest@0.1 "))
  assert "chosen" in row and "%)" in row and "warning" not in run.stdout
  for step in ("loading", "compiling", "prefill chunk 1/3", "decoding"):
    assert step in run.stderr, step
