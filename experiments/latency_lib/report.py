"""Markdown tables, the target summary and the time-vs-context figure, from the JSON records."""

from __future__ import annotations

import functools
import math

from experiments.common import render


def latest(records: list[dict]) -> list[dict]:
  """The last record of every key (a rerun replaces earlier numbers), in first-seen order."""
  out: dict = {}
  for r in records:
    out[r.get("key", id(r))] = r
  return list(out.values())


def _f(x, digits=3):
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return ""
  return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def per_layer_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["section"] == "per_layer"]
  gpu = any(r.get("pct_peak") for r in rows)
  out = [dict(dtype=r["dtype"], context=r["context"], method=r["method"], **{
      "ms/step": _f(r["ms"]), "x dense": _f(r["speedup"]), "bound x": _f(r["bound"]),
      "GB/s": _f(r["gbs"]), "% peak": _f(r.get("pct_peak"))}) for r in rows]
  cols = ["dtype", "context", "method", "ms/step", "x dense", "bound x", "GB/s"]
  return render.markdown_table(out, cols + (["% peak"] if gpu else []))


def _by(rows, **kw):
  return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def e2e_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["section"] == "end_to_end"]
  out = []
  for r in rows:
    peers = _by(rows, phase=r["phase"], context=r["context"])
    dense = next((p["tok_s"] for p in peers if p["method"] == "dense"), None)
    hf = next((p["tok_s"] for p in peers if p["method"] == "transformers"), None)
    out.append({"phase": r["phase"], "context": r["context"], "method": r["method"],
                "tok/s": _f(r["tok_s"]), "x dense": _f(r["tok_s"] / dense if dense else None),
                "x transformers": _f(r["tok_s"] / hf if hf else None)})
  return render.markdown_table(out, ["phase", "context", "method", "tok/s", "x dense",
                                     "x transformers"])


_FINAL = ("ok", "skipped")


def shape_rows(rows: list[dict]) -> list[dict]:
  """One record per ``shape_e2e`` part: its finished (or skipped) one, else its latest failure."""
  by: dict = {}
  for r in rows:
    if r.get("section") != "shape_e2e":
      continue
    old = by.get(r["part"])
    if old is None or old.get("status") not in _FINAL or r.get("status") in _FINAL:
      by[r["part"]] = r
  return list(by.values())


def _value(r):
  """ms per decode step, or prefill seconds; None unless the part ran."""
  if r.get("status") != "ok":
    return None
  return r.get("step_ms") if r["phase"] == "decode" else r.get("seconds")


def _host_ms(r: dict) -> str:
  """A record's host issue time per step; ``*`` where it was read over a whole round (records
  without ``dispatch_steps``: past PJRT's 32 queued executions the host waits for the GPU)."""
  got = _f(r.get("dispatch_ms"))
  return got + "*" if got and "dispatch_steps" not in r else got


def shape_table(rows: list[dict]) -> str:
  """The named-shape table: ours and the transformers peer per (phase, batch, context)."""
  recs = shape_rows(rows)
  cell = lambda r: (r["shape"], r["dtype"], r["phase"], r["batch"], r["context"])
  out = []
  for r in recs:
    peers = {p["method"]: _value(p) for p in recs if cell(p) == cell(r)}
    val, dense, hf = _value(r), peers.get("dense"), peers.get("transformers")
    decode = r["phase"] == "decode"
    note = r.get("reason") or r.get("bound_flag") or ""
    out.append({
        "phase": r["phase"], "batch": r["batch"], "context": r["context"],
        "method": r["method"], "status": r.get("status", ""),
        "ms/step" if decode else "s": _f(val), "host ms/step": _host_ms(r),
        "tok/s": _f(r.get("tok_s")),
        "x dense": _f(dense / val if dense and val else None),
        "x transformers": _f(hf / val if hf and val else None),
        "GB/step": _f((r.get("weight_bytes", 0) + r.get("kv_bytes", 0)) / 1e9 or None),
        "bound ms": _f(r.get("bound_ms")), "of bound": _f(r.get("bound_fraction"), 2),
        "note": note.replace("|", "/").replace("\n", " ")[:120]})
  # A row that never ran (the run's deadline) names no device: it adds no heading.
  devices = sorted({(r.get("shape"), r.get("dtype"), r.get("device"), r.get("backend"),
                     r.get("peak_gbs"), r.get("peak_source")) for r in recs
                    if r.get("device")}, key=str)
  head = "\n".join(f"{s} ({dt}, random weights) on {dev} ({be}), peak {_f(pk)} GB/s "
                    f"({src}); x dense / x transformers: their time over this row's; host "
                    "ms/step: the host's time to issue one of a round's first steps (near "
                    "ms/step: host-bound; * timed over a whole round, past the 32 executions "
                    "a GPU's queue holds, so it repeats the device's pace)."
                    for s, dt, dev, be, pk, src in devices)
  cols = ["phase", "batch", "context", "method", "status", "ms/step", "host ms/step", "s",
          "tok/s", "x dense", "x transformers", "GB/step", "bound ms", "of bound", "note"]
  return head + "\n\n" + render.markdown_table(out, cols)


