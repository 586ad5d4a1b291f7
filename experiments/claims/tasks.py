"""Task-accuracy claims of the selection methods (RESA Table 1, Retro Table 1) on the records of
``experiments.accuracy``, and the paired-sample helpers every accuracy claim uses.

Accuracy records carry ``method, budget, task, length, seed, depth, score`` (score in [0, 1]).
Two methods are compared only on the samples both ran (same task, length, seed and depth):
the paired bootstrap interval of the mean difference (``stats.paired_bootstrap``) and, for 0/1
scores, McNemar's exact test. A claim with a paper effect size is judged by
``verdicts.effect_verdict`` (at least half the paper's gain; "inconclusive" when the
interval holds both 0 and the paper's gain); ``gain_verdict`` (the sign only) serves the
claims whose paper gives no size. RULER claims read NVIDIA/RULER-generated records when there
are any (``verdicts.ruler_records``).
"""

from __future__ import annotations

import collections

import numpy as np

from experiments.claims import verdicts
from experiments.claims.row import Measured
from experiments.common import stats
from experiments.tasks import accuracy_report


def sample_key(r) -> tuple:
  return (r.get("task"), r.get("length"), r.get("seed"), r.get("depth"))


def base_label(label) -> str:
  """A row label without its budget: ``"quest@0.025"`` -> ``"quest"`` (``specs.Entry``)."""
  return str(label).split("@", 1)[0]


def _rows(records, method, budget=None, length=None, protocol=None):
  """The records of one method row (``budget``/``length``/``protocol`` None = any);
  ``method`` matches a row's label with or without its ``@budget`` suffix."""
  for r in records:
    label = r.get("method")
    if (method in (label, base_label(label)) and (budget is None or r.get("budget") == budget)
        and (length is None or r.get("length") == length)
        and (protocol is None or r.get("protocol") == protocol)):
      yield r


def scores(records, method, budget=None, length=None, protocol=None) -> dict:
  """sample -> score of one method row (``_rows``' selection)."""
  return {sample_key(r): float(r["score"])
          for r in _rows(records, method, budget, length, protocol)}


def predictions(records, method, budget=None, length=None, protocol=None) -> dict:
  """sample -> the generated answer of one method row (``_rows``' selection; records
  without one are left out)."""
  return {sample_key(r): r["prediction"] for r in _rows(records, method, budget, length, protocol)
          if r.get("prediction") is not None}


def same_answers(a: dict, ref: dict) -> tuple[int, int]:
  """``(k, n)``: on the n samples both ``predictions`` dicts hold, k answers are identical."""
  keys = set(a) & set(ref)
  return sum(a[k] == ref[k] for k in keys), len(keys)


def paired(a: dict, b: dict):
  """``(mean_a, mean_b, diff, lo, hi, n, mcnemar_p)`` over the samples both hold, or None."""
  keys = sorted(set(a) & set(b), key=repr)
  if not keys:
    return None
  xa, xb = np.array([a[k] for k in keys]), np.array([b[k] for k in keys])
  d, lo, hi = stats.paired_bootstrap(xa, xb)
  binary = np.all(np.isin(xa, (0.0, 1.0))) and np.all(np.isin(xb, (0.0, 1.0)))
  p = stats.mcnemar(xa > 0.5, xb > 0.5) if binary else float("nan")
  return float(xa.mean()), float(xb.mean()), d, lo, hi, len(keys), p


def gain_verdict(d, lo, hi) -> str:
  if d > 0 and lo > 0:
    return "reproduced"
  if d > 0:
    return "partly"
  return "not reproduced"


def pts(x) -> str:
  return f"{100 * x:+.1f}"


def model_of(records) -> str:
  return str(records[0].get("model", records[0].get("config", {}).get("model", "?")))


def longest_pair(records, new, base, budget, protocol=None, lengths=(8192, 4096, 2048)):
  """``(length, paired(...))`` of ``new`` vs ``base`` at the longest of ``lengths`` where both
  ran, or None."""
  for length in lengths:
    got = paired(scores(records, new, budget, length, protocol),
                 scores(records, base, budget, length, protocol))
    if got is not None:
      return length, got
  return None


