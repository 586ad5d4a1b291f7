"""RULER-style accuracy of methods x budgets x tasks x context lengths (RESA Table 1 layout).

``run(config, workdir)`` generates the samples (``experiments.tasks.ruler``), decodes them
greedily in batches with every method (one shared prefill for the selection methods, one for
the compression methods: ``decoding.prefill_all``), scores them with RULER's string match and
appends one JSON record per (method, sample), with the tokens attended per head
(``Method.attended_tokens``) or kept per kv head (compression). ``experiments.tasks.
accuracy_report`` renders them.

Protocols (``config.protocol``):
  query_aware     the whole prompt (question included) is prefilled, then the answer decoded
                  (RULER as RESA, ReSA and RetroAttention run it);
  query_agnostic  the context is prefilled and compressed, then the question is read through
                  the decode path (Expected Attention / kvpress: the cache is compressed once,
                  for any question).

Batching (``config.batch_plan``):
  False  (the CPU configs) the samples of one (task, length) in batches of ``batch_size``;
         per batch one shared prefill serves every method (``decoding.prefill_all``);
  True   (``configs/accuracy_gpu.py``) every method on its own, with the batch that fits the
         device's free memory (``experiments.tasks.batch_plan``; ``batch_size`` > 0 overrides
         it), over the samples of one length across tasks (``batch_across_tasks``), in batches
         of one shape (``planned.batches``: one compiled decode program per method and
         length), a compression method prefilling in sub-batches (``planned.prefill``); the
         decode step is ``decode_step`` (``auto``: one device program on a GPU, per-layer calls
         on a CPU; ``program`` / ``per_layer`` force one). Each record adds the plan
         (``plan_batch``, ``plan_bytes`` ...), the device's peak bytes so far (``peak_bytes``;
         None on a CPU) and the rows the batch ran. A batch that runs out of device memory is
         retried at half the batch. Predictions equal the shared-prefill loop's
         (``tests/experiments/test_accuracy_gpu.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
import time

import numpy as np

from experiments.common import checks, cli, config_check, executables, modelzoo, results, specs
from experiments.tasks import accuracy_report, batch_plan, decoding, planned, ruler, scoring
from sparse_attn.protocol import PrefillGroup

EXPERIMENT = "accuracy"
# In every record's key (extending them reuses finished rows); reporting-only fields ignored.
KEYED = ("model", "protocol", "methods", "budgets", "tasks", "lengths")
# A sample is a pure function of its seed (``ruler.generate``), so a larger ``num_samples``
# extends a workdir with the new seeds instead of refusing it as another config.
# The planned run's fields (batching, decode step, prefill chunk, sample cache) change how a
# prediction is computed, not what it is.
# So does ``bucket_capacity`` (compacted caches of ``BUCKET_BITS`` significant bits:
# ``specs.bucketed``; exact in per-head caches, to float rounding in Ada-KV's flat one).
IGNORED = ("pairs", "heatmap", "num_samples", "batch_plan", "prefill_batch", "memory_margin",
           "decode_step", "prefill_chunk", "batch_across_tasks", "sample_cache",
           "bucket_capacity")
DECODE_STEPS = planned.DECODE_STEPS  # -> decoding.greedy's fused
PROTOCOLS = config_check.PROTOCOLS  # checked there before anything loads
CAPACITY_ROUND = 256
BUCKET_BITS = 2  # 4 sizes per doubling: at most 25% more slots


def _key(model_name, protocol, label, s: ruler.Sample) -> str:
  return f"{model_name}|{protocol}|{label}|{s.task}|{s.target}|{s.seed}|{s.depth}"


def context_split(prompter: ruler.Prompter, s: ruler.Sample) -> tuple[list[int], int]:
  """The prompt's ids and how many of them are the context (instruction + haystack).

  The rest (question, chat template end, answer prefix) is what a query-agnostic method reads
  only after compressing. The split is the longest prefix shared by the ids of the whole prompt
  and of the text up to the end of the context, so the ids are the same in both protocols.
  """
  ids = prompter.ids(s.prompt)
  end = s.prompt.index(s.context) + len(s.context)
  head = prompter.ids(s.prompt[:end])
  n = next((i for i, (a, b) in enumerate(zip(ids, head)) if a != b), min(len(ids), len(head)))
  if not 0 < n < len(ids):
    raise ValueError(f"cannot split a {s.task} prompt of {len(ids)} tokens at its context end")
  return ids, n


def query_length(protocol: str, split) -> np.ndarray | None:
  """``[B]`` the question's tokens ending each prompt (``split``: ``context_split``'s
  ``(ids, n)`` per row): what a query-aware method observes (FINCH's window); None when the
  prompt holds no question (query-agnostic: it is read after compression)."""
  if protocol != "query_aware":
    return None
  return np.array([len(ids) - n for ids, n in split], np.int32)


def attended_tokens(method, context: int, num_layers: int):
  """``method.attended_tokens(context, num_layers)`` (forced / chosen / total per head in a
  sparse layer, and their mean over the layers), or None."""
  return method.attended_tokens(int(context), num_layers)


def kv_kept(pre: decoding.Prefilled) -> list[float] | None:
  """Per row, the mean tokens per kv head left in a compression method's cache after its
  prefill (mean over layers and heads)."""
  caches = pre.caches if isinstance(pre.caches, list) else None
  if not caches or not hasattr(caches[0], "valid"):
    return None
  per_layer = [_kept_per_head(c) for c in caches]  # [B] each
  return [float(x) for x in np.mean(per_layer, axis=0)]


def _kept_per_head(cache) -> np.ndarray:
  """``[B]`` mean valid tokens per kv head: per-head ``valid [B, K, T]``, or a flat Ada-KV
  buffer's ``valid [B, S]`` shared by its ``num_kv_heads`` heads."""
  valid = np.asarray(cache.valid)
  if valid.ndim == 2:
    return valid.sum(-1) / cache.num_kv_heads
  return valid.sum(-1).mean(-1)


def pad(seqs) -> tuple[np.ndarray, np.ndarray]:
  """``[B, max len]`` int32 ids (zero-padded) and ``[B]`` lengths of a batch of id lists."""
  lengths = np.array([len(x) for x in seqs], np.int32)
  out = np.zeros((len(seqs), int(lengths.max())), np.int32)
  for i, x in enumerate(seqs):
    out[i, :len(x)] = x
  return out, lengths


def entries_of(config, model) -> list[specs.Entry]:
  return specs.expand(config.methods, config.budgets, block_size=config.block_size,
                      model=model)


def run(config, workdir: str, *, experiment: str = EXPERIMENT, entries=None,
        fields=None, write=True, keyed=(), mesh=None,
        allow_long_context: bool = False) -> list[dict]:
  """Runs the accuracy sweep of ``config`` (see ``configs/accuracy.py``); returns the records.

  Args:
    experiment: the records' experiment name (the lambda sweep and the budget search reuse
      this loop under their own names).
    entries: ``model -> [specs.Entry]`` (default: ``config.methods`` x ``config.budgets``).
    fields: ``Entry -> dict`` of extra record fields (e.g. the lambda of a sweep row).
    write: render ``accuracy.md`` into the workdir at the end.
    keyed: further config fields whose value is in every record's key (the sweep's axes).
    mesh: a device mesh to run on (``models.sharding``; the records are one device's).
    allow_long_context: run lengths beyond the model's ``max_position_embeddings`` (refused
      otherwise, before any sample is generated).
  """
  model = modelzoo.load_model(config.model, mesh, config.get("dtype", "")).in_decode_layout()
  checks.check_positions(max(config.lengths), _max_new_tokens(config),
                         model.config.max_position_embeddings, allow=allow_long_context,
                         flag="--allow_long_context")
  prompter = ruler.Prompter(model.tokenizer, chat=config.chat)
  entries = entries(model) if callable(entries) else entries_of(config, model)
  if config.get("bucket_capacity", False):
    entries = specs.bucketed(entries, BUCKET_BITS)
  protocol = config.get("protocol", "query_aware")
  if protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
  writer = results.ResultWriter(workdir, config, experiment, keyed=KEYED + tuple(keyed),
                                ignore=IGNORED)
  samples = _dataset(config, prompter)
  if protocol == "query_aware":  # FINCH observes the run's longest question whole
    entries = specs.sized_for_question(entries, lambda: max(query_length(
        protocol, [context_split(prompter, s) for s in samples])))
  if config.get("decode_step", "auto") not in DECODE_STEPS:
    raise ValueError(f"decode_step must be one of {tuple(DECODE_STEPS)}, "
                     f"got {config.decode_step!r}")
  fused = DECODE_STEPS[config.get("decode_step", "auto")]
  if config.get("batch_plan", False):
    _run_planned(config, model, prompter, entries, samples, writer, protocol, experiment,
                 fields, mesh)
    records = writer.records()
    if write:
      accuracy_report.write_outputs(records, workdir)
    return records
  groups = collections.defaultdict(list)
  for s in samples:
    groups[(s.task, s.target)].append(s)
  progress = cli.Progress(len(samples) * len(entries), experiment)
  key = lambda e, s: _key(config.model, protocol, e.label, s)
  for (task, target), group in groups.items():
    for start in range(0, len(group), config.batch_size):
      batch = group[start:start + config.batch_size]
      todo = [e for e in entries if not all(writer.done(key(e, s)) for s in batch)]
      progress.update((len(entries) - len(todo)) * len(batch))
      if not todo:
        continue
      split = [context_split(prompter, s) for s in batch]
      max_new = config.max_new_tokens or batch[0].max_new_tokens
      if protocol == "query_agnostic":
        prompts, lengths = pad([ids[:n] for ids, n in split])
        suffix, suffix_lengths = pad([ids[n:] for ids, n in split])
        total = int((lengths + suffix_lengths).max())
      else:
        prompts, lengths = pad([ids for ids, _ in split])
        total = int(lengths.max())
      question = query_length(protocol, split)
      # Rounded up so batches of one target length share the compiled steps.
      capacity = -(-(total + max_new + 1) // CAPACITY_ROUND) * CAPACITY_ROUND
      # Each shared prefill's methods together, so none of them runs twice.
      todo = [todo[i] for i in decoding.prefill_order(model, [e.method for e in todo],
                                                      capacity, mesh)]
      t0 = time.perf_counter()
      for e, (m, pre) in zip(todo, decoding.prefill_all(model, prompts, lengths,
                                                         [e.method for e in todo], capacity,
                                                         mesh=mesh, question_length=question)):
        rows, kept = _answer(model, pre, e, m, protocol,
                             (suffix, suffix_lengths) if protocol == "query_agnostic" else None,
                             max_new, fused)
        secs = time.perf_counter() - t0
        for i, (s, row) in enumerate(zip(batch, rows)):
          rec = _record(config, model, protocol, e, m, s, row, split[i][1],
                        kept[i] if kept else None, batch_seconds=secs, batch_size=len(batch))
          rec.update(fields(e) if fields else {})
          writer.write(rec, key=key(e, s))
        progress.update(len(batch), e.label)
        executables.release_if_crowded()
        t0 = time.perf_counter()
  records = writer.records()
  if write:
    accuracy_report.write_outputs(records, workdir)
  return records


def _record(config, model, protocol, e, m, s: ruler.Sample, row, context_tokens, kept,
            **extra) -> dict:
  """One accuracy record: sample ``s`` answered ``row`` (ids) by entry ``e`` (method ``m``)."""
  pred = model.decode(row)
  rec = dict(
      model=config.model, protocol=protocol, method=e.label, spec=e.spec, budget=e.budget,
      task=s.task, length=s.target, num_tokens=s.num_tokens, context_tokens=context_tokens,
      depth=s.depth, seed=s.seed, score=scoring.score(pred, s.answers, s.metric),
      metric=s.metric, answers=list(s.answers), prediction=pred, new_tokens=len(row),
      attended_tokens=attended_tokens(m, s.num_tokens, model.config.num_layers), kv_kept=kept,
      generator=ruler.GENERATOR, **extra)
  if s.metric == "each":
    rec["question_scores"] = scoring.per_question(pred, s.answers)
  return rec


def _run_planned(config, model, prompter, entries, samples, writer, protocol, experiment,
                 fields, mesh) -> None:
  """The planned loop (module docstring, ``batch_plan=True``): per length, per method, batches
  of the size its memory plan chose; writes the records."""
  if mesh is not None:
    raise ValueError("batch_plan plans one device's memory; run without --mesh (or set "
                     "--config.batch_plan=False)")
  fused = DECODE_STEPS[config.get("decode_step", "auto")]
  step_name = "program" if (_steps_fused() if fused is None else fused) else "per_layer"
  chunk = int(config.get("prefill_chunk", 512))
  key = lambda e, s: _key(config.model, protocol, e.label, s)
  groups = collections.defaultdict(list)
  for s in samples:
    groups[s.target if config.get("batch_across_tasks", True) else (s.task, s.target)].append(s)
  progress = cli.Progress(len(samples) * len(entries), experiment)
  for group in groups.values():
    split = {id(s): context_split(prompter, s) for s in group}
    if protocol == "query_agnostic":
      longest = max(n for _, n in split.values())
    else:
      longest = max(len(ids) for ids, _ in split.values())
    max_new = config.max_new_tokens or max(s.max_new_tokens for s in group)
    total = max(len(ids) for ids, _ in split.values())
    capacity = -(-(total + max_new + 1) // CAPACITY_ROUND) * CAPACITY_ROUND
    for e in entries:
      todo = [s for s in group if not writer.done(key(e, s))]
      progress.update(len(group) - len(todo))
      if not todo:
        continue
      m = batch_plan.with_decode_slots(e.method, capacity, longest)
      plan = batch_plan.plan(model, m, capacity=capacity, longest_prompt=longest,
                             prefill_chunk=chunk, max_batch=len(todo),
                             margin_fraction=config.get("memory_margin", 0.1),
                             override=config.batch_size,
                             prefill_override=config.get("prefill_batch", 0))
      run = lambda rows, plan, m=m, e=e: _planned_batch(
          model, protocol, m, e, rows, split, plan, capacity, chunk, max_new, fused)
      for ran in planned.each_batch(todo, plan, run, label=f"{experiment}: {e.label}"):
        out, kept = ran.result
        peak = batch_plan.peak_bytes()
        for i, (s, row) in enumerate(zip(ran.rows, out)):
          cut = row if config.max_new_tokens else row[:s.max_new_tokens]  # its task's cap
          rec = _record(config, model, protocol, e, m, s, cut, split[id(s)][1],
                        kept[i] if kept else None, batch_seconds=ran.seconds,
                        batch_size=len(ran.rows), rows_run=ran.size, batch_index=ran.index,
                        capacity=capacity, decode_step=step_name, peak_bytes=peak,
                        oom_retries=ran.retries, **ran.plan.record())
          rec.update(fields(e) if fields else {})
          writer.write(rec, key=key(e, s))
        progress.update(len(ran.rows), e.label)
        executables.release_if_crowded()


def _planned_batch(model, protocol, m, e, run, split, plan, capacity, chunk, max_new, fused):
  """One batch of the planned loop (``run``: its samples, padded by ``planned.each_batch``)
  -> ``(token rows, kv kept or None)``, a row per sample of ``run``."""
  ids = [split[id(s)] for s in run]
  if protocol == "query_agnostic":
    prompts, lengths = pad([x[:k] for x, k in ids])
    suffix, suffix_lengths = pad([x[k:] for x, k in ids])
  else:
    prompts, lengths = pad([x for x, _ in ids])
  pre = planned.prefill(model, prompts, lengths, m, capacity, prefill_batch=plan.prefill_batch,
                        prefill_chunk=chunk, question_length=query_length(protocol, ids))
  return _answer(model, pre, e, m, protocol,
                 (suffix, suffix_lengths) if protocol == "query_agnostic" else None,
                 max_new, fused)


def _answer(model, pre, e, m, protocol, question, max_new, fused):
  """After the prompt's prefill ``pre``: the entry's post-prefill hook, the KV a compression
  method kept, the question read after the prompt (query-agnostic: ``question = (suffix,
  suffix_lengths)``, one chunk where the method reads chunks (dense, compression), selectors
  step), then greedy decoding -> ``(token rows, kept or None)``."""
  if e.after_prefill is not None:
    pre = dataclasses.replace(pre, states=e.after_prefill(pre.states))
  kept = kv_kept(pre) if m.prefill_group == PrefillGroup.COMPRESSION else None
  if protocol == "query_agnostic":
    read = (decoding.extend if m.is_dense or m.prefill_group == PrefillGroup.COMPRESSION
            else functools.partial(decoding.extend_stepwise, fused=fused))
    pre = read(model, pre, m, *question)
  return decoding.greedy(model, pre, m, max_new, fused=fused), kept


def _steps_fused() -> bool:
  """Whether the decode step runs as one device program by default here (a GPU)."""
  from models import steps  # pylint: disable=g-import-not-at-top
  return steps.fused_by_default()


def _dataset(config, prompter) -> list[ruler.Sample]:
  """``ruler.dataset`` of the config; with ``sample_cache`` (a directory), read from / written to
  a JSON file there named by everything a sample depends on (the tokenizer included), so runs
  in several processes (one per method) generate the prompts once."""
  args = (config.tasks, config.lengths, config.num_samples, prompter, list(config.depths),
          config.seed, config.haystack)
  cache = config.get("sample_cache", "")
  if not cache:
    return ruler.dataset(*args, **_task_options(config))
  tok = prompter.tokenizer
  ident = json.dumps(dict(generator=ruler.GENERATOR, tasks=list(config.tasks),
                          lengths=list(config.lengths), n=config.num_samples,
                          depths=list(config.depths), seed=config.seed,
                          haystack=config.haystack, chat=prompter.chat,
                          options=_task_options(config),
                          tokenizer=_tokenizer_id(tok)), sort_keys=True)
  path = os.path.join(cache, f"ruler_{hashlib.sha1(ident.encode()).hexdigest()[:16]}.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return [_sample(d) for d in json.load(f)["samples"]]
  samples = ruler.dataset(*args, **_task_options(config))
  os.makedirs(cache, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(dict(ident=json.loads(ident),
                   samples=[dataclasses.asdict(s) for s in samples]), f)
  os.replace(tmp, path)
  return samples


def _tokenizer_id(tok) -> str:
  """A hash of a tokenizer's vocabulary and chat template (stable across ``tokenizers``
  versions, unlike its serialized form)."""
  vocab = sorted(tok.backend.get_vocab(with_added_tokens=True).items())
  return hashlib.sha1(json.dumps([vocab, tok.chat_template, tok.bos_id, tok.add_bos]).encode()
                      ).hexdigest()


def _sample(d: dict) -> ruler.Sample:
  d = dict(d, answers=tuple(d["answers"]),
           needle_spans=tuple(tuple(x) for x in d["needle_spans"]))
  return ruler.Sample(**d)


def _max_new_tokens(config) -> int:
  """The most tokens a sample of ``config`` generates (its tasks' own when 0)."""
  return config.max_new_tokens or max(ruler.MAX_NEW_TOKENS.get(t, 0) for t in config.tasks)


def _task_options(config) -> dict:
  n = config.get("questions", 0)
  return dict(questions=n) if n else {}