def _add_target(out: list[dict], name: str, value, ok: bool, goal: str) -> None:
  """Appends a goal's row (``met`` yes/no) to ``out`` when ``value`` was measured."""
  if value is not None:
    out.append({"target": name, "measured": _f(value), "goal": goal,
                "met": "yes" if ok else "no"})


def shape_targets(rows: list[dict]) -> str:
  """Issue 36's end-to-end goals where measured (batch 1)."""
  recs = [r for r in shape_rows(rows) if r["batch"] == 1]
  at = lambda phase, ctx, m: next((_value(r) for r in recs if r["phase"] == phase
                                   and r["context"] == ctx and r["method"] == m), None)
  out = []

  add = functools.partial(_add_target, out)
  q = "quest:gqa=group"
  for r in recs:
    ctx = r["context"]
    if r["method"] == "dense" and r["phase"] == "decode" and r.get("bound_fraction"):
      add(f"dense decode, fraction of the bound, {ctx}", r["bound_fraction"],
          r["bound_fraction"] >= 0.7, ">= 0.7")
    if r["method"] == q and r["phase"] == "decode" and _value(r) and ctx >= 131072:
      dense = at("decode", ctx, "dense")
      add(f"quest p=0.1 decode speed-up over dense, {ctx}", dense and dense / _value(r),
          bool(dense) and dense / _value(r) >= 1.6, ">= 1.6x")
    if r["method"] == q + "+resa" and r["phase"] == "decode" and _value(r):
      quest = at("decode", ctx, q)
      add(f"+resa / quest decode, {ctx}", quest and _value(r) / quest,
          bool(quest) and _value(r) / quest <= 1.05, "<= 1.05")
    if r["method"] == "dense" and r["phase"] == "prefill" and _value(r):
      hf = at("prefill", ctx, "transformers")
      add(f"dense prefill speed / transformers, {ctx}", hf and hf / _value(r),
          bool(hf) and hf / _value(r) >= 1.0, ">= 1")
  return render.markdown_table(out, ["target", "measured", "goal", "met"])


def prefill_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["section"] == "prefill"]
  out = [{"model": r["model"], "layers": r["layers"], "context": r["context"],
          "threads": r["threads"], "ours tok/s": _f(r["ours_tok_s"]),
          "transformers tok/s": _f(r["transformers_tok_s"]),
          "ours / transformers": _f(r["ratio"])} for r in rows]
  return render.markdown_table(out, ["model", "layers", "context", "threads", "ours tok/s",
                                     "transformers tok/s", "ours / transformers"])


def prefill_chunk_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["section"] == "prefill_chunk"]
  out = [{"dtype": r["dtype"], "context": r["context"], "chunk": f"{r['where']} {r['chunk']}",
          "path": r["method"], "ms": _f(r["ms"]), "x kernel": _f(r["vs_kernel"]),
          "TFLOP/s": _f(r["tflops"])} for r in rows]
  return render.markdown_table(out, ["dtype", "context", "chunk", "path", "ms", "x kernel",
                                     "TFLOP/s"])