def gain_claim(records, new, base, budget, protocol=None, lengths=(8192, 4096, 2048),
               found=None):
  """``new`` vs ``base`` at ``budget``, at the longest of ``lengths`` where both ran
  (``found``: ``longest_pair``'s answer, if already computed)."""
  found = found or longest_pair(records, new, base, budget, protocol, lengths)
  if found is not None:
    length, got = found
    d, lo, hi, n, p = got[2:]
    return Measured(
        ours=pair_text(got) + (f", McNemar p={p:.2g})" if np.isfinite(p) else ")"),
        n=n, setting=f"{model_of(records)}, {length} tokens, " + (
            f"budget {budget:g}" if budget is not None else f"{base} vs {new}"),
        verdict=gain_verdict(d, lo, hi), why=f"paired on {n} samples")
  return None


def task_differences(a: dict, b: dict) -> str:
  """``"; differs on k of n tasks: task b -> a, ..."`` over the samples both hold (``scores``'
  dicts, keyed by ``sample_key``): where a paired mean difference comes from."""
  by = collections.defaultdict(lambda: ([], []))
  for k in set(a) & set(b):
    by[k[0]][0].append(a[k])
    by[k[0]][1].append(b[k])
  diff = {t: (np.mean(xb), np.mean(xa)) for t, (xa, xb) in sorted(by.items())
          if not np.isclose(np.mean(xa), np.mean(xb))}
  if not by:
    return ""
  return (f"; differs on {len(diff)} of {len(by)} tasks"
          + "".join(f"{':' if i == 0 else ','} {t} {100 * mb:.0f} -> {100 * ma:.0f}"
                    for i, (t, (mb, ma)) in enumerate(diff.items())))


# RESA Table 1's columns, and its Quest gain at 2.5% of 8K on Llama-3.1-8B (the smaller one).
RESA_TABLE1_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3",
                     "niah_multivalue", "niah_multiquery", "qa")
RESA_TABLE1_GAIN = 0.042
# RESA Table 1, mean over its seven RULER tasks (Llama-3.1-8B, Llama-3.2-3B): +RESA - base.
RESA_TABLE1_OTHERS = {"arkvale": ("ArkVale", "+4.0, +4.5"), "topk": ("Ideal top-k", "+0.7, +3.7")}


def table1_records(records) -> tuple[list[dict], str]:
  """The query-aware RULER records of RESA Table 1's 7 tasks (``verdicts.ruler_records``)."""
  return verdicts.ruler_records(
      [r for r in records if r.get("protocol") != "query_agnostic" and benchmark(r) == "RULER"
       and r.get("task") in RESA_TABLE1_TASKS])


def balance_tasks(records, new, base, budget, length) -> tuple[list[dict], str]:
  """The records with every task of ``new`` vs ``base`` at ``length`` cut to the same number of
  paired samples (the lowest seeds), so the pooled mean is the mean of the task means, as the
  papers' tables average them; a slice of a longer run that has extended some tasks only then
  leaves the row as it was. Returns the records and a note naming the tasks that ran more
  (``""`` when balanced already)."""
  common = set(scores(records, new, budget, length)) & set(scores(records, base, budget, length))
  seeds = collections.Counter(k[0] for k in common)
  if len(set(seeds.values())) <= 1:
    return records, ""
  keep = accuracy_report.balanced_keys(common)
  k = min(seeds.values())
  more = ", ".join(f"{t} {n}" for t, n in sorted(seeds.items()) if n > k)
  out = [r for r in records if r.get("length") != length or sample_key(r) in keep]
  return out, f"balanced: {k} samples per task (ran more: {more})"


