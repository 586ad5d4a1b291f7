"""``experiments.resa_calibrate``: fit, save (orbax), evaluate on held-out text.

Records: ``fit`` per variant (loss curve ends, fitted parameter stats, orbax path), ``error``
per arm on the held-out text (relative L2 output error, oracle inputs), ``nll`` per arm
(held-out teacher-forced NLL). Arms: ``lam=0`` (selector alone), ``lam=1`` (RESA default),
``best global`` (single lambda chosen on the calibration text), and each fitted variant.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from experiments.analysis import calibrate, errors, quality
from experiments.common import capture as capture_lib
from experiments.common import checkpoint, cli, modelzoo, render
from experiments.common.results import ResultWriter
from sparse_attn import methods

NAME = "resa_calibrate"


def _parts(model, method, config, text, skip=0):
  n = config.prefill_len + config.steps
  toks = capture_lib.text_tokens(model, text, n, skip)
  cap = capture_lib.capture(model, toks, config.chunk)
  res = errors.simulate(method, cap.q, cap.k, cap.v, cap.scale, config.prefill_len,
                        config.steps, chunk=config.chunk, residual=True)
  return {k: res[k] for k in errors.RESIDUAL}


def run(config, workdir: str) -> list[dict]:
  writer = ResultWriter(workdir, config, NAME)
  model = modelzoo.load_model(config.model)
  method = methods.make(config.method, budget=config.budget, block_size=config.block_size)
  nl, nh = model.config.num_layers, model.config.num_heads
  zeros, ones = np.zeros((nl, nh), np.float32), np.ones((nl, nh), np.float32)
  arms = {}
  need_parts = any(not writer.done(k) for k in
                   [f"fit/{v}" for v in config.variants] + ["error/all"])
  calib = _parts(model, method, config, config.calib_text) if need_parts else None
  lam_best, _ = (calibrate.best_global_lambda(calib, config.lam_grid) if calib is not None
                 else (_record(writer, "fit/global")["lam"], None))
  if not writer.done("fit/global"):
    writer.write(dict(kind="fit", variant="global", lam=lam_best), key="fit/global")
  arms["lam=0"] = (np.full((nl, nh), -1e30, np.float32), ones)
  arms["lam=1"] = (zeros, ones)
  arms[f"global lam={lam_best:g}"] = (np.full((nl, nh), np.log(max(lam_best, 1e-30)),
                                              np.float32), ones)
  for v in config.variants:
    path = os.path.join(os.path.abspath(workdir), f"calibration_{v.replace('+', '_')}")
    if not writer.done(f"fit/{v}"):
      params, curve = calibrate.fit(calib, fit_beta="beta" in v, steps=config.opt_steps,
                                    learning_rate=config.learning_rate,
                                    progress=cli.Progress(config.opt_steps, f"fit {v}"))
      checkpoint.save_arrays(path, params)
      lam = np.exp(params["log_lam"])
      writer.write(dict(kind="fit", variant=v, path=path, loss_first=curve[0],
                        loss_last=curve[-1], lam=lam, beta=params["beta"],
                        lam_median=float(np.median(lam))), key=f"fit/{v}")
    params = checkpoint.restore_arrays(path)
    arms[v] = (params["log_lam"], params["beta"])
  if not writer.done("error/all"):
    held = _parts(model, method, config, config.heldout_text)
    errs = {a: calibrate.per_layer_error(held, ll, b) for a, (ll, b) in arms.items()}
    writer.write(dict(kind="error", text=config.heldout_text,
                      per_arm={a: float(e.mean()) for a, e in errs.items()},
                      per_layer={a: e for a, e in errs.items()}), key="error/all")
  if config.nll_samples:
    _nll(config, writer, model, method, arms)
  return render_all(writer.records(), workdir)


def _record(writer, key):
  return next(r for r in writer.records() if r.get("key") == key)


def _nll(config, writer, model, method, arms):
  items = []
  for i in range(config.nll_samples):
    toks = capture_lib.text_tokens(model, config.heldout_text,
                                   config.prefill_len + config.nll_cont, 20_000 + 60_000 * i)
    items.append(quality.Sample(toks, config.prefill_len, config.prefill_len))
  todo = [a for a in ["dense", *arms] if not writer.done(f"nll/{a}")]
  prog = cli.Progress(len(todo) * len(items), "nll", every=10.0)
  for arm in todo:
    if arm == "dense":
      res = quality.nll(model, methods.make("dense", block_size=config.block_size), items, prog)
    else:
      ll, b = arms[arm]
      fn = functools.partial(_forced, log_lam=ll, beta=b)
      res = quality.nll(model, method, items, prog, forced=fn)
    writer.write(dict(kind="nll", arm=arm, **res), key=f"nll/{arm}")


def _forced(model, tokens, prefill_len, method, *, log_lam, beta, capacity=None):
  return calibrate.teacher_forced(model, tokens, prefill_len, method, log_lam, beta,
                                  capacity=capacity)


def render_all(records, workdir: str) -> list[dict]:
  err = next((r for r in records if r.get("kind") == "error"), None)
  nll = {r["arm"]: r["nll"] for r in records if r.get("kind") == "nll"}
  rows = []
  if err is not None:
    for arm, e in err["per_arm"].items():
      row = dict(arm=arm, heldout_out_rel_l2=e,
                 vs_lam1=1.0 - e / err["per_arm"]["lam=1"], nll=nll.get(arm, float("nan")))
      if "dense" in nll and arm in nll:
        row["quality"] = quality.relative_quality(nll[arm], nll["dense"])
      rows.append(row)
  fits = [r for r in records if r.get("kind") == "fit" and "beta" in r]
  for f in fits:
    lam = np.asarray(f["lam"])
    fig, ax = render.new_figure(2, size=(4.0, 5.0))
    im = ax[0, 0].imshow(np.log2(lam), aspect="auto", cmap="RdBu_r", vmin=-3, vmax=3)
    ax[0, 0].set(xlabel="head", ylabel="layer", title=f"log2 lambda ({f['variant']})")
    fig.colorbar(im, ax=ax[0, 0])
    im = ax[0, 1].imshow(np.asarray(f["beta"]), aspect="auto", cmap="viridis")
    ax[0, 1].set(xlabel="head", ylabel="layer", title="beta (bias slope)")
    fig.colorbar(im, ax=ax[0, 1])
    render.save_figure(fig, workdir, f"calib_params_{f['variant'].replace('+', '_')}.png")
  if rows:
    cfg = records[0]["config"]
    render.write_markdown(workdir, f"{NAME}.md", "Per-head RESA lambda calibration", [
        f"Model {cfg['model']}, {cfg['method']} @ {cfg['budget']:g}; fitted on "
        f"{cfg['calib_text']} ({cfg['prefill_len']}-token prompt, {cfg['steps']} steps, oracle "
        f"inputs), evaluated on {cfg['heldout_text']}. `vs_lam1` = output-error reduction vs "
        "lambda = 1; `quality` = exp(-(NLL - NLL_dense)) on held-out windows.",
        render.markdown_table(rows, ["arm", "heldout_out_rel_l2", "vs_lam1", "nll", "quality"])])
  return rows