def memory_table(rows: list[dict]) -> str:
  rows = [r for r in rows if r["section"] == "memory"]
  dense = next((r for r in rows if r["method"] == "dense"), None)
  out = []
  for r in rows:
    out.append({"method": r["method"], "context": r["context"], "layers": r["layers"],
                "cache MB": _f(r["cache_bytes"] / 2**20),
                "x dense bytes": _f(r["cache_bytes"] / dense["cache_bytes"] if dense else None),
                "slots/layer": r["slots_per_layer"], "peak RSS MB": _f(r["peak_rss_mb"], 4),
                "peak - base MB": _f(r["peak_rss_mb"] - r["base_rss_mb"], 4),
                "x dense peak-base": _f(_growth(r, dense, "peak_rss_mb")),
                "decoding - base MB": _f(r["rss_after_mb"] - r["base_rss_mb"], 4),
                "x dense decoding-base": _f(_growth(r, dense, "rss_after_mb"))})
  return render.markdown_table(out, ["method", "context", "layers", "cache MB", "x dense bytes",
                                     "slots/layer", "peak RSS MB", "peak - base MB",
                                     "x dense peak-base", "decoding - base MB",
                                     "x dense decoding-base"])


def _growth(r, dense, key):
  """RSS growth over the child's baseline (``key`` - base), relative to dense's."""
  if not dense:
    return None
  return (r[key] - r["base_rss_mb"]) / (dense[key] - dense["base_rss_mb"])


def resa_rows(rows: list[dict]) -> list[dict]:
  """Measured last-chunk overheads plus the derived whole-prefill and decode overheads."""
  out = [{"overhead": r["what"], "dtype": r["dtype"], "context": r["context"],
          "selector": _f(r["selector_ms"]) + " ms", "+resa": _f(r["resa_ms"]) + " ms",
          "overhead %": _f(r["overhead_pct"])} for r in rows if r["section"] == "resa"]
  for r in rows:
    if r["section"] == "end_to_end" and r["method"].endswith("+resa"):
      sel = r["method"][: -len("+resa")]
      base = _by(rows, section="end_to_end", phase=r["phase"], context=r["context"], method=sel)
      if base:
        what = ("whole prefill (SmolLM2, all layers)" if r["phase"] == "prefill"
                else "decode step (SmolLM2, all layers)")
        out.append({"overhead": what, "dtype": "float32", "context": r["context"],
                    "selector": _f(base[0]["tok_s"]) + " tok/s", "+resa": _f(r["tok_s"]) + " tok/s",
                    "overhead %": _f(100.0 * (base[0]["tok_s"] / r["tok_s"] - 1.0))})
    if r["section"] == "per_layer" and "+resa" in r["method"] and "+retro" not in r["method"]:
      sel = r["method"].replace("+resa", "")
      base = _by(rows, section="per_layer", dtype=r["dtype"], context=r["context"], method=sel)
      if base:
        out.append({"overhead": "decode step (one layer, Llama-8B shape)", "dtype": r["dtype"],
                    "context": r["context"], "selector": _f(base[0]["ms"]) + " ms",
                    "+resa": _f(r["ms"]) + " ms",
                    "overhead %": _f(100.0 * (r["ms"] / base[0]["ms"] - 1.0))})
  return out


def resa_table(rows: list[dict]) -> str:
  return render.markdown_table(resa_rows(rows), ["overhead", "dtype", "context", "selector",
                                                 "+resa", "overhead %"])


def _ms(rows, dtype, ctx, method):
  got = _by(rows, section="per_layer", dtype=dtype, context=ctx, method=method)
  return got[0]["ms"] if got else None


