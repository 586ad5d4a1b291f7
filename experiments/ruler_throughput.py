r"""Samples per hour of RULER at 32k on one GPU, ours next to kvpress's pipeline (issue 55, part 3).

  bash experiments/ruler_gpu.sh prepare   # here (a CPU): wheels, tokenizer, prompts -> .whl/
  bash experiments/ruler_gpu.sh           # on the GPU (carry .whl): everything below
  python -m experiments.ruler_throughput --quick --out=/tmp/rt   # the same path on a CPU
  python -m experiments.ruler_throughput --summarize DIR1 DIR2    # join two calls' folders

What runs: RULER at ``--length`` (32768) prompt tokens, RESA Table 1's 7 tasks x ``--samples``
(2) each, on Llama-3.1-8B's shape with random weights (bfloat16) and a real tokenizer
(SmolLM2's; ``--tokenizer`` reads it from a folder): the accuracies are meaningless, the cost is
real. Parts (``--parts``, run in that order, each in its own process and under its own limit,
within ``--total_s``):

* ``ours:SPEC``: ``python -m experiments.accuracy --config=configs/accuracy_gpu.py`` with that
  one method: query-aware, the samples of the length batched across tasks with the batch its
  memory plan chose (``experiments.tasks.batch_plan``), chunked prefill (compression scoring at
  the end of the prompt, prefilled in sub-batches), one device program per decode step; records
  in ``OUT/ours/results.jsonl`` with the plan and the device's peak bytes;
* ``kvpress:SPEC``: kvpress 0.5.5's ``KVPressTextGenerationPipeline`` (transformers' Llama with
  SDPA, the same random shape in bfloat16, one sample at a time, as kvpress runs) with the press
  of that spec (``dense``: none; ``expected-attention@0.5``: ``AdaKVPress(ExpectedAttentionPress
  (compression_ratio=0.5, epsilon=0.01))``, our preset's settings; ``snapkv@0.5``:
  ``SnapKVPress(compression_ratio=0.5)``) on the same token ids: the pipeline's ``forward``
  (compression and greedy generation) on our prompt's ids less the last token as the context
  and the last token as the question (so the whole prompt is compressed, as our query-aware
  run does), skipping only its tokenization; ``--kvpress_samples`` (1) per task; records in
  ``OUT/kvpress.jsonl`` with ``torch.cuda.max_memory_allocated``.

The summary (``OUT/ruler_throughput.md``, printed) gives per part the samples, the batch the
plan chose, the peak device memory, the seconds (ours: every batch's wall time, compilation
included; warm: batches after the first) and the samples per hour, ours over kvpress's for the
same spec, and the issue's goals: expected-attention at keep 0.5 at >= 4x kvpress, and a larger
batch for compression than for dense.

Cost: not measured yet. Estimate for one H100: ~1.5-2 min per ``ours`` part (model init, the
per-layer prefill step and the 32-layer decode program compiled once each, 14 prompts of 32k),
~1 min per ``kvpress`` part at one sample per task; all eight parts ~12 min, more than one
10-minute device call: the default order puts the goal's parts first and the rest go to a
second call (``PARTS=...``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from experiments.common import peer_kvpress
# The summary's API, here too (unused here: re-exported).
from experiments.ruler_throughput_report import rows, summary, write_summary  # pylint: disable=unused-import

FLAGS = flags.FLAGS
TABLE1_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3",
                "niah_multivalue", "niah_multiquery", "qa")  # experiments.claims.tasks'
DEFAULT_PARTS = ("ours:expected-attention@0.5", "kvpress:expected-attention@0.5", "ours:dense",
                 "ours:snapkv@0.5", "kvpress:snapkv@0.5", "ours:quest@0.025",
                 "ours:resa-quest@0.025", "kvpress:dense")
QUICK_BUDGET = {"@0.025": "@0.1"}  # 2.5% of 320 tokens chooses nothing: quick runs take 10%
PART_LIMIT_S = {"ours": 240, "kvpress": 180}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def define_flags() -> None:
  """The script's flags (defined when it runs, so importing it for its summary or its press
  table defines none: ``out`` is another script's flag too)."""
  flags.DEFINE_string("out", os.environ.get("OUT", "/tmp/ruler_throughput"), "Output folder.")
  flags.DEFINE_bool("quick", False, "tiny-random, 320 tokens, 2 tasks (a CPU rehearsal).")
  flags.DEFINE_string("model", "random:llama-3.1-8b", "Our model (random:SHAPE or a checkpoint).")
  flags.DEFINE_string("tokenizer", "", "A folder with tokenizer.json for random:SHAPE.")
  flags.DEFINE_integer("length", 32768, "RULER prompt tokens.")
  flags.DEFINE_list("tasks", list(TABLE1_TASKS), "RULER tasks.")
  flags.DEFINE_integer("samples", 2, "Samples per task (ours).")
  flags.DEFINE_integer("kvpress_samples", 1, "Samples per task (kvpress: one at a time).")
  flags.DEFINE_list("parts", list(DEFAULT_PARTS), "side:SPEC parts, run in this order.")
  flags.DEFINE_float("total_s", 570.0, "Seconds for all parts (a part gets what is left).")
  flags.DEFINE_string("kvpress_path", "", "Folder holding kvpress 0.5.5 and a transformers it "
                      "takes (prepended to the kvpress part's PYTHONPATH).")
  flags.DEFINE_string("sample_cache", "", "Folder of generated prompts (default OUT/samples).")
  flags.DEFINE_string("prepare", "", "Write the tokenizer and the prompts into this folder "
                      "(the CPU side of ruler_gpu.sh prepare) and exit.")
  flags.DEFINE_multi_string("summarize", [], "Only summarize these output folders.")
  flags.DEFINE_string("side", "", "Internal: run one kvpress part in this process.")
  flags.DEFINE_string("spec", "", "Internal: the part's method spec.")


