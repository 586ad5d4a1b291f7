"""The main job (``experiments.generate``): a long default prompt, the share each method
attends, a warning where a method is dense, and progress on every long step."""

import io
import os
import subprocess
import sys

import jax
import pytest

from experiments.common import modelzoo, passage, sparsity, stages
from models import decode, llama
from models.config import ModelConfig, RopeConfig
from models.loading import Model
from sparse_attn import methods

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_prompt_is_a_long_passage_with_its_answer_near_the_start():
  text = passage.default_prompt()
  n = len(modelzoo.smollm2_tokenizer().encode(text))
  assert 1000 <= n <= 2000, n
  assert text.endswith(passage.QUESTION)
  assert text.index("Bingley") < len(text) // 3  # the answer is far from the local window


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


@pytest.mark.slow  # SmolLM2 on a 1,250-token prompt, dense and Quest: ~30 s on 2 cores
def test_main_job_shows_sparsity_on_the_default_prompt():
  run = subprocess.run([sys.executable, "-m", "experiments.generate", "--method=quest",
                        "--budget=0.1", "--max_new_tokens=8"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "quest@0.1 differs from dense." in run.stdout
  row = next(ln for ln in run.stdout.splitlines() if ln.startswith("quest@0.1 "))
  assert "chosen" in row and "%)" in row and "warning" not in run.stdout
  for step in ("loading", "compiling", "prefill chunk 1/3", "decoding"):
    assert step in run.stderr, step
