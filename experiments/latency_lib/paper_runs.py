r"""The papers' efficiency settings on one GPU, in priority order under one deadline (issue 51).

The ``paper`` section of ``experiments.latency`` (``configs/latency_gpu_claims.py``). Its
``plan`` lists *items* in priority order, ``study[:shape]@cell`` (``cell`` = ``CONTEXTxBATCH``
or ``CONTEXT`` for batch 1):

* ``retro@32768x8``: RetroAttention Table 6, a random-weight model of ``shape`` (Llama-3.1-8B),
  decode with the ``retro`` preset's Quest (b = 0.15, 256-token minimum) at ``w = 0`` (no
  retro) and each of ``retro_windows``, the latency averaged over ``retro_decode_steps x
  retro_repeats`` tokens after the prompt (1,024: the paper's "1k tokens");
* ``batch@32768x8``: the ``batch_methods`` end to end at that batch (item 5: dense, Quest,
  +RESA at batch 8);
* ``resa_e2e@262144``: ReSA Fig. 7, dense and ``resa_spec`` (the ``rectified`` preset: block 16,
  keep 10%, f = 32) end to end on ``resa_shape`` (R1-Distill-Qwen-7B; ``resa_e2e:qwen3-1.7b@...``
  for the model of the paper's Sec. 3.4);
* ``resa_kernels@262144``: ReSA Fig. 6, one attention layer of ``resa_shape`` split into
  estimation, attention and rectification (``breakdown``).

Every item's parts run in ``shape_e2e``'s child processes (one model build per run of items on
the same engine and shape, a timeout per part), end-to-end parts as ``shape_e2e`` records (so
the named-shape table shows them), each record naming its ``study``, ``item`` and how many parts
the item has (``item_parts``). No part starts after ``paper_deadline_s`` (from the section's
start); parts not reached keep no record and a rerun in the same workdir resumes.
``python -m experiments.latency_lib.paper_runs seed SRC DST`` copies into ``DST/results.jsonl``
the records of the items SRC holds complete from one session (``complete``): a later GPU session
resumes there, and a ratio never pairs an item's parts across sessions.
"""

from __future__ import annotations

import os
import sys
import time

from experiments.latency_lib import settings, shape_e2e

SECTION = "paper"
STUDIES = ("retro", "batch", "resa_e2e", "resa_kernels")
_FINAL = ("ok", "skipped")


def retro_spec(w: int) -> str:
  """The ``retro`` preset at window ``w``; ``w = 0``: its Quest alone (Table 6's w = 0)."""
  from sparse_attn.presets import PRESETS  # pylint: disable=g-import-not-at-top
  quest = PRESETS["retro"].split("+")[0]
  return quest if w == 0 else f"{quest}+retro:w={w}"


def parse_item(item: str, s) -> dict:
  """``study[:shape]@cell`` -> ``dict(study, shape, context, batch, item)``."""
  head, at, cell = item.strip().partition("@")
  study, _, shape = head.partition(":")
  if study not in STUDIES or not at:
    raise ValueError(f"plan item {item!r}: want study[:shape]@CONTEXT[xBATCH], study one of "
                     f"{STUDIES}")
  ctx, _, batch = cell.partition("x")
  default = s.resa_shape if study.startswith("resa") else s.shape
  return dict(study=study, shape=shape or default, context=int(ctx), batch=int(batch or 1),
              item=item.strip())


def _methods(study: str, s) -> list[str]:
  if study == "retro":
    return [retro_spec(int(w)) for w in settings.split_list(s.retro_windows)]
  if study == "batch":
    return settings.split_list(s.batch_methods)
  if study == "resa_e2e":
    return ["dense", s.resa_spec]
  return [s.resa_spec]


def item_parts(item: dict, s) -> list[dict]:
  """The parts of one plan item, each with its record key (``part``)."""
  specs = _methods(item["study"], s)
  out = []
  for spec in specs:
    p = dict(item, dtype=s.shape_dtype, method=spec, item_parts=len(specs))
    if item["study"] == "resa_kernels":
      p.update(section="resa_kernels", phase="kernels")
      p["part"] = f"resa_kernels/{p['shape']}/{p['dtype']}/{p['context']}/{spec}"
    else:
      p.update(section=shape_e2e.SECTION, phase="decode")
      p["part"] = shape_e2e.key(p, s) + (f"/tokens={_tokens(s)}" if p["study"] == "retro"
                                         else "")
    out.append(p)
  return out