# ---- the accuracy config both sides read the samples from ----


def _model_name() -> str:
  if FLAGS.quick:
    return "tiny-random"
  if FLAGS.tokenizer and FLAGS.model.startswith("random:") and FLAGS.model.count(":") == 1:
    return f"{FLAGS.model}:{FLAGS.tokenizer}"
  return FLAGS.model


def _spec(spec: str) -> str:
  if FLAGS.quick:
    for full, small in QUICK_BUDGET.items():
      spec = spec.replace(full, small)
  return spec


def overrides(spec: str) -> dict:
  """The ``configs/accuracy_gpu.py`` fields of a part (the command line of ``ours`` parts)."""
  return dict(model=_model_name(), methods=(_spec(spec),),
              lengths=(320 if FLAGS.quick else FLAGS.length,),
              tasks=tuple(("niah_single_1", "qa") if FLAGS.quick else FLAGS.tasks),
              num_samples=FLAGS.samples,
              sample_cache=FLAGS.sample_cache or os.path.join(FLAGS.out, "samples"))


def accuracy_config(spec: str):
  """The config an ``ours`` part runs (quick-resolved as the command line would)."""
  from configs import accuracy_gpu  # pylint: disable=g-import-not-at-top
  from experiments.common import quick  # pylint: disable=g-import-not-at-top
  fields = overrides(spec)
  c = accuracy_gpu.get_config()
  with c.unlocked():
    c.quick = FLAGS.quick
  c = quick.resolve(c, accuracy_gpu.get_config, explicit=fields)
  with c.unlocked():
    c.update(fields)
  return c


def _cli(fields: dict) -> list[str]:
  def show(v):
    return repr(tuple(v)) if isinstance(v, tuple) else str(v)
  return [f"--config.{k}={show(v)}" for k, v in fields.items()]


def samples_and_prompter(spec: str):
  """The RULER samples and prompter of a part (the sample cache when it holds them)."""
  from experiments.tasks import accuracy, ruler  # pylint: disable=g-import-not-at-top
  config = accuracy_config(spec)
  prompter = ruler.Prompter(tokenizer(config.model), chat=config.chat)
  return config, accuracy._dataset(config, prompter), prompter  # pylint: disable=protected-access


def tokenizer(model_name: str):
  """The tokenizer of ``model_name`` without loading its weights."""
  from experiments.common import modelzoo  # pylint: disable=g-import-not-at-top
  from models import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  parsed = modelzoo.parse_random(model_name)
  if parsed and parsed[1]:
    return tokenizer_lib.from_hf_dir(parsed[1])
  if model_name == modelzoo.TINY or parsed:
    return modelzoo.smollm2_tokenizer()
  return tokenizer_lib.from_hf_dir(model_name)


