"""The summary of ``experiments.ruler_throughput``'s parts: samples per hour, ours next to kvpress.

``rows(dirs)`` reads each output folder's ``results.jsonl`` (ours), ``kvpress.jsonl`` and
``parts.jsonl``; ``summary`` renders them as markdown and ``write_summary`` writes
``ruler_throughput.md`` and ``ruler_throughput.json`` into a folder.
"""

from __future__ import annotations

import json
import os

GIB = 1 << 30


def _read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


def rows(dirs: list[str]) -> list[dict]:
  """One summary row per (side, method) over the records of ``dirs``."""
  from experiments.common import results  # pylint: disable=g-import-not-at-top
  ours, kv, parts = [], [], []
  for d in dirs:
    ours += results.read_records(os.path.join(d, "ours", "results.jsonl"))
    kv += _read_jsonl(os.path.join(d, "kvpress.jsonl"))
    parts += _read_jsonl(os.path.join(d, "parts.jsonl"))
  walls = {}
  for p in parts:
    if p.get("status") == "ran":
      walls[p["part"]] = walls.get(p["part"], 0.0) + p["wall_s"]
  out = []
  for method in dict.fromkeys(r["method"] for r in ours):
    recs = [r for r in ours if r["method"] == method]
    batches = {}
    for r in recs:
      batches.setdefault((r.get("run"), r.get("length"), r.get("batch_index")), r)
    secs = sum(b["batch_seconds"] for b in batches.values())
    warm = [b for k, b in batches.items() if k[2] not in (0, None)]
    warm_n = sum(b["batch_size"] for b in warm)
    warm_s = sum(b["batch_seconds"] for b in warm)
    peaks = [r["peak_bytes"] for r in recs if r.get("peak_bytes") is not None]
    out.append(dict(side="ours", method=method, samples=len(recs), seconds=secs,
                    per_hour=3600 * len(recs) / secs if secs else None,
                    warm_per_hour=3600 * warm_n / warm_s if warm_s else None,
                    batch=max(r["plan_batch"] for r in recs),
                    prefill_batch=max(r["plan_prefill_batch"] for r in recs),
                    rows_run=max(r["rows_run"] for r in recs),
                    plan_gib=max(r["plan_bytes"] for r in recs) / GIB,
                    peak_gib=max(peaks) / GIB if peaks else None,
                    part_wall_s=walls.get(f"ours:{method}")))
  for method in dict.fromkeys(r["method"] for r in kv):
    recs = [r for r in kv if r["method"] == method]
    secs = sum(r["seconds"] for r in recs)
    peaks = [r["peak_bytes"] for r in recs if r.get("peak_bytes") is not None]
    out.append(dict(side="kvpress", method=method, samples=len(recs), seconds=secs,
                    per_hour=3600 * len(recs) / secs if secs else None, warm_per_hour=None,
                    batch=1, prefill_batch=1, rows_run=1, plan_gib=None,
                    peak_gib=max(peaks) / GIB if peaks else None,
                    part_wall_s=walls.get(f"kvpress:{method}")))
  for r in out:
    theirs = next((k for k in out if k["side"] == "kvpress" and k["method"] == r["method"]), None)
    r["vs_kvpress"] = (r["per_hour"] / theirs["per_hour"]
                       if r["side"] == "ours" and theirs and r["per_hour"] and theirs["per_hour"]
                       else None)
  return out


def _f(x, digits=1) -> str:
  return "" if x is None else f"{x:.{digits}f}"


def summary(dirs: list[str]) -> str:
  """The markdown summary of ``dirs``' records (see the module docstring)."""
  rs = rows(dirs)
  device = "the device of these runs"
  kv = [r for d in dirs for r in _read_jsonl(os.path.join(d, "kvpress.jsonl"))]
  if kv:
    device = kv[0].get("device_name", device)
  lines = [f"# RULER throughput ({device})", "",
           "Samples per hour: samples / the wall seconds of their batches (ours: compilation in "
           "the first batch of each method; warm: the batches after it); kvpress: one sample "
           "at a time through its pipeline, after a warm-up call. Peak: the device's peak "
           "bytes in use in the part's process. Random weights: the accuracies mean nothing.",
           "",
           "| side | method | samples | batch (plan) | prefill batch | rows run | plan GiB | "
           "peak GiB | seconds | samples/h | warm samples/h | vs kvpress | part wall s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rs:
    lines.append(f"| {r['side']} | {r['method']} | {r['samples']} | {r['batch']} | "
                 f"{r['prefill_batch']} | {r['rows_run']} | {_f(r['plan_gib'])} | "
                 f"{_f(r['peak_gib'])} | {_f(r['seconds'])} | {_f(r['per_hour'], 0)} | "
                 f"{_f(r['warm_per_hour'], 0)} | {_f(r['vs_kvpress'], 2)} | "
                 f"{_f(r['part_wall_s'], 0)} |")
  by = {(r["side"], r["method"].split("@")[0]): r for r in rs}
  ea, dense = by.get(("ours", "expected-attention")), by.get(("ours", "dense"))
  lines += ["", "Goals (issue 55):"]
  if ea and ea["vs_kvpress"] is not None:
    lines.append(f"- expected-attention at keep 0.5 at >= 4x kvpress's samples per hour: "
                 f"{ea['vs_kvpress']:.2f}x ({'met' if ea['vs_kvpress'] >= 4 else 'not met'})")
  else:
    lines.append("- expected-attention vs kvpress: not measured in these folders")
  comp = [r for r in rs if r["side"] == "ours" and r["method"].split("@")[0]
          in ("expected-attention", "snapkv")]
  if dense and comp:
    for r in comp:
      lines.append(f"- {r['method']}: batch {r['batch']} vs dense {dense['batch']} "
                   f"({'larger' if r['batch'] > dense['batch'] else 'not larger'})")
  return "\n".join(lines) + "\n"


def write_summary(dirs: list[str], out: str) -> str:
  text = summary(dirs)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "ruler_throughput.md"), "w", encoding="utf-8") as f:
    f.write(text)
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(rows(dirs), f, indent=1)
  return text