def resa_ruler_gain(records):
  """RESA Table 1: Quest+RESA beats Quest at 2.5% of an 8K context (Llama-3.1-8B: 83.2 ->
  87.4, Llama-3.2-3B: 62.9 -> 71.9, mean over its seven tasks). The why adds dense, the tasks
  where the pair differs, the other selectors of the table (ArkVale, ideal top-k) on the same
  samples, the share of the context Quest reads (RESA's forced sinks and local window come on
  top of the budget), how often each selector's answer equals dense's with and without RESA,
  Quest's pair at the shorter lengths that ran (Fig. 5a: the gain grows
  with the context) and at the other budgets that ran at the headline length."""
  aware, note = table1_records(records)
  found = longest_pair(aware, "resa-quest", "quest", 0.025)
  if found is None:
    return None
  length = found[0]
  aware, balance = balance_tasks(aware, "resa-quest", "quest", 0.025, length)
  found = longest_pair(aware, "resa-quest", "quest", 0.025, lengths=(length,))
  note = "; ".join(x for x in (note, balance) if x)
  got = gain_claim(aware, "resa-quest", "quest", 0.025, found=found)
  ran = len({k[0] for k in set(scores(aware, "resa-quest", 0.025, length))
              & set(scores(aware, "quest", 0.025, length))})
  setting = (", RESA lam 1 (its preset), RESA Table 1's 7 tasks"
             + ("" if ran == len(RESA_TABLE1_TASKS) else
                f" ({ran} of {len(RESA_TABLE1_TASKS)} ran so far)")
             + (f" ({note})" if note else ""))
  pair = lambda new, base, at: paired(scores(aware, new, 0.025, at), scores(aware, base, 0.025, at))
  why = ""
  dense = scores(aware, "dense", None, length)
  if dense:
    why += f"; dense {100 * np.mean(list(dense.values())):.1f}"
  read = accuracy_report.attended_share(
      [r for r in aware if base_label(r.get("method")) == "quest" and r.get("budget") == 0.025
       and r.get("length") == length])
  if read is not None:  # the forced sinks + local window come on top of the budget
    why += f"; Quest reads {100 * read:.1f}% of the context per head"
  why += task_differences(scores(aware, "resa-quest", 0.025, length),
                          scores(aware, "quest", 0.025, length))
  for base, (name, paper) in RESA_TABLE1_OTHERS.items():
    other = pair(f"resa-{base}", base, length)
    if other:
      why += f"; {name} {pair_text(other)}, n={other[5]}; paper {paper})"
  why += _closer_to_dense(aware, length)
  for shorter in sorted({r.get("length") for r in aware if r.get("length", 0) < length},
                        reverse=True):
    other = pair("resa-quest", "quest", shorter)
    if other:
      why += f"; at {shorter} tokens {pair_text(other)}, n={other[5]})"
  for budget in sorted({r.get("budget") for r in aware if base_label(r.get("method")) == "quest"
                        and r.get("length") == length and r.get("budget") not in (None, 0.025)}):
    other = paired(scores(aware, "resa-quest", budget, length),
                   scores(aware, "quest", budget, length))
    if other:  # the gain against the budget (the paper reports other budgets in its appendix)
      why += f"; at budget {budget:g} {pair_text(other)}, n={other[5]})"
  return got.plus(setting=setting, why=why, read=aware,
                  verdict=verdicts.effect_verdict(*found[1][2:5], RESA_TABLE1_GAIN))


def _closer_to_dense(aware, length, budget=0.025) -> str:
  """How often each selector's answer is dense's answer, without -> with RESA: RESA estimates
  the unselected keys' share of dense attention, so it pulls generations toward dense (which
  costs accuracy where the selector alone beats dense)."""
  ref = predictions(aware, "dense", None, length)
  parts = []
  for base, name in (("quest", "Quest"), *((b, n) for b, (n, _) in RESA_TABLE1_OTHERS.items())):
    (k0, n0), (k1, n1) = (same_answers(predictions(aware, m, budget, length), ref)
                          for m in (base, f"resa-{base}"))
    if n0 and n0 == n1:
      parts.append(f"{name} {k0} -> {k1} of {n0}")
  return "; answers identical to dense's without -> with RESA: " + ", ".join(parts) if parts else ""


def pair_text(got) -> str:
  """``"b -> a (d pts [lo, hi]"`` of a ``paired`` answer (the caller closes the bracket)."""
  ma, mb, d, lo, hi = got[:5]
  return f"{100 * mb:.1f} -> {100 * ma:.1f} ({pts(d)} pts [{pts(lo)}, {pts(hi)}]"


RETRO_TABLE1_GAIN = 0.026  # the mean of its per-dataset gains over Quest (+3.9 / +0.5 / +3.5)


def retro_longgen_gain(records):
  """RetroAttention Table 1: retro (w=2) beats Quest at relative budget 0.15 on
  LongGenBench-style multi-question generation (+3.9 / +0.5 / +3.5 points per dataset, mean
  +2.6). "inconclusive" when Quest alone is within that gain of dense (no headroom for it),
  else ``effect_verdict`` against +2.6."""
  qa = [r for r in records if r.get("task") == "qa_multi"]
  base = next((r["method"] for r in qa if str(r.get("method", "")).startswith("quest")
               and "0.15" in str(r.get("spec", "")) and "retro" not in str(r.get("spec", ""))),
              None)
  if base is None:
    return None
  got = gain_claim(qa, "retro", base, None)
  if got is None:
    return None
  why = ""
  dense = scores(qa, "dense")
  if dense:  # the headroom a gain over Quest could use
    why += f"; dense {100 * np.mean(list(dense.values())):.1f} on the same prompts"
  pair = paired(scores(qa, "retro"), scores(qa, base))
  room = paired(dense, scores(qa, base)) if dense else None
  verdict = ("inconclusive" if room is not None and room[2] < RETRO_TABLE1_GAIN
             else verdicts.effect_verdict(*pair[2:5], RETRO_TABLE1_GAIN))
  if room is not None and room[2] < RETRO_TABLE1_GAIN:
    why += (f"; no headroom: Quest is {pts(room[2])} pts from dense, less than the "
            f"paper's gain of {pts(RETRO_TABLE1_GAIN)}")
  why += _other_pairs(qa, ("retro", base))
  return got.plus(why=why, verdict=verdict)