def hf_config(model_name: str) -> dict:
  """The ``config.json`` dict of our model's shape (kvpress builds transformers' model of it)."""
  from experiments.common import modelzoo  # pylint: disable=g-import-not-at-top
  from experiments.latency_lib import shapes  # pylint: disable=g-import-not-at-top
  parsed = modelzoo.parse_random(model_name)
  if parsed:
    return shapes.hf_config(parsed[0])
  if model_name == modelzoo.TINY:
    return modelzoo.tiny_random().config.to_hf_config()
  with open(os.path.join(model_name, "config.json"), encoding="utf-8") as f:
    return json.load(f)


# ---- the kvpress side ----


def press_of(kvpress, spec: str):
  """kvpress's press for one of our specs (``NAME@KEEP``), None for dense."""
  name, _, keep = spec.partition("@")
  ratio = 1.0 - float(keep) if keep else 0.5
  if name == "dense":
    return None
  if name == "expected-attention":  # our preset: Ada-KV head budgets, eps 0.01
    return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio,
                                                             epsilon=0.01))
  if name == "snapkv":
    return kvpress.SnapKVPress(compression_ratio=ratio)
  raise ValueError(f"no kvpress press for {spec!r} (dense, expected-attention@K, snapkv@K)")


def kvpress_part(spec: str) -> None:
  """One kvpress part in this process: build the model, run the samples, append records."""
  kvpress = peer_kvpress.load(FLAGS.kvpress_path)
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from experiments.tasks import accuracy  # pylint: disable=g-import-not-at-top
  config, samples, prompter = samples_and_prompter(spec)
  samples = [s for s in samples if s.seed < config.seed + FLAGS.kvpress_samples]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.float32 if FLAGS.quick else torch.bfloat16
  torch.manual_seed(0)
  t0 = time.perf_counter()
  cfg = transformers.AutoConfig.for_model(**hf_config(config.model))
  with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype,
                                                          attn_implementation="sdpa").eval()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=prompter.tokenizer.backend)
  pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tok)
  build_s = time.perf_counter() - t0
  press = press_of(kvpress, _spec(spec))

  def call(ids, max_new):
    inputs = {"context_ids": torch.tensor([ids[:-1]]), "questions_ids": [torch.tensor([ids[-1:]])]}
    return pipe.forward(inputs, press=press, max_new_tokens=max_new, cache=None)

  first_ids = accuracy.context_split(prompter, samples[0])[0]
  call(first_ids[:1024], 2)  # warm-up (CUDA, cuBLAS), not timed
  if device == "cuda":
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
  versions = dict(torch=torch.__version__, transformers=transformers.__version__,
                  kvpress=kvpress.version)
  path = os.path.join(FLAGS.out, "kvpress.jsonl")
  for s in samples:
    ids, n = accuracy.context_split(prompter, s)
    t = time.perf_counter()
    answer = call(ids, s.max_new_tokens)
    if device == "cuda":
      torch.cuda.synchronize()
    secs = time.perf_counter() - t
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
    rec = dict(side="kvpress", method=_spec(spec), press=repr(press), model=config.model,
               task=s.task, seed=s.seed, length=s.target, prompt_tokens=len(ids),
               context_tokens=n, max_new_tokens=s.max_new_tokens, seconds=secs,
               peak_bytes=peak, build_seconds=build_s, device=device,
               device_name=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               answer=answer[0] if isinstance(answer, list) else answer, **versions)
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps(rec) + "\n")
    print(f"kvpress {spec} {s.task} seed {s.seed}: {secs:.2f} s", flush=True)


# ---- the parent: parts, then the summary ----


