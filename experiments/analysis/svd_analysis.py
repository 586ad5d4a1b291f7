"""``experiments.svd_analysis``: measure (JSON lines) and render (Fig. 2, 4, 5b, 6b + markdown).

Records (``kind``), one per layer and context length unless noted, arrays over heads:
  * ``spectrum``: ``s [H, r]`` singular values, ``share``, ``energy``, ``cosine``, ``key_cosine``,
    ``mean_query_energy`` ``[H]``;
  * ``dense_check``: explicit float32 ``svdvals`` of the ``S x S`` matrices of some heads vs the
    factored values (``max_rel_diff`` over the top ``r``; ``tail`` = ``s_{r+1} / s_1``);
  * ``concentration`` (Fig. 4a), ``channels`` (Fig. 5b, per layer), ``delta`` (Fig. 6b).
"""

from __future__ import annotations

import time

import numpy as np

from experiments.common import capture as capture_lib
from experiments.analysis import svd
from experiments.common import cli, modelzoo, render
from experiments.common.results import ResultWriter

NAME = "svd_analysis"
KEYED = ("lengths", "layers")  # in every record's key
PAPER = dict(share="40-50%", cosine="~1")


def _layers(config, num_layers):
  return list(config.layers) if len(config.layers) else list(range(num_layers))


def _todo(writer, config, layers):
  keys = [f"spectrum/{l}/{s}" for l in layers for s in config.lengths]
  keys += [f"dense_check/{s}/{l}" for s, stride, _ in config.dense_check
           for l in layers[::stride]]
  keys += [f"{k}/{l}" for l in layers for k in ("concentration", "channels", "delta")]
  return [k for k in keys if not writer.done(k)]