def _tokens(s) -> int:
  return int(s.retro_decode_steps) * int(s.retro_repeats)


def plan(s) -> list[tuple[str, dict, list[dict]]]:
  """``(engine, settings overrides, parts)`` per run of consecutive items that share an engine,
  a shape and step counts, in the plan's order."""
  groups: list[tuple[str, dict, list[dict]]] = []
  for text in settings.split_list(s.plan):
    item = parse_item(text, s)
    engine = "kernels" if item["study"] == "resa_kernels" else "ours"
    over = dict(shape=item["shape"])
    steps = (int(s.retro_decode_steps), int(s.retro_repeats))
    if item["study"] == "retro" and steps != (int(s.shape_decode_steps), int(s.shape_repeats)):
      over.update(shape_decode_steps=steps[0], shape_repeats=steps[1])
    parts = item_parts(item, s)
    if groups and groups[-1][:2] == (engine, over):
      groups[-1][2].extend(parts)
    else:
      groups.append((engine, over, parts))
  return groups


def run(s, done, write_record, workdir: str) -> None:
  """Runs every planned part not yet ``done``, in order, until ``paper_deadline_s``."""
  from experiments.latency_lib import shape_ours, shapes  # pylint: disable=g-import-not-at-top
  groups = plan(s)
  for _, over, parts in groups:  # bad names or specs fail here, not in a child
    shapes.model_config(over["shape"], s.shape_dtype)
    for spec in {p["method"] for p in parts}:
      shape_ours.make_method(spec, s)
  limit = float(s.paper_deadline_s)
  deadline = time.time() + limit if limit > 0 else float("inf")
  log = os.path.join(workdir, "shape_e2e.log")
  for engine, over, parts in groups:
    todo = [p for p in parts if not done(p["part"])]
    if not todo:
      continue
    if time.time() >= deadline:
      print(f"paper: deadline reached; not started: {sorted({p['item'] for p in todo})}",
            file=sys.stderr, flush=True)
      return
    ls = settings.Settings(dict(s.values, deadline=deadline, **over))
    shape_e2e._run_engine(engine, ls, todo, log, write_record)  # pylint: disable=protected-access


def session_of(r: dict) -> str:
  """The session a record belongs to (``EXPERIMENT_SESSION``), else its run id."""
  return r.get("session") or r.get("run") or ""


def by_session(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
  """``(item, session) -> records``: the final record (ok or skipped) of each part a session
  ran of a plan item, the last of each part."""
  groups: dict[tuple[str, str], dict[str, dict]] = {}
  for r in records:
    if r.get("item") and r.get("status") in _FINAL and "part" in r:
      groups.setdefault((r["item"], session_of(r)), {})[r["part"]] = r
  return {k: list(v.values()) for k, v in groups.items()}


def complete(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
  """``by_session``'s groups of the plan items a session finished whole (every part)."""
  return {k: v for k, v in by_session(records).items()
          if len(v) == v[0].get("item_parts", 0)}


def seed(src: str, dst: str) -> int:
  """Copies into ``dst/results.jsonl`` the records of ``src`` (a results.jsonl) whose plan item
  is complete in one session (the latest such session per item); returns how many."""
  from experiments.common import results  # pylint: disable=g-import-not-at-top
  recs = results.read_records(src) if os.path.exists(src) else []
  latest: dict[str, list[dict]] = {}
  for (item, _), group in complete(recs).items():
    when = max(r.get("time", "") for r in group)
    if item not in latest or when > max(r.get("time", "") for r in latest[item]):
      latest[item] = group
  keep = {id(r) for group in latest.values() for r in group}
  out = [r for r in recs if id(r) in keep]
  if out:
    os.makedirs(dst, exist_ok=True)
    results.write_records(os.path.join(dst, results.RESULTS_FILE), out)
  return len(out)


if __name__ == "__main__":
  if len(sys.argv) != 4 or sys.argv[1] != "seed":
    sys.exit("usage: python -m experiments.latency_lib.paper_runs seed SRC_RESULTS_JSONL DST_DIR")
  print(f"paper: seeded {seed(sys.argv[2], sys.argv[3])} records of complete items")