def run_parts() -> None:
  os.makedirs(FLAGS.out, exist_ok=True)
  deadline = time.time() + FLAGS.total_s
  common = [f"--out={FLAGS.out}", f"--length={FLAGS.length}", f"--tasks={','.join(FLAGS.tasks)}",
            f"--samples={FLAGS.samples}", f"--kvpress_samples={FLAGS.kvpress_samples}",
            f"--model={FLAGS.model}", f"--tokenizer={FLAGS.tokenizer}",
            f"--sample_cache={FLAGS.sample_cache}"] + (["--quick"] if FLAGS.quick else [])
  for part in FLAGS.parts:
    side, _, spec = part.partition(":")
    if side not in PART_LIMIT_S or not spec:
      raise app.UsageError(f"part {part!r}: expected ours:SPEC or kvpress:SPEC")
    left = deadline - time.time()
    if left < 30:
      print(f"== {part} skipped ({left:.0f} s left of --total_s)", flush=True)
      _log_part(part, None, 0.0, "skipped")
      continue
    limit = min(PART_LIMIT_S[side], left) if not FLAGS.quick else left
    env = dict(os.environ)
    if side == "ours":
      cmd = [sys.executable, "-m", "experiments.accuracy", "--config=configs/accuracy_gpu.py",
             f"--workdir={os.path.join(FLAGS.out, 'ours')}"] + _cli(overrides(spec))
      if FLAGS.quick:
        cmd.append("--config.quick=True")
    else:
      cmd = [sys.executable, "-m", "experiments.ruler_throughput", "--side=kvpress",
             f"--spec={spec}"] + common
      if FLAGS.kvpress_path:
        env["PYTHONPATH"] = os.pathsep.join(
            [FLAGS.kvpress_path] + [p for p in [env.get("PYTHONPATH")] if p])
        cmd.append(f"--kvpress_path={FLAGS.kvpress_path}")
      env["JAX_PLATFORMS"] = "cpu"  # the kvpress process uses JAX for nothing on the device
    print(f"== {part} (limit {limit:.0f} s)", flush=True)
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=limit, check=False)
      rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
      rc, log = 124, _text(e.stdout) + _text(e.stderr)
    wall = time.time() - t0
    print(f"== {part} rc={rc} ({wall:.0f} s; 124 = timed out)", flush=True)
    print("\n".join(log.splitlines()[-6:]), flush=True)
    with open(os.path.join(FLAGS.out, "parts.log"), "a", encoding="utf-8") as f:
      f.write(f"==== {part} rc={rc} {wall:.1f} s\n{log}\n")
    _log_part(part, rc, wall, "ran")
  for extra in ("accuracy_vs_length.png",):  # the device tool brings back 8 files at most
    path = os.path.join(FLAGS.out, "ours", extra)
    if os.path.exists(path):
      os.remove(path)


def _text(x) -> str:
  return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _log_part(part: str, rc, wall: float, what: str) -> None:
  side, _, spec = part.partition(":")
  with open(os.path.join(FLAGS.out, "parts.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps(dict(part=f"{side}:{_spec(spec)}", rc=rc, wall_s=wall, status=what))
            + "\n")


def prepare(folder: str) -> None:
  """Saves SmolLM2's tokenizer to ``folder/tokenizer`` and generates every part's prompts into
  ``folder/samples`` with the tokenizer as the GPU will read it (so the sample cache's key, which
  holds the tokenizer, is the one the GPU computes)."""
  from experiments.common import modelzoo  # pylint: disable=g-import-not-at-top
  tok_dir = os.path.join(folder, "tokenizer")
  os.makedirs(tok_dir, exist_ok=True)
  modelzoo.smollm2_tokenizer().save(tok_dir)
  FLAGS.tokenizer = tok_dir
  FLAGS.sample_cache = os.path.join(folder, "samples")
  t0 = time.time()
  _, samples, _ = samples_and_prompter("dense")
  print(f"prepare: tokenizer in {tok_dir}, {len(samples)} prompts of {FLAGS.length} tokens in "
        f"{FLAGS.sample_cache} ({time.time() - t0:.0f} s)")


def main(argv) -> None:
  if len(argv) > 1 and not FLAGS.summarize:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.summarize:
    print(write_summary(list(FLAGS.summarize) + list(argv[1:]), FLAGS.out))
    return
  if FLAGS.prepare:
    prepare(FLAGS.prepare)
    return
  if FLAGS.side == "kvpress":
    kvpress_part(FLAGS.spec)
    return
  run_parts()
  print(write_summary([FLAGS.out], FLAGS.out))


if __name__ == "__main__":
  define_flags()
  app.run(main)
