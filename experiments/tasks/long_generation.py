"""Error accumulation in long outputs (ReSA Fig. 1; RetroAttention Table 4, 11, Fig. 1b, 2b-c).

From the same prompts (windows of a long real text), every method generates ``new_tokens``
greedily. Measured per method against dense:

* tokens until the first divergence from dense, and the normalised token edit similarity;
* KL(dense || method) and argmax agreement per ``interval`` tokens, teacher-forcing every method
  along the **dense** trajectory (so the error measured is the method's own, not the effect of
  an earlier different token);
* for ``+retro``: the effective KV budget of each query once it leaves the window, as a factor
  of the nominal budget of its first step (Retro Fig. 2c);
* for ``+track`` (``experiments.common.reuse``): the overlap of the selected blocks of adjacent
  queries (Retro Fig. 2b); ``+reuse`` is the top-k-reuse baseline (Retro Table 4).
"""

from __future__ import annotations

import collections
import os

import numpy as np

from experiments.common import cli, executables, modelzoo, render, results, specs
from experiments.tasks import batch_plan, decoding, planned, scoring
from experiments.tasks.perplexity import IGNORED, documents
from models import steps
from sparse_attn.enhancers import retro

EXPERIMENT = "long_generation"
KEYED = ("model", "methods", "budgets", "prompt_lengths")  # in every record's key


class StateProbe:
  """A ``lockstep`` hook: retro's effective budget factors and selection overlap per step."""

  def __init__(self):
    self.nominal = collections.defaultdict(dict)  # label -> {(row, pos): nominal exposed}
    self.factor = collections.defaultdict(list)  # label -> [(step, mean factor over rows)]
    # label -> {row: [factor of each query that left the window]}: one mean per prompt
    self.row_factors = collections.defaultdict(lambda: collections.defaultdict(list))
    self.overlap = collections.defaultdict(list)  # label -> [(step, mean overlap)]

  def __call__(self, label, step, states):
    states = steps.stack_layers(states)
    if getattr(states, "retro", None) is not None:
      self._retro(label, step, states)
    if isinstance(states, dict) and "overlap" in states:
      ov = np.asarray(states["overlap"])
      if np.isfinite(ov).any():
        self.overlap[label].append((step, float(np.nanmean(ov))))

  def absorb(self, other: "StateProbe", *, offset: int, rows: int) -> None:
    """Adds ``other``'s series, measured on a batch whose row ``b`` is prompt ``offset + b``
    (rows ``rows ..`` of the batch were padding: their per-prompt factors are dropped)."""
    for mine, theirs in ((self.factor, other.factor), (self.overlap, other.overlap)):
      for label, series in theirs.items():
        mine[label] = sorted(mine[label] + series, key=lambda p: p[0])  # by step
    for label, per_row in other.row_factors.items():
      for b, facs in per_row.items():
        if b < rows:
          self.row_factors[label][offset + b].extend(facs)

  def _retro(self, label, step, states):
    (rpos, rexp), (pos, exp) = (tuple(np.asarray(a) for a in pair)
                                for pair in retro.effective_budget(states))
    # pos [L, B, W], exp [L, B, N, W]; the newest position is the largest one in the ring
    newest = pos.max(axis=-1)  # [L, B]
    nom = self.nominal[label]
    facs = []
    for b in range(pos.shape[1]):
      slot = int(np.argmax(pos[0, b]))
      nom[(b, int(newest[0, b]))] = float(exp[:, b, :, slot].mean())
      r = int(rpos[0, b])
      if (b, r) in nom and nom[(b, r)] > 0:
        facs.append(float(rexp[:, b].mean()) / nom.pop((b, r)))
        self.row_factors[label][b].append(facs[-1])
    if facs:
      self.factor[label].append((step, float(np.mean(facs))))