def run(config, workdir: str) -> list[dict]:
  """Measures everything not yet in ``workdir/results.jsonl``, then renders."""
  writer = ResultWriter(workdir, config, NAME, keyed=KEYED)
  model = modelzoo.load_model(config.model)
  layers = _layers(config, model.config.num_layers)
  todo = set(_todo(writer, config, layers))
  if todo:
    n = max(max(config.lengths), config.concentration_len,
            config.delta_prefix + config.delta_steps)
    tokens = capture_lib.text_tokens(model, config.text, n, config.skip_chars)
    chunks = -(-n // config.chunk)
    cap = capture_lib.capture(model, tokens, config.chunk, cli.Progress(chunks, "capture"))
    _measure(config, writer, cap, layers, todo)
  return render_all(writer.records(), workdir)


def _measure(config, writer, cap, layers, todo):
  prog = cli.Progress(len(todo), "svd")
  scale = cap.scale
  for l in layers:
    for s in config.lengths:
      key = f"spectrum/{l}/{s}"
      if key in todo:
        q, k = cap.q[l, :, :s], cap.keys_per_query_head(l, s)
        sv, u1, v1 = svd.factored_svd(q, k, scale)
        al = svd.mean_query_alignment(q, k, scale, sv, u1, v1)
        writer.write(dict(kind="spectrum", layer=l, length=s, s=sv.astype(np.float32),
                          share=svd.principal_share(sv), energy=svd.energy_share(sv), **al),
                     key=key)
        prog.update()
    for name, fn in (("concentration", _concentration), ("channels", _channels),
                     ("delta", _delta)):
      if f"{name}/{l}" in todo:
        writer.write(dict(kind=name, layer=l, **fn(config, cap, l)), key=f"{name}/{l}")
        prog.update()
  for s, stride, heads in config.dense_check:
    for l in layers[::stride]:
      key = f"dense_check/{s}/{l}"
      if key in todo:
        writer.write(_dense_check(cap, l, s, heads), key=key)
        prog.update()


def _dense_check(cap, layer, length, heads):
  q, k = cap.q[layer, :heads, :length], cap.keys_per_query_head(layer, length)[:heads]
  t0 = time.perf_counter()
  dense = svd.dense_singular_values(q, k, cap.scale)
  secs = time.perf_counter() - t0
  fact, _, _ = svd.factored_svd(q, k, cap.scale)
  r = fact.shape[-1]
  diff = np.abs(dense[:, :r] - fact) / np.maximum(fact[:, :1], 1e-30)
  tail = dense[:, r] / np.maximum(dense[:, 0], 1e-30) if dense.shape[1] > r else np.zeros(heads)
  return dict(kind="dense_check", layer=layer, length=length, heads=heads,
              max_rel_diff=float(diff.max()), tail=float(np.max(tail)), seconds=secs,
              dense_share=svd.principal_share(dense), factored_share=svd.principal_share(fact))


def _concentration(config, cap, layer):
  s = config.concentration_len
  bins = np.linspace(-config.hist_range, config.hist_range, config.hist_bins)
  out = svd.key_concentration(cap.q[layer, :, :s], cap.keys_per_query_head(layer, s), cap.scale,
                              bins)
  return dict(length=s, bins=bins, **out)


def _channels(config, cap, layer):
  s = max(config.lengths)
  return dict(length=s, q=svd.channel_profile(cap.q[layer, :, :s]),
              k=svd.channel_profile(cap.k[layer, :, :s]),
              freq=svd.frequency_rank(cap.q.shape[-1]))


def _delta(config, cap, layer):
  n = config.delta_prefix + config.delta_steps
  out = svd.delta_autocorrelation(cap.q[layer, :, :n], cap.keys_per_query_head(layer, n),
                                  cap.scale, config.delta_prefix, config.delta_steps,
                                  config.max_lag)
  acf = svd.delta_token_acf(cap.q[layer, :, :n], cap.keys_per_query_head(layer, n), cap.scale,
                            config.delta_prefix, config.delta_steps, config.max_lag)
  return dict(prefix=config.delta_prefix, steps=config.delta_steps, **out, **acf)


# ---------------------------------------------------------------- rendering


def _by(records, kind):
  return [r for r in records if r.get("kind") == kind]


def summary(records) -> dict:
  """Headline numbers (also the markdown table)."""
  spec = _by(records, "spectrum")
  out = {}
  lengths = sorted({r["length"] for r in spec})
  for s in lengths:
    rs = [r for r in spec if r["length"] == s]
    share = np.concatenate([r["share"] for r in rs])
    cos = np.concatenate([r["cosine"] for r in rs])
    out[s] = dict(length=s, heads=len(share), share_mean=float(share.mean()),
                  share_median=float(np.median(share)),
                  energy_mean=float(np.mean(np.concatenate([r["energy"] for r in rs]))),
                  cosine_mean=float(cos.mean()), abs_cosine_median=float(np.median(np.abs(cos))),
                  mean_query_energy=float(np.mean(np.concatenate(
                      [r["mean_query_energy"] for r in rs]))))
    if "row_cosine" in rs[0]:  # the paper's row-wise statistic (older records lack it)
      row = np.concatenate([r["row_cosine"] for r in rs])
      out[s].update(row_cosine_mean=float(row.mean()), row_cosine_median=float(np.median(row)))
  return out


def sigma1_fits(records):
  """Per (layer, head): lengths, sigma_1 values and the linear fit ``(slope, intercept, r2)``."""
  spec = _by(records, "spectrum")
  lengths = sorted({r["length"] for r in spec})
  fits = {}
  for l in sorted({r["layer"] for r in spec}):
    by_len = {r["length"]: np.asarray(r["s"])[:, 0] for r in spec if r["layer"] == l}
    if len(by_len) < 3 or any(s not in by_len for s in lengths):
      continue
    y = np.stack([by_len[s] for s in lengths], -1)  # [H, P]
    fits[l] = (np.asarray(lengths, np.float64), y, *svd.linear_fit(lengths, y))
  return fits


def render_all(records, workdir: str) -> list[dict]:
  """Writes the figures and ``svd_analysis.md``; returns the summary rows."""
  spec = _by(records, "spectrum")
  if not spec:
    return []
  rows = list(summary(records).values())
  fits = sigma1_fits(records)
  r2 = np.concatenate([f[4] for f in fits.values()]) if fits else np.zeros(0)
  _fig2a(spec, workdir)
  _fig2b(spec, workdir)
  if fits:
    _fig2c(fits, workdir)
  conc, chans, delta = (_by(records, k) for k in ("concentration", "channels", "delta"))
  if conc:
    _fig4a(conc, workdir)
  _fig4b(spec, workdir)
  if chans:
    _fig5b(chans, workdir)
  if delta:
    _fig6b(delta, workdir)
  sections = [
      "Singular values of `M = Q K^T / sqrt(d)` per layer and head (exact, factored: rank <= D). "
      f"Paper: principal share {PAPER['share']}, Fig. 4b cosine {PAPER['cosine']}.",
      render.markdown_table(rows, ["length", "heads", "share_mean", "share_median", "energy_mean"]
                            + (["row_cosine_mean", "row_cosine_median"]
                               if rows and "row_cosine_mean" in rows[0] else [])
                            + ["cosine_mean", "abs_cosine_median", "mean_query_energy"])]
  if len(r2):
    sections.append(
        f"sigma_1 vs context length, linear fit per head over {len(next(iter(fits.values()))[0])}"
        f" lengths: R^2 median {np.median(r2):.4f}, mean {r2.mean():.4f}, "
        f"min {r2.min():.4f}, share of heads with R^2 > 0.9: {np.mean(r2 > 0.9):.3f}")
  if conc:
    ex = np.concatenate([r["explained"] for r in conc])
    sections.append(f"Fig. 4a: per-key means explain {ex.mean():.3f} of the causal logit variance "
                    f"(median over heads {np.median(ex):.3f}) at length {conc[0]['length']}.")
  if chans:
    sections.append(_channel_text(chans))
  if delta:
    ac = np.stack([np.asarray(r["autocorr"]).mean(0) for r in delta])  # [L, lag]
    base = np.mean([np.mean(r["baseline"]) for r in delta])
    rel = np.mean([np.mean(r["relative"]) for r in delta])
    sections.append(f"Fig. 6b: delta autocorrelation lag 1 {ac[:, 0].mean():.3f}, lag "
                    f"{ac.shape[1]} {ac[:, -1].mean():.3f}, all-pairs baseline {base:.3f}; "
                    f"||delta|| / ||q K_c^T|| = {rel:.3f}.")
    if "acf" in delta[0]:
      acf = np.stack([np.asarray(r["acf"]).mean(0) for r in delta])  # [L, lag]
      sig = np.mean([np.asarray(r["acf_significant"])[:, 0].mean() for r in delta])
      sections.append(f"Fig. 6b (paper's per-key ACF over steps): lag 1 {acf[:, 0].mean():.3f}, "
                      f"lag {acf.shape[1]} {acf[:, -1].mean():.3f}; 95% white-noise band "
                      f"+-{delta[0]['acf_ci95']:.3f}, keys outside it at lag 1: {sig:.2f}.")
  checks = _by(records, "dense_check")
  if checks:
    sections.append("Dense check (float32 `jnp.linalg.svd` of the S x S matrix vs factored):\n\n"
                    + render.markdown_table(checks, ["length", "layer", "heads", "max_rel_diff",
                                                     "tail", "seconds"]))
  render.write_markdown(workdir, f"{NAME}.md", "SVD of attention logits (RESA Sec. 3.2)",
                        sections)
  return rows


def _channel_text(chans):
  q = np.mean([np.asarray(r["q"]).mean(0) for r in chans], 0)
  k = np.mean([np.asarray(r["k"]).mean(0) for r in chans], 0)
  f = np.asarray(chans[0]["freq"])
  quarter = (f.max() + 1) // 4
  hi, lo = f < quarter, f >= f.max() + 1 - quarter
  return (f"Fig. 5b: |mean|/rms per channel, fastest RoPE quarter vs slowest quarter: "
          f"q {q[hi].mean():.3f} vs {q[lo].mean():.3f}, k {k[hi].mean():.3f} vs "
          f"{k[lo].mean():.3f}.")


def _fig2a(spec, workdir):
  fig, ax = render.new_figure()
  for s in sorted({r["length"] for r in spec}):
    cum = np.concatenate([svd.cumulative_ratio(np.asarray(r["s"])) for r in spec
                          if r["length"] == s])
    ax[0, 0].plot(np.arange(1, cum.shape[1] + 1), cum.mean(0), label=f"S={s}")
  ax[0, 0].set(xlabel="singular value index", ylabel="cumulative ratio (mean over heads)",
               title="Fig. 2a: cumulative singular value ratio", xscale="log")
  ax[0, 0].legend(fontsize=7)
  render.save_figure(fig, workdir, "fig2a_cumulative_ratio.png")


def _layer_head_heatmap(spec, field, title, vmin, cmap, name, workdir):
  """A [layer, head] heatmap of ``field`` at the longest length (Fig. 2b, Fig. 4b)."""
  s = max(r["length"] for r in spec)
  rs = sorted((r for r in spec if r["length"] == s), key=lambda r: r["layer"])
  grid = np.stack([r[field] for r in rs])
  fig, ax = render.new_figure(size=(4.5, 5.0))
  im = ax[0, 0].imshow(grid, aspect="auto", vmin=vmin, vmax=1, cmap=cmap)
  ax[0, 0].set(xlabel="head", ylabel="layer", title=title.format(s=s),
               yticks=range(len(rs)), yticklabels=[r["layer"] for r in rs])
  ax[0, 0].tick_params(axis="y", labelsize=6)
  fig.colorbar(im, ax=ax[0, 0])
  render.save_figure(fig, workdir, name)


def _fig2b(spec, workdir):
  _layer_head_heatmap(spec, "share", "Fig. 2b: sigma_1 share (S={s})", 0, "viridis",
                      "fig2b_principal_share_heatmap.png", workdir)


def _fig2c(fits, workdir):
  fig, ax = render.new_figure(2)
  layers = sorted(fits)
  for l in layers[::max(1, len(layers) // 4)][:4]:
    x, y, slope, icpt, r2 = fits[l]
    (line,) = ax[0, 0].plot(x, slope[0] * x + icpt[0], "-", label=f"L{l} h0 R^2={r2[0]:.3f}")
    ax[0, 0].plot(x, y[0], "o", ms=3, color=line.get_color())
  ax[0, 0].set(xlabel="context length", ylabel="sigma_1", title="Fig. 2c: sigma_1 vs length")
  ax[0, 0].legend(fontsize=7)
  allr2 = np.concatenate([fits[l][4] for l in layers])
  ax[0, 1].hist(allr2, bins=30)
  ax[0, 1].set(xlabel="R^2 of the linear fit", ylabel="heads", title="linearity over all heads")
  render.save_figure(fig, workdir, "fig2c_sigma1_vs_length.png")


def _fig4a(conc, workdir):
  fig, ax = render.new_figure(2)
  mid = sorted(conc, key=lambda r: r["layer"])[len(conc) // 2]
  bins = np.asarray(mid["bins"])
  ctr = 0.5 * (bins[1:] + bins[:-1])
  ax[0, 0].plot(ctr, np.asarray(mid["hist_key"]).sum(0), label="M_ij - mean_j (per key)")
  ax[0, 0].plot(ctr, np.asarray(mid["hist_all"]).sum(0), label="M_ij - mean (all)")
  ax[0, 0].set(xlabel="logit deviation", ylabel="count", yscale="log",
               title=f"Fig. 4a: historical logits, layer {mid['layer']}")
  ax[0, 0].legend(fontsize=7)
  conc = sorted(conc, key=lambda r: r["layer"])
  ax[0, 1].plot([r["layer"] for r in conc], [np.mean(r["explained"]) for r in conc], "o-")
  ax[0, 1].set(xlabel="layer", ylabel="variance explained by key means", ylim=(0, 1))
  render.save_figure(fig, workdir, "fig4a_key_concentration.png")


def _fig4b(spec, workdir):
  _layer_head_heatmap(spec, "cosine", "Fig. 4b: cos(s1 u1 v1^T, 1 mu_Q K^T), S={s}", -1, "RdBu",
                      "fig4b_rank1_cosine.png", workdir)


def _fig5b(chans, workdir):
  fig, ax = render.new_figure(2)
  f = np.asarray(chans[0]["freq"])
  for i, name in enumerate(("q", "k")):
    prof = np.mean([np.asarray(r[name]).mean(0) for r in chans], 0)  # [D]
    order = np.argsort(f, kind="stable")
    ax[0, i].plot(np.arange(len(f)), prof[order], ".")
    ax[0, i].set(xlabel="channel (sorted by RoPE frequency, fast -> slow)",
                 ylabel=f"|mean {name}| / rms {name}", ylim=(0, 1),
                 title=f"Fig. 5b: mu_{name.upper()} channel profile")
  render.save_figure(fig, workdir, "fig5b_channel_profile.png")


def _fig6b(delta, workdir):
  fig, ax = render.new_figure()
  delta = sorted(delta, key=lambda r: r["layer"])
  if "acf" in delta[0]:  # the paper's per-key ACF with the white-noise 95% band
    acf = np.mean([np.asarray(r["acf"]).mean(0) for r in delta], 0)
    lags = np.arange(1, len(acf) + 1)
    ax[0, 0].bar(lags, acf, color="tab:blue", label="ACF of delta_i[j] (mean over keys, heads)")
    ci = delta[0]["acf_ci95"]
    ax[0, 0].fill_between([0.5, len(acf) + 0.5], -ci, ci, color="tab:blue", alpha=0.15,
                          label="95% band (white noise)")
  for r in delta[::max(1, len(delta) // 5)]:
    ac = np.asarray(r["autocorr"]).mean(0)
    ax[0, 0].plot(np.arange(1, len(ac) + 1), ac, lw=0.8, label=f"vector corr, layer {r['layer']}")
  ax[0, 0].set(xlabel="lag (decode steps)", ylabel="autocorrelation",
               title="Fig. 6b: autocorrelation of RESA's estimation error")
  ax[0, 0].legend(fontsize=7)
  render.save_figure(fig, workdir, "fig6b_delta_autocorrelation.png")