def _other_pairs(records, main) -> str:
  """``"; new vs base: b -> a (d pts [lo, hi], n=k)"`` for every other ``(new, base)`` pair of
  the records' configs (``config.pairs``, e.g. RetroAttention's w = 4 and its lower budget)
  that both ran, paired on their samples."""
  pairs = []
  for r in records:
    for pair in (r.get("config") or {}).get("pairs", ()):
      if tuple(pair) != main and tuple(pair) not in pairs:
        pairs.append(tuple(pair))
  parts = []
  for new, base in pairs:
    got = paired(scores(records, new), scores(records, base))
    if got is not None:
      parts.append(f"; {new} vs {base}: {pair_text(got)}, n={got[5]})")
  return "".join(parts)


def is_heatmap(r) -> bool:
  """A record of the needle grid (a ``heatmap`` config), not of RULER."""
  return bool((r.get("config") or {}).get("heatmap"))


def benchmark(r) -> str:
  """Which table an accuracy record belongs to: the needle grid (a ``heatmap`` config),
  long-generation QA (``qa_multi``), or RULER (every other task)."""
  if is_heatmap(r):
    return "needle grid"
  return "long-gen QA" if r.get("task") == "qa_multi" else "RULER"


# ReSA Table 2 (RULER): dense 0.549; ReSA at sparsity 0.95 / 0.9 / 0.8 (keep 5 / 10 / 20%):
# 0.531 / 0.559 / 0.552, "comparable to the dense baseline" at 0.9.
RESA_TABLE2_KEEP = {"rectified": 0.1, "rectified:p=0.05": 0.05, "rectified:p=0.2": 0.2,
                    "rectified:p=0.02": 0.02}
COMPARABLE = verdicts.COMPARABLE  # points of accuracy within which "comparable" holds


def rectified_comparable_to_dense(records):
  """ReSA Table 2: ReSA on RULER at sparsity 0.9 (keep 10%) is comparable to dense (0.559 vs
  0.549; 0.531 at keep 5%, 0.552 at keep 20%). Ours: the ``rectified`` preset (p = 0.1) against
  dense on the same samples, every length that ran pooled, the other keeps in the why.
  Reproduced when the paired interval of rectified - dense lies above -3 points (a loss beyond
  3 points is ruled out), not reproduced when it lies below -3 points, inconclusive otherwise."""
  aware, note = table1_records(records)
  dense = scores(aware, "dense")
  parts = {m: paired(scores(aware, m), dense) for m in RESA_TABLE2_KEEP}
  main = parts.pop("rectified")
  if main is None:
    return None
  _, _, d, lo, hi, n, p = main
  verdict = verdicts.comparable_verdict(lo, hi, COMPARABLE)
  why = (f"paired on {n} samples (lengths {sorted({k[1] for k in dense})} pooled); "
         f"comparable = within {100 * COMPARABLE:g} points"
         + task_differences(scores(aware, "rectified"), dense).replace("differs", "rectified "
                                                                        "differs from dense"))
  for m, got in parts.items():
    why += (f"; keep {100 * RESA_TABLE2_KEEP[m]:g}% ({m}): {pair_text(got)}, n={got[5]})"
            if got else f"; keep {100 * RESA_TABLE2_KEEP[m]:g}% ({m}): not run")
  return Measured(
      ours=f"dense {pair_text(main)}" + (f", McNemar p={p:.2g})" if np.isfinite(p) else ")"),
      n=n, setting=f"{model_of(aware)}, rectified p=0.1 (keep 10%), f=32, group-shared "
                   f"selection, RESA Table 1's 7 tasks (ReSA's mix adds fwe, vt, cwe)"
                   + (f" ({note})" if note else ""),
      verdict=verdict, why=why, read=aware)