def run(config, workdir: str, mesh=None) -> list[dict]:
  """Runs the long-generation comparison of ``config`` (on ``mesh`` if given).

  ``config.batch_plan`` (``configs/long_generation_gpu.py``): the GPU path (``_planned``):
  each method generates on its own in the batches its memory plan chose, then the methods are
  teacher-forced in lockstep groups beside dense (``planned.lockstep_groups``), each method
  prefilled on its own in chunks, each decode step one device program on a GPU.
  """
  model = modelzoo.load_model(config.model, mesh, config.get("dtype", "")).in_decode_layout()
  writer = results.ResultWriter(workdir, config, EXPERIMENT, keyed=KEYED, ignore=IGNORED)
  entries = specs.expand(config.methods, config.budgets, block_size=config.block_size,
                         model=model)
  if entries[0].label != "dense":
    entries = [specs.Entry("dense", "dense", None,
                           specs.build("dense", block_size=config.block_size))] + [
                               e for e in entries if e.label != "dense"]
  for length in config.get("prompt_lengths", ()) or (config.prompt_length,):
    _run_length(config, model, writer, entries, length, mesh)
    executables.release_if_crowded()
  records = writer.records()
  write_outputs(records, workdir)
  return records


def _run_length(config, model, writer, entries, length: int, mesh) -> None:
  """The comparison at prompts of ``length`` tokens; writes one record per method."""
  key = lambda label: f"{config.model}|{length}|{config.new_tokens}|{label}"
  # Finished rows are never recomputed nor rewritten; dense always runs (the reference).
  entries = [e for e in entries if e.label == "dense" or not writer.done(key(e.label))]
  if all(writer.done(key(e.label)) for e in entries):
    return
  prompts = documents(model, config.text, length, config.num_prompts, config.seed)
  n = config.new_tokens
  # One tick per decode step: n - 1 greedy steps, then n - 1 teacher-forced steps per method.
  progress = cli.Progress(2 * len(entries) * (n - 1), "long_generation")
  if config.get("batch_plan", False):
    gens, forced, probe, extra = _planned(config, model, prompts, entries, progress, mesh)
  else:
    gens, forced, probe = _together(model, prompts, entries, n, progress, mesh)
    extra = {}
  dense = gens["dense"]
  size = config.interval
  for e in (e for e in entries if not writer.done(key(e.label))):
    st, g = forced[e.label], gens[e.label]
    n_int = max(1, st["kl"].shape[1] // size)
    fac = [f for _, f in probe.factor.get(e.label, [])]
    ov = [o for _, o in probe.overlap.get(e.label, [])]
    writer.write(dict(
        model=config.model, method=e.label, spec=e.spec, budget=e.budget,
        prompt_length=int(prompts.shape[1]), new_tokens=n, num_prompts=len(prompts),
        retro_w=e.method.window, interval=size,
        first_divergence=[scoring.first_divergence(a, b) for a, b in zip(dense, g)],
        edit_similarity=[scoring.edit_similarity(a, b) for a, b in zip(dense, g)],
        kl=float(st["kl"].mean()), nll=float(st["nll"].mean()),
        kl_intervals=[float(st["kl"][:, i * size:(i + 1) * size].mean()) for i in range(n_int)],
        agree_intervals=[float(st["agree"][:, i * size:(i + 1) * size].mean())
                         for i in range(n_int)],
        effective_budget_factor=float(np.mean(fac)) if fac else None,
        effective_budget_steps=_thin(probe.factor.get(e.label, [])),
        effective_budget_prompts=[float(np.mean(f)) for _, f in sorted(
            probe.row_factors.get(e.label, {}).items())],
        overlap=float(np.mean(ov)) if ov else None,
        overlap_steps=_thin(probe.overlap.get(e.label, [])),
        sample_text=model.decode(g[0][:80]), **extra.get(e.label, {})), key=key(e.label))


def _together(model, prompts, entries, n, progress, mesh):
  """The CPU path: one shared prefill, each method's greedy run, then every method in one
  lockstep along dense's trajectory -> ``(gens, forced, probe)``."""
  lengths = np.full((len(prompts),), prompts.shape[1], np.int32)
  gens = {}
  ordered = [entries[i] for i in decoding.prefill_order(model, [e.method for e in entries],
                                                         prompts.shape[1] + n, mesh)]
  for e, (m, pre) in zip(ordered, decoding.prefill_all(model, prompts, lengths,
                                                       [e.method for e in ordered],
                                                       prompts.shape[1] + n, mesh=mesh)):
    gens[e.label] = decoding.greedy(model, pre, m, n, stop_at_eos=False,
                                    hook=lambda *_, lab=e.label: progress.update(note=lab))
  trajectory = np.concatenate([prompts, np.asarray(gens["dense"], np.int32)], axis=1)
  probe = StateProbe()

  def hook(label, step, states):
    probe(label, step, states)
    progress.update(note=f"teacher-forced {label}")

  forced = decoding.lockstep(model, trajectory, prompts.shape[1],
                             {e.label: e.method for e in entries}, hook=hook, mesh=mesh)
  return gens, forced, probe


def _planned(config, model, prompts, entries, progress, mesh):
  """The GPU path (``run``) -> ``(gens, forced, probe, extra record fields per label)``."""
  if mesh is not None:
    raise ValueError("batch_plan plans one device's memory; run without --mesh")
  opts = planned.Options.of(config)
  n, (count, plen) = config.new_tokens, prompts.shape
  capacity, items = plen + n, list(range(count))
  gens, extra = {}, {}
  for e in entries:
    m = batch_plan.with_decode_slots(e.method, e.method.round_capacity(capacity), plen)
    plan = opts.plan(model, m, capacity=capacity, longest_prompt=plen, max_batch=count)
    rows = {}

    def generate(batch, plan, m=m, label=e.label):
      pre = planned.prefill(model, prompts[batch], np.full((len(batch),), plen, np.int32), m,
                            m.round_capacity(capacity), prefill_batch=plan.prefill_batch,
                            prefill_chunk=opts.prefill_chunk)
      return decoding.greedy(model, pre, m, n, stop_at_eos=False, fused=opts.fused,
                             hook=lambda *_: progress.update(note=label))

    for ran in planned.each_batch(items, plan, generate, label=f"long_generation {e.label}"):
      rows.update(zip(ran.rows, ran.result))
      extra[e.label] = dict(decode_step=opts.step_name, oom_retries=ran.retries,
                            rows_run=ran.size, **ran.plan.record())
    gens[e.label] = [rows[i] for i in items]
  trajectory = np.concatenate([prompts, np.asarray(gens["dense"], np.int32)], axis=1)
  probe, stats = StateProbe(), {e.label: [] for e in entries}
  groups = planned.lockstep_groups(model, {e.label: e.method for e in entries}, "dense", opts,
                                   capacity=capacity, longest_prompt=plen, max_batch=count)
  for methods, plan in groups:
    for ran in planned.each_batch(items, plan, lambda batch, plan, methods=methods:
                                  _forced(model, trajectory[batch], plen, methods, plan, opts,
                                          progress), label="long_generation forced"):
      part, batch_probe = ran.result
      probe.absorb(batch_probe, offset=ran.rows[0], rows=len(ran.rows))
      for k in methods:
        if k != "dense" or methods is groups[0][0]:
          stats[k].append({name: a[:len(ran.rows)] for name, a in part[k].items()})
      for k in methods:
        extra.setdefault(k, {})["forced_plan_batch"] = ran.plan.batch
  forced = {k: {name: np.concatenate([s[name] for s in parts]) for name in parts[0]}
            for k, parts in stats.items()}
  peak = batch_plan.peak_bytes()
  for k in extra:
    extra[k]["peak_bytes"] = peak
  return gens, forced, probe, extra


def _forced(model, trajectory, plen, methods, plan, opts, progress):
  """One lockstep batch along dense's trajectory -> ``(lockstep's stats, its StateProbe)``."""
  probe = StateProbe()

  def hook(label, step, states):
    probe(label, step, states)
    progress.update(note=f"teacher-forced {label}")

  out = decoding.lockstep(model, trajectory, plen, methods, hook=hook, fused=opts.fused,
                          prefill=planned.prefiller(model, plan, opts))
  return out, probe


def _thin(series, most: int = 256):
  """At most ``most`` evenly spaced ``(step, value)`` points of a per-step series."""
  if len(series) <= most:
    return [list(p) for p in series]
  idx = np.linspace(0, len(series) - 1, most).astype(int)
  return [list(series[i]) for i in idx]


# ---------------------------------------------------------------- rendering


def tables(records) -> list[str]:
  out = []
  groups = collections.defaultdict(list)
  for r in records:
    groups[(r["model"], r["prompt_length"], r["new_tokens"])].append(r)
  for (model, plen, n), sel in sorted(groups.items()):
    sel = sorted(sel, key=lambda r: r["method"] != "dense")
    rows = []
    for r in sel:
      rows.append(dict(
          method=r["method"], first_divergence=float(np.mean(r["first_divergence"])),
          edit_similarity=float(np.mean(r["edit_similarity"])), kl=r["kl"],
          kl_first=r["kl_intervals"][0], kl_last=r["kl_intervals"][-1],
          agree=float(np.mean(r["agree_intervals"])),
          effective_budget=r["effective_budget_factor"] or "", overlap=r["overlap"] or ""))
    title = (f"### Long generation, `{model}`: {sel[0]['num_prompts']} prompts of {plen} tokens, "
             f"{n} greedy tokens\n\nfirst_divergence: tokens equal to dense before the first "
             "difference; edit_similarity: 1 - token edit distance / length (Retro Table 11); "
             f"kl: KL(dense || method) along the dense trajectory (first / last "
             f"{sel[0]['interval']}-token interval); effective_budget: keys a retro query saw "
             "by the time it left the window / its first step's budget (Retro Fig. 2c); "
             "overlap: adjacent queries' shared selected blocks (Retro Fig. 2b).")
    out.append(title + "\n\n" + render.markdown_table(
        rows, ["method", "first_divergence", "edit_similarity", "kl", "kl_first", "kl_last",
               "agree", "effective_budget", "overlap"]))
    size = sel[0]["interval"]
    m = max(len(r["kl_intervals"]) for r in sel)
    krows = [dict(method=r["method"], **{f"kl@{(i + 1) * size}": v
                                         for i, v in enumerate(r["kl_intervals"])}) for r in sel]
    out.append(f"KL(dense || method) per {size}-token interval (`{model}`):\n\n"
               + render.markdown_table(krows, ["method"] + [f"kl@{(i + 1) * size}"
                                                            for i in range(m)]))
  return out


def figures(records, workdir: str) -> list[str]:
  if not records:
    return []
  fig, axes = render.new_figure(ncols=2)
  ax = axes[0][0]
  for r in records:
    xs = [(i + 1) * r["interval"] for i in range(len(r["kl_intervals"]))]
    ax.plot(xs, r["kl_intervals"], marker="o", label=f"{r['method']} ({r['model'][:12]})")
  ax.set_xlabel("generated tokens")
  ax.set_ylabel("KL(dense || method)")
  ax.legend(fontsize=6)
  ax = axes[0][1]
  for r in records:
    pts = r.get("effective_budget_steps") or []
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r["method"])
  ax.set_xlabel("decode step")
  ax.set_ylabel("effective budget / nominal")
  ax.legend(fontsize=6)
  return [render.save_figure(fig, workdir, "long_generation.png")]


def write_outputs(records, workdir: str) -> str:
  sections = tables(records) + [f"![{os.path.basename(p)}]({os.path.basename(p)})"
                                for p in figures(records, workdir)]
  return render.write_markdown(workdir, "long_generation.md", "Long generation fidelity",
                               sections)
