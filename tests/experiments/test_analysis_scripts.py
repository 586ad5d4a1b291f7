"""Each analysis experiment in ``--config.quick=True`` mode (tiny random model): outputs exist,
numbers are finite and in range. ``svd_analysis`` runs as a real subprocess (flag parsing);
the others call their ``run`` in-process to share one JAX start-up."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import attention_error as ae_config
from configs import resa_calibrate as rc_config
from experiments import report
from experiments.analysis import attention_error, resa_calibrate
from experiments.common import results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quick(mod):
  return mod.get_config(quick=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  """One results root for every analysis run, so the report test renders them all."""
  return tmp_path_factory.mktemp("analysis")


def _records(workdir):
  return results.read_records(os.path.join(workdir, results.RESULTS_FILE))


def test_svd_analysis_script(root):
  tmp_path = root / "svd_analysis"
  out = subprocess.run([sys.executable, "-m", "experiments.svd_analysis", "--config.quick=True",
                        f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  for name in ("fig2a_cumulative_ratio", "fig2b_principal_share_heatmap",
               "fig2c_sigma1_vs_length", "fig4a_key_concentration", "fig4b_rank1_cosine",
               "fig5b_channel_profile", "fig6b_delta_autocorrelation"):
    assert (tmp_path / f"{name}.png").stat().st_size > 0, name
  assert (tmp_path / "svd_analysis.md").exists()
  recs = _records(str(tmp_path))
  spec = [r for r in recs if r["kind"] == "spectrum"]
  assert len(spec) == 2 * 3  # tiny-random: 2 layers x 3 lengths
  for r in spec:
    s = np.asarray(r["s"])
    assert np.all(np.isfinite(s)) and np.all(np.diff(s, axis=-1) <= 1e-6 * s[:, :1])
    cum = np.cumsum(s, -1) / s.sum(-1, keepdims=True)
    assert np.all(np.diff(cum, axis=-1) >= 0)
    for name in ("share", "energy", "mean_query_energy"):
      x = np.asarray(r[name])
      assert np.all((x >= 0) & (x <= 1 + 1e-9)), name
    assert np.all(np.abs(r["cosine"]) <= 1 + 1e-9)
  for r in (r for r in recs if r["kind"] == "dense_check"):
    assert r["max_rel_diff"] < 1e-3
  for r in (r for r in recs if r["kind"] == "concentration"):
    assert np.all((np.asarray(r["explained"]) >= -1e-6) & (np.asarray(r["explained"]) <= 1))
  for r in (r for r in recs if r["kind"] == "delta"):
    assert np.all(np.abs(np.asarray(r["autocorr"])) <= 1 + 1e-9)


def test_attention_error_quick(root):
  tmp_path = root / "attention_error"
  red = attention_error.run(_quick(ae_config), str(tmp_path))
  assert (tmp_path / "attention_error.md").exists()
  assert (tmp_path / "fig6a_error_reduction.png").exists()
  assert (tmp_path / "fig6a_score_error_quest_0.1.png").exists()
  recs = {r["spec"]: r for r in _records(str(tmp_path))}
  base, zero = recs["quest"], recs["quest+resa:lam=0.0"]
  for name in ("score_l1", "out_rel_l2", "attended"):
    np.testing.assert_allclose(zero[name], base[name], rtol=1e-5, atol=1e-6)  # lam=0 == selector
  for r in recs.values():
    assert np.all(np.isfinite(r["out_rel_l2"]))
    if r["retro_w"] == 1:
      assert np.all((np.asarray(r["score_l1"]) >= 0) & (np.asarray(r["score_l1"]) <= 2))
  assert np.all(np.isfinite(recs["quest+retro:w=2"]["out_rel_l2_retired"]))
  resa = next(r for r in red if r["resa"].startswith("quest+resa:lam=1"))
  assert resa["score_l1_reduction"] > 0


def test_resa_calibrate_quick(root):
  tmp_path = root / "resa_calibrate"
  rows = resa_calibrate.run(_quick(rc_config), str(tmp_path))
  assert (tmp_path / "calibration_lambda_beta").is_dir()
  assert (tmp_path / "resa_calibrate.md").exists()
  arms = {r["arm"]: r for r in rows}
  assert {"lam=0", "lam=1", "lambda+beta"} <= set(arms)
  for r in rows:
    assert np.isfinite(r["heldout_out_rel_l2"]) and np.isfinite(r["nll"])
  json.dumps(rows)  # JSON-able summary


def test_rerun_with_another_model_is_refused(root):
  wd = str(root / "attention_error")
  before = len(_records(wd))
  cfg = _quick(ae_config)
  with cfg.unlocked():
    cfg.model = "smollm2-135m-instruct"
  with pytest.raises(results.ConfigMismatch, match="model: 'tiny-random' in the workdir"):
    attention_error.run(cfg, wd)
  assert len(_records(wd)) == before


def test_report_renders_every_analysis_experiment(root):
  path = report.build(str(root), str(root / "report"))
  md = open(path, encoding="utf-8").read()
  present = {r["experiment"] for p in results.find_results(str(root))
             for r in results.read_records(p)}
  assert {"svd_analysis", "attention_error", "resa_calibrate"} <= present  # lambda: tasks tests
  for exp in present:
    assert f"(`{exp}/results.jsonl`)" in md, exp
    assert os.listdir(root / "report" / "figures" / exp), exp
  assert "no renderer" not in md and "fig6a_error_reduction.png" in md
