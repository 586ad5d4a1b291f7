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
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from experiments.common import checks, cli, config_check, modelzoo, results, specs
from experiments.tasks import accuracy_report, decoding, ruler, scoring
from sparse_attn.protocol import PrefillGroup

EXPERIMENT = "accuracy"
# In every record's key (extending them reuses finished rows); reporting-only fields ignored.
KEYED = ("model", "protocol", "methods", "budgets", "tasks", "lengths")
# A sample is a pure function of its seed (``ruler.generate``), so a larger ``num_samples``
# extends a workdir with the new seeds instead of refusing it as another config.
IGNORED = ("pairs", "heatmap", "num_samples")
PROTOCOLS = config_check.PROTOCOLS  # checked there before anything loads
CAPACITY_ROUND = 256


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


def attended_tokens(method, context: int):
  """``method.attended_tokens(context)`` (forced / chosen / total per head), or None."""
  return method.attended_tokens(int(context))


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
                      rope_inv_freq=modelzoo.rope_inv_freq(model))


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
  model = modelzoo.load_model(config.model, mesh).in_decode_layout()  # one copy of the weights
  checks.check_positions(max(config.lengths), _max_new_tokens(config),
                         model.config.max_position_embeddings, allow=allow_long_context,
                         flag="--allow_long_context")
  prompter = ruler.Prompter(model.tokenizer, chat=config.chat)
  entries = entries(model) if callable(entries) else entries_of(config, model)
  protocol = config.get("protocol", "query_aware")
  if protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
  writer = results.ResultWriter(workdir, config, experiment, keyed=KEYED + tuple(keyed),
                                ignore=IGNORED)
  samples = ruler.dataset(config.tasks, config.lengths, config.num_samples, prompter,
                          list(config.depths), config.seed, config.haystack,
                          **_task_options(config))
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
      # Rounded up so batches of one target length share the compiled steps.
      capacity = -(-(total + max_new + 1) // CAPACITY_ROUND) * CAPACITY_ROUND
      t0 = time.perf_counter()
      for e, (m, pre) in zip(todo, decoding.prefill_all(model, prompts, lengths,
                                                         [e.method for e in todo], capacity,
                                                         mesh=mesh)):
        if e.after_prefill is not None:
          pre = dataclasses.replace(pre, states=e.after_prefill(pre.states))
        kept = kv_kept(pre) if m.prefill_group == PrefillGroup.COMPRESSION else None
        if protocol == "query_agnostic":
          # one chunk where the method reads chunks (dense, compression); selectors step
          read = (decoding.extend if m.is_dense or m.prefill_group == PrefillGroup.COMPRESSION
                  else decoding.extend_stepwise)
          pre = read(model, pre, m, suffix, suffix_lengths)
        rows = decoding.greedy(model, pre, m, max_new)
        secs = time.perf_counter() - t0
        for i, (s, row) in enumerate(zip(batch, rows)):
          pred = model.decode(row)
          rec = dict(
              model=config.model, protocol=protocol, method=e.label, spec=e.spec,
              budget=e.budget, task=task, length=target, num_tokens=s.num_tokens,
              context_tokens=split[i][1], depth=s.depth, seed=s.seed,
              score=scoring.score(pred, s.answers, s.metric), metric=s.metric,
              answers=list(s.answers), prediction=pred, new_tokens=len(row),
              attended_tokens=attended_tokens(m, s.num_tokens),
              kv_kept=kept[i] if kept else None, batch_seconds=secs, batch_size=len(batch),
              generator=ruler.GENERATOR)
          if s.metric == "each":
            rec["question_scores"] = scoring.per_question(pred, s.answers)
          rec.update(fields(e) if fields else {})
          writer.write(rec, key=key(e, s))
        progress.update(len(batch), e.label)
        t0 = time.perf_counter()
  records = writer.records()
  if write:
    accuracy_report.write_outputs(records, workdir)
  return records


def _max_new_tokens(config) -> int:
  """The most tokens a sample of ``config`` generates (its tasks' own when 0)."""
  return config.max_new_tokens or max(ruler.MAX_NEW_TOKENS.get(t, 0) for t in config.tasks)


def _task_options(config) -> dict:
  n = config.get("questions", 0)
  return dict(questions=n) if n else {}


