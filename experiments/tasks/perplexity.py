"""Perplexity under sparse decoding (ReSA Sec. 3.2, Fig. 4-5; RetroAttention Fig. 7).

Documents are windows of ``L`` tokens of a long real text (Austen by default). Two views:

* **tail** (ReSA): prefill ``L - x`` tokens densely, teacher-force the last ``x`` through each
  method's decode path, and score the final ``eval_tokens`` (32 in ReSA). Swept over ``x``
  (``xs``), the rectification interval ``f`` (``rect_fs``) and the sparsity ``p`` (``ps``).
* **interval** (Retro): prefill ``L/2``, decode ``L/2``, perplexity per ``interval`` tokens.

All methods of one view run in lockstep on the same documents, so every record also has
KL(dense || method); relative perplexity is ``exp(mean NLL_method - mean NLL_dense)``.
Documents run ``doc_batch`` at a time (every method's cache of a batch is alive at once in the
lockstep); each batch is one resumable record per method, merged by ``merge`` for the tables.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from experiments.common import cli, data, executables, modelzoo, render, results, specs
from experiments.tasks import batch_plan, decoding, planned

EXPERIMENT = "perplexity"
# in every record's key
KEYED = ("model", "methods", "budgets", "xs", "interval_methods", "lengths")
# The planned run's fields (``configs/perplexity_gpu.py``) change how a number is computed,
# not what it is.
IGNORED = ("batch_plan", "prefill_batch", "memory_margin", "decode_step", "prefill_chunk",
           "lockstep_methods")


def documents(model, source: str, length: int, count: int, seed: int = 0) -> np.ndarray:
  """``[count, length]`` token windows from evenly spaced places in a long text."""
  text = data.long_text(source)
  # tokenize only what is needed: ~5 chars per token is generous for English prose
  need = count * length
  ids: list[int] = []
  chars = 6 * need + 10000
  while len(ids) < need + length and chars < 40 * len(text):
    ids = model.tokenizer.encode(text[:chars])
    chars *= 2
  if len(ids) < need:
    raise ValueError(f"{source!r} has {len(ids)} tokens, fewer than {count} x {length}")
  rng = np.random.default_rng(seed)
  starts = np.linspace(0, len(ids) - length, count + 2)[1:-1].astype(int)
  starts = np.clip(starts + rng.integers(0, 64, size=count), 0, len(ids) - length)
  return np.stack([np.asarray(ids[s:s + length], np.int32) for s in starts])


def _sweep_entries(config, model=None) -> list[tuple[str, specs.Entry]]:
  """(sweep name, entry) for the tail view: methods x budgets, then the f and p sweeps, each
  built for ``model`` (``specs.build(model=)``: RoPE frequencies, calibration tables)."""
  opts = dict(block_size=config.block_size, model=model)
  out = [("methods", e) for e in specs.expand(config.methods, config.budgets, **opts)]
  base = config.sweep_selector
  with_p = lambda p: f"{base}{',' if ':' in base else ':'}p={p}"
  for f in config.rect_fs:
    spec = f"{with_p(config.sweep_p)}+rect:f={f}"
    out.append(("f", specs.Entry(spec, spec, None, specs.build(spec, None, **opts))))
  for p in config.ps:
    for spec in (with_p(p), f"{with_p(p)}+rect:f={config.sweep_f}"):
      out.append(("p", specs.Entry(spec, spec, None, specs.build(spec, None, **opts))))
  return out


def _jobs(config, model):
  """The runs of ``config``: ``(view, x, length, docs, prefill_len, labels, sweeps)`` with
  ``labels`` label -> entry (dense among them) and ``sweeps`` label -> the sweeps it is in."""
  entries = _sweep_entries(config, model)
  dense = specs.Entry("dense", "dense", None, specs.build("dense", block_size=config.block_size))
  out = []
  for length in config.get("lengths", ()) or (config.length,):
    for x in config.xs:
      rows = [(s, e) for s, e in entries if s == "methods" or x == config.sweep_x]
      out.append(("tail", x, length, config.num_docs, length - x, rows))
  if config.interval_length:
    rows = [("interval", e) for e in specs.expand(
        config.interval_methods, config.budgets, block_size=config.block_size, model=model)]
    out.append(("interval", None, config.interval_length,
                config.get("interval_docs", 0) or config.num_docs, config.interval_length // 2,
                rows))
  jobs = []
  for view, x, length, n_docs, prefill_len, rows in out:
    labels = {e.label: e for _, e in rows}
    labels.setdefault("dense", dense)
    sweeps = collections.defaultdict(list)
    for s, e in rows:
      sweeps[e.label].append(s)
    jobs.append((view, x, length, n_docs, prefill_len, labels, sweeps))
  return jobs


def run(config, workdir: str, mesh=None) -> list[dict]:
  """Runs the perplexity views of ``config`` (on ``mesh`` if given); returns the records.

  ``config.batch_plan`` (``configs/perplexity_gpu.py``): the GPU path, ``_run_planned``.
  """
  model = modelzoo.load_model(config.model, mesh, config.get("dtype", "")).in_decode_layout()
  writer = results.ResultWriter(workdir, config, EXPERIMENT, keyed=KEYED, ignore=IGNORED)
  jobs = _jobs(config, model)
  if config.get("batch_plan", False):
    _run_planned(config, model, writer, jobs, mesh)
  else:
    _run_lockstep(config, model, writer, jobs, mesh)
  records = writer.records()
  write_outputs(records, workdir)
  return records


def _run_lockstep(config, model, writer, jobs, mesh) -> None:
  """The CPU path: per job, every method in one lockstep over ``doc_batch`` documents at a
  time; one record per (method, document batch)."""
  per = max(1, config.get("doc_batch", 0) or config.num_docs)
  progress = cli.Progress(sum(-(-j[3] // per) for j in jobs), "perplexity")
  for view, x, length, n_docs, prefill_len, labels, sweeps in jobs:
    key = lambda label, c: f"{config.model}|{view}|{length}|{x}|{label}|docs{c}+{per}"
    docs = None
    for c in range(0, n_docs, per):
      # Finished rows are never recomputed nor rewritten; dense always runs (the KL reference).
      todo = {k: e for k, e in labels.items() if not writer.done(key(k, c))}
      if not todo:
        progress.update(1)
        continue
      if docs is None:
        docs = documents(model, config.text, length, n_docs, config.seed)
      batch = docs[c:c + per]
      run_map = {k: e.method for k, e in labels.items() if k in todo or k == "dense"}
      steps = length - prefill_len - 1  # lockstep's hook runs once per method per decode step
      job = cli.Progress(len(run_map) * steps, f"perplexity job {view} x={x} docs {c}+")
      t0 = time.perf_counter()
      out = decoding.lockstep(model, batch, prefill_len, run_map, hook=lambda *_: job.update(),
                              mesh=mesh)
      seconds = time.perf_counter() - t0  # the batch's decoding (the report's wall time)
      for label, e in todo.items():
        writer.write(_record(config, view, x, length, label, e, sweeps, out[label], c,
                             int(batch.shape[0]), seconds), key=key(label, c))
      progress.update(1, f"{view} x={x} docs {c}..{c + len(batch) - 1}")
      executables.release_if_crowded()


def _record(config, view, x, length, label, e, sweeps, st, first_doc, num_docs, seconds,
            **extra) -> dict:
  """One record: ``label``'s numbers over documents ``first_doc ..`` (lockstep's ``st``)."""
  rec = dict(model=config.model, view=view, length=length, x=x, method=label,
             spec=e.spec, budget=e.budget, sweeps=sweeps.get(label, ["reference"]),
             rect_f=e.method.rect_interval, p=_p(e.method), first_doc=first_doc,
             num_docs=num_docs, memory_access=_memory(e.method, length),
             attended_tokens=_attended(e.method, length), batch_seconds=seconds, **extra)
  rec.update(_statistics(st, view, config))
  return rec


def _run_planned(config, model, writer, jobs, mesh) -> None:
  """The GPU path: per job, the methods in lockstep groups beside dense whose document batch
  the memory plan chose (``planned.lockstep_groups``; ``batch_size`` overrides), each method
  prefilled on its own in chunks, each decode step one device program on a GPU; one record
  per (method, document), so a rerun under another plan resumes."""
  if mesh is not None:
    raise ValueError("batch_plan plans one device's memory; run without --mesh")
  opts = planned.Options.of(config)
  key = lambda view, x, length, label, i: f"{config.model}|{view}|{length}|{x}|{label}|docs{i}+1"
  progress = cli.Progress(sum(j[3] * len(j[5]) for j in jobs), "perplexity")
  for view, x, length, n_docs, prefill_len, labels, sweeps in jobs:
    done = lambda k, i: writer.done(key(view, x, length, k, i))
    if all(done(k, i) for k in labels for i in range(n_docs)):
      progress.update(n_docs * len(labels))
      continue
    docs = documents(model, config.text, length, n_docs, config.seed)
    groups = planned.lockstep_groups(model, {k: e.method for k, e in labels.items()}, "dense",
                                     opts, capacity=length, longest_prompt=prefill_len,
                                     max_batch=n_docs)
    for methods, plan in groups:
      todo = [i for i in range(n_docs) if not all(done(k, i) for k in methods)]
      run = lambda rows, plan, methods=methods: decoding.lockstep(
          model, docs[rows], prefill_len, methods, fused=opts.fused,
          prefill=planned.prefiller(model, plan, opts))
      for ran in planned.each_batch(todo, plan, run, label=f"perplexity {view} x={x}"):
        peak = batch_plan.peak_bytes()
        for j, i in enumerate(ran.rows):
          for k in (k for k in methods if not done(k, i)):
            st = {name: a[j:j + 1] for name, a in ran.result[k].items()}
            writer.write(_record(
                config, view, x, length, k, labels[k], sweeps, st, i, 1, ran.seconds,
                batch_size=len(ran.rows), rows_run=ran.size, batch_index=ran.index,
                lockstep=list(methods), decode_step=opts.step_name, peak_bytes=peak,
                oom_retries=ran.retries, **ran.plan.record()),
                key=key(view, x, length, k, i))
        progress.update(len(ran.rows) * len(methods), f"{view} x={x} L={length}")
        executables.release_if_crowded()


def _statistics(st, view, config) -> dict:
  """The record's numbers from lockstep's per-token ``nll``/``kl``/``agree`` ``[B, n]``."""
  if view == "tail":
    n_eval = min(config.eval_tokens, st["nll"].shape[1])
    rec = dict(eval_tokens=n_eval, nll=float(st["nll"][:, -n_eval:].mean()),
               kl=float(st["kl"][:, -n_eval:].mean()), nll_all=float(st["nll"].mean()),
               kl_all=float(st["kl"].mean()), agree=float(st["agree"].mean()))
  else:
    size = config.interval
    n_int = max(1, st["nll"].shape[1] // size)
    part = lambda a, i: float(a[:, i * size:(i + 1) * size].mean())
    rec = dict(interval=size, nll_intervals=[part(st["nll"], i) for i in range(n_int)],
               kl_intervals=[part(st["kl"], i) for i in range(n_int)],
               nll=float(st["nll"].mean()), kl=float(st["kl"].mean()))
  rec["ppl"] = float(np.exp(rec["nll"]))
  return rec


def _attended(method, context):
  return method.attended_tokens(int(context))


def _p(method):
  bud = method.budget
  return None if bud is None else (bud.p if bud.budget is None else bud.budget)


def _memory(method, context):
  return float(method.memory_access(context))


# ---------------------------------------------------------------- rendering


_AVERAGED = ("nll", "kl", "nll_all", "kl_all", "agree")


def merge(records) -> list[dict]:
  """One record per (model, view, length, x, method): the document batches' numbers averaged
  with their document counts as weights (every batch scores the same tokens per document)."""
  groups = collections.defaultdict(list)
  for r in records:
    groups[(r["model"], r["view"], r["length"], r["x"], r["method"])].append(r)
  out = []
  for rs in groups.values():
    w = np.array([r["num_docs"] for r in rs], float)
    avg = lambda vals: float(np.average(np.asarray(vals, float), axis=0, weights=w))
    m = dict(rs[0], num_docs=int(w.sum()))
    for k in _AVERAGED:
      if k in m:
        m[k] = avg([r[k] for r in rs])
    for k in ("nll_intervals", "kl_intervals"):
      if k in m:
        m[k] = [float(v) for v in np.average(np.asarray([r[k] for r in rs], float), axis=0,
                                            weights=w)]
    m["ppl"] = float(np.exp(m["nll"]))
    out.append(m)
  return out


def _with_relative(records):
  """Adds ``rel_ppl = exp(nll - nll_dense)`` against the dense record of the same run
  (document batches merged first)."""
  records = merge(records)
  dense = {(r["model"], r["view"], r["length"], r["x"]): r["nll"] for r in records
           if r["method"] == "dense"}
  out = []
  for r in records:
    ref = dense.get((r["model"], r["view"], r["length"], r["x"]))
    out.append(dict(r, rel_ppl=float(np.exp(r["nll"] - ref)) if ref is not None else None))
  return out


def tables(records) -> list[str]:
  recs = _with_relative(records)
  out = []
  cols = ["method", "ppl", "rel_ppl", "kl", "agree", "memory_access"]
  tail = [r for r in recs if r["view"] == "tail"]
  for model in sorted({r["model"] for r in tail}):
    for sweep, what in (("methods", "x"), ("f", "rect_f"), ("p", "p")):
      rows = [r for r in tail if r["model"] == model
              and (sweep in r["sweeps"] or r["method"] == "dense")]
      groups = sorted({(r["length"], r["x"]) for r in rows
                       if sweep in r["sweeps"]})
      for length, x in groups:
        sel = [r for r in rows if r["length"] == length and r["x"] == x]
        sel.sort(key=lambda r: (r["method"] != "dense", r.get(what) or 0))
        title = (f"### Perplexity, last {sel[0]['eval_tokens']} tokens after decoding x={x} of "
                 f"L={length} (`{model}`, {sel[0]['num_docs']} docs), sweep: {sweep}")
        out.append(title + "\n\n" + render.markdown_table(sel, cols))
  inter = [r for r in recs if r["view"] == "interval"]
  for model in sorted({r["model"] for r in inter}):
    sel = [r for r in inter if r["model"] == model]
    sel.sort(key=lambda r: r["method"] != "dense")
    n = max(len(r["nll_intervals"]) for r in sel)
    size = sel[0]["interval"]
    rows = []
    for r in sel:
      row = {"method": r["method"], "ppl": r["ppl"], "rel_ppl": r["rel_ppl"]}
      for i, v in enumerate(r["nll_intervals"]):
        row[f"ppl@{(i + 1) * size}"] = float(np.exp(v))
      rows.append(row)
    title = (f"### Perplexity per {size}-token interval of the decoded half "
             f"(prefill L/2 = {sel[0]['length'] // 2}, `{model}`)")
    out.append(title + "\n\n" + render.markdown_table(
        rows, ["method", "ppl", "rel_ppl"] + [f"ppl@{(i + 1) * size}" for i in range(n)]))
  return out


def figures(records, workdir: str) -> list[str]:
  recs = _with_relative(records)
  names = []
  tail = [r for r in recs if r["view"] == "tail"]
  if tail:
    fig, axes = render.new_figure(ncols=3)
    for ax, (sweep, what, xlabel) in zip(axes[0], (("methods", "x", "decoded tokens x"),
                                                   ("f", "rect_f", "rectification interval f"),
                                                   ("p", "p", "sparsity p"))):
      lines = collections.defaultdict(list)
      for r in tail:
        if sweep in r["sweeps"] and r.get(what) is not None:
          name = r["spec"] if sweep == "methods" else ("+rect" if r["rect_f"] else "sparse")
          lines[(r["model"], name)].append((r[what], r["rel_ppl"]))
      for (model, name), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
      ax.axhline(1.0, color="k", lw=0.5)
      ax.set_xlabel(xlabel)
      ax.set_ylabel("perplexity / dense")
      if lines:
        ax.legend(fontsize=6)
    names.append(render.save_figure(fig, workdir, "perplexity_sweeps.png"))
  inter = [r for r in recs if r["view"] == "interval"]
  if inter:
    fig, axes = render.new_figure()
    ax = axes[0][0]
    for r in inter:
      xs = [(i + 1) * r["interval"] for i in range(len(r["nll_intervals"]))]
      ax.plot(xs, np.exp(r["nll_intervals"]), marker="o", label=r["method"])
    ax.set_xlabel("decoded tokens")
    ax.set_ylabel("perplexity per interval")
    ax.legend(fontsize=6)
    names.append(render.save_figure(fig, workdir, "perplexity_intervals.png"))
  return names


def write_outputs(records, workdir: str) -> str:
  import os  # pylint: disable=g-import-not-at-top
  sections = tables(records) + [f"![{os.path.basename(p)}]({os.path.basename(p)})"
                                for p in figures(records, workdir)]
  return render.write_markdown(workdir, "perplexity.md", "Perplexity under sparse decoding",
                               sections)