def targets(rows: list[dict]) -> str:
  """Issue 9's targets, per dtype and context where measured."""
  out = []

  add = functools.partial(_add_target, out)
  q = "quest:gqa=group"
  for r in _by(rows, section="per_layer", method="dense"):
    dt, ctx = r["dtype"], r["context"]
    quest = _ms(rows, dt, ctx, q)
    if quest and ctx >= 32768:
      goal = 5.0 if ctx >= 131072 else 4.0
      add(f"quest p=0.1 speed-up, {dt} {ctx}", r["ms"] / quest, r["ms"] / quest >= goal,
          f">= {goal}x")
    for m, lim, label in ((q + "+resa", 1.05, "quest+resa / quest"),
                          (q + "+retro:w=4", 1.15, "quest+retro w=4 / quest")):
      t = _ms(rows, dt, ctx, m)
      if t and quest:
        add(f"{label}, {dt} {ctx}", t / quest, t / quest <= lim, f"<= {lim}")
    sdpa = _ms(rows, dt, ctx, "torch SDPA (dense)")
    if sdpa:
      add(f"dense / torch SDPA, {dt} {ctx}", r["ms"] / sdpa, r["ms"] / sdpa <= 1.2, "<= 1.2")
    for impl in ("cudnn", "xla"):  # JAX's own fused attention: what our dense decode could call
      peer = _ms(rows, dt, ctx, f"jax dot_product_attention ({impl})")
      if peer:
        add(f"dense / jax dot_product_attention ({impl}), {dt} {ctx}", r["ms"] / peer,
            r["ms"] / peer <= 1.0, "<= 1")
  for r in _by(rows, section="end_to_end", method="dense", phase="decode"):
    hf = _by(rows, section="end_to_end", phase="decode", context=r["context"],
             method="transformers")
    if hf:
      ratio = r["tok_s"] / hf[0]["tok_s"]
      add(f"e2e dense decode tok/s / transformers, {r['context']}", ratio, ratio >= 1.0, ">= 1")
  for r in _by(rows, section="prefill"):
    add(f"dense prefill tok/s / transformers, {r['model']} {r['context']}", r["ratio"],
        r["ratio"] >= 1.0, ">= 1")
  mem = [r for r in rows if r["section"] == "memory"]
  dense = next((r for r in mem if r["method"] == "dense"), None)
  for r in mem:
    if dense and "ratio=0.5" in r["method"]:
      ratio = r["cache_bytes"] / dense["cache_bytes"]
      add("cache bytes at ratio 0.5 / dense", ratio, ratio <= 0.55, "~0.5")
      pk = _growth(r, dense, "peak_rss_mb")
      add("peak RSS growth at ratio 0.5 / dense", pk, pk < 0.8, "falls accordingly")
      st = _growth(r, dense, "rss_after_mb")
      add("RSS growth while decoding at ratio 0.5 / dense", st, st < 0.6, "~0.5")
  return render.markdown_table(out, ["target", "measured", "goal", "met"])


def figure(rows: list[dict], workdir: str) -> str | None:
  rows = [r for r in rows if r["section"] == "per_layer"]
  dtypes = sorted({r["dtype"] for r in rows})
  if not dtypes:
    return None
  fig, axes = render.new_figure(ncols=len(dtypes), size=(6.0, 4.2))
  for ax, dt in zip(axes[0], dtypes):
    for method in dict.fromkeys(r["method"] for r in rows if r["dtype"] == dt):
      pts = sorted((r["context"], r["ms"]) for r in rows
                   if r["dtype"] == dt and r["method"] == method)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method,
              linestyle="--" if "torch" in method or "attend only" in method else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step (one layer)")
    ax.set_title(f"Llama-3.1-8B attention, {dt}")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][-1].legend(fontsize=6, loc="upper left")
  return render.save_figure(fig, workdir, "latency.png")


def write(records: list[dict], workdir: str) -> tuple[str, str]:
  """Writes ``latency.md`` and ``latency.png``; returns (markdown text, path)."""
  rows = latest(records)
  secs = []
  for title, fn, sec in (("Targets (issue 36): end to end, named shape", shape_targets,
                          "shape_e2e"),
                         ("End to end, named shape (random weights) vs transformers",
                          shape_table, "shape_e2e"),
                         ("Targets (issue 9)", targets, None),
                         ("Per-layer decode attention", per_layer_table, "per_layer"),
                         ("End to end", e2e_table, "end_to_end"),
                         ("Dense prefill vs transformers", prefill_table, "prefill"),
                         ("Dense prefill chunk, one layer: kernel vs in-order (cuDNN)",
                          prefill_chunk_table, "prefill_chunk"),
                         ("Memory", memory_table, "memory"),
                         ("RESA overheads", resa_table, None)):
    if sec is None or any(r.get("section") == sec for r in rows):
      body = fn(rows)
      if not body.rstrip().splitlines()[-1].startswith("|---"):  # a table with no rows: none
        secs.append(f"## {title}\n\n{body}")
  figure(rows, workdir)
  path = render.write_markdown(workdir, "latency.md", "Decode latency and memory", secs)
  with open(path, encoding="utf-8") as f:
    return f.read(), path
