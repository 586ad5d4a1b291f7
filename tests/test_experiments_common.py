"""Experiment plumbing: JSONL append/resume under one config, quick precedence, progress lines,
data files present, markdown rendering."""

import io
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from experiments.common import cli, data, quick, render, results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_results_append_resume_and_truncated_line(tmp_path):
  cfg = {"model": "tiny", "budgets": [0.1, 0.2]}
  w = results.ResultWriter(str(tmp_path), cfg, "demo")
  w.write({"nll": 1.5}, key="a")
  assert w.done("a") and not w.done("b")
  with open(w.path, "a") as f:
    f.write('{"experiment": "demo", "key": "b", "nl')  # a run killed mid-write
  w2 = results.ResultWriter(str(tmp_path), cfg, "demo")
  assert w2.done("a") and not w2.done("b")
  rec = w2.write({"nll": float("inf")}, key="b")
  assert rec["config"] == {"model": "tiny", "budgets": [0.1, 0.2]} and rec["git"]
  assert [r["key"] for r in w2.records()] == ["a", "b"]
  assert json.loads(open(w.path).read().splitlines()[-1])["nll"] == "inf"


def test_vendored_data_is_real_text():
  assert "Elizabeth" in data.austen("prideprejudice")
  assert len(data.long_text("austen")) > 3_000_000
  qa = data.squad()
  assert len(qa) > 10_000 and all(a in qa[0]["context"] for a in qa[0]["answers"])
  assert "startup" in data.paul_graham_essays().lower()


def test_markdown_table():
  md = render.markdown_table([{"a": 1, "b": 0.123456}], ["a", "b"])
  assert md.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.1235 |"]


# ------------------------------------------------------------ trusted resumption


def _config(**overrides):
  cfg = {"model": "tiny", "budgets": [0.1], "steps": 4, "quick": False, "batch_size": 2}
  cfg.update(overrides)
  return cfg


def test_workdir_of_another_config_is_refused_naming_the_fields(tmp_path):
  w = results.ResultWriter(str(tmp_path), _config(), "demo", keyed=("budgets",))
  w.write({"nll": 1.0}, key="quest@0.1")
  with pytest.raises(results.ConfigMismatch, match=r"steps: 4 in the workdir, 8 now") as e:
    results.ResultWriter(str(tmp_path), _config(steps=8, model="other"), "demo",
                         keyed=("budgets",))
  assert "model: 'tiny' in the workdir, 'other' now" in str(e.value)
  assert "budgets" not in str(e.value)
  # Other experiments in the same file and fields that change no result do not count.
  results.ResultWriter(str(tmp_path), _config(steps=8), "other_experiment")
  same = results.ResultWriter(str(tmp_path), _config(quick=True, batch_size=8), "demo",
                              keyed=("budgets",))
  assert same.done("quest@0.1")
  # A keyed field (part of every key) extends the sweep: finished rows stay done.
  wider = results.ResultWriter(str(tmp_path), _config(budgets=[0.1, 0.2]), "demo",
                               keyed=("budgets",))
  assert wider.done("quest@0.1") and not wider.done("quest@0.2")


def test_records_without_fingerprint_are_checked_from_their_config(tmp_path):
  legacy = {"experiment": "demo", "config": _config(steps=2), "key": "a", "nll": 1.0}
  (tmp_path / results.RESULTS_FILE).write_text(json.dumps(legacy) + "\n")
  with pytest.raises(results.ConfigMismatch, match="steps: 2 in the workdir, 4 now"):
    results.ResultWriter(str(tmp_path), _config(), "demo")
  assert results.ResultWriter(str(tmp_path), _config(steps=2), "demo").done("a")


def test_finished_rows_are_never_written_twice(tmp_path):
  w = results.ResultWriter(str(tmp_path), _config(), "demo")
  assert w.write({"nll": 1.0}, key="a") is not None
  assert w.write({"nll": 2.0}, key="a") is None
  again = results.ResultWriter(str(tmp_path), _config(), "demo")
  assert again.write({"nll": 3.0}, key="a") is None
  assert [r["nll"] for r in again.records()] == [1.0]
  assert again.records()[0]["fingerprint"] == again.fingerprint


def test_run_config_is_stored_once_and_given_back_to_every_record(tmp_path):
  w = results.ResultWriter(str(tmp_path), _config(), "demo")
  for k in "abc":
    w.write({"nll": 1.0}, key=k)
  other = results.ResultWriter(str(tmp_path), _config(batch_size=8), "demo")  # same fingerprint
  other.write({"nll": 2.0}, key="d")
  stored = [json.loads(line) for line in open(w.path)]
  assert ["config" in r for r in stored] == [True, False, False, True]
  assert len({r["run"] for r in stored}) == 2
  recs = results.read_records(w.path)
  assert [r["config"]["batch_size"] for r in recs] == [_config()["batch_size"]] * 3 + [8]
  assert all(r["machine"] == recs[0]["machine"] for r in recs)
  # Compacting a file of full records (as written before run headers) keeps every record whole,
  # and a reordered subset still finds its header.
  legacy = [dict(r) for r in recs]
  for r in legacy:
    del r["run"]
  results.write_records(w.path, legacy)
  assert results.read_records(w.path) == [dict(r, run=s["run"]) for r, s in zip(legacy, stored)]
  assert sum("config" in json.loads(line) for line in open(w.path)) == 2
  results.write_records(w.path, results.read_records(w.path)[::-1][:2])
  assert [r["key"] for r in results.read_records(w.path)] == ["d", "c"]
  assert results.read_records(w.path)[1]["config"] == recs[2]["config"]


def test_merge_adds_only_new_rows_of_the_same_config(tmp_path):
  def run(name, cfg, keys):
    w = results.ResultWriter(str(tmp_path / name), cfg, "demo", keyed=("budgets",))
    for k in keys:
      w.write({"nll": float(len(k))}, key=k)
    return w.records()

  target = run("target", _config(), ["a", "b"])
  parallel = run("parallel", _config(budgets=[0.2]), ["b", "c"])  # another sweep axis value
  again = run("again", _config(), ["c", "d"])
  merged, added = results.merge_records(target, {"parallel": parallel, "again": again})
  assert [r["key"] for r in merged] == ["a", "b", "c", "d"]
  assert added == {"parallel": 1, "again": 1}
  assert results.merge_records(merged, {"again": again})[1] == {"again": 0}
  other = run("other", _config(steps=8), ["e"])
  with pytest.raises(results.ConfigMismatch, match="other holds demo records"):
    results.merge_records(target, {"other": other})


def test_merge_cli_rewrites_the_target_and_refuses_another_config(tmp_path):
  for name, cfg, keys in [("into", _config(), "ab"), ("src", _config(), "bc"),
                          ("bad", _config(steps=8), "e")]:
    w = results.ResultWriter(str(tmp_path / name), cfg, "demo")
    for k in keys:
      w.write({"nll": 1.0}, key=k)
  cmd = [sys.executable, "-m", "experiments.merge", f"--into={tmp_path / 'into'}"]
  ok = subprocess.run(cmd + [str(tmp_path / "src")], cwd=ROOT, capture_output=True, text=True,
                      timeout=300, check=False)
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "1 records added" in ok.stdout and "3 records" in ok.stdout
  path = tmp_path / "into" / results.RESULTS_FILE
  assert [r["key"] for r in results.read_records(str(path))] == ["a", "b", "c"]
  assert sum("config" in json.loads(line) for line in open(path)) == 1  # one run header
  bad = subprocess.run(cmd + [str(tmp_path / "bad")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
  assert bad.returncode == 1 and "only runs of the same config" in bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1
  assert len(results.read_records(str(path))) == 3


# ------------------------------------------------------------ quick: explicit fields win


def _get_config(quick_mode=False):
  c = ml_collections.ConfigDict()
  c.quick = quick_mode
  c.model = "tiny-random" if quick_mode else "big"
  c.lengths = (64,) if quick_mode else (1024, 2048)
  c.seed = 0
  return c


def test_quick_applies_its_values_except_explicit_fields():
  c = _get_config()
  c.quick = True
  got = quick.resolve(c, _get_config)
  assert got.model == "tiny-random" and list(got.lengths) == [64] and got.seed == 0
  # Given on the command line, even with the full default's value: kept.
  got = quick.resolve(c, _get_config, explicit=["model"])
  assert got.model == "big" and list(got.lengths) == [64]
  # Set programmatically to a non-default value: kept; resolving twice changes nothing.
  c.lengths = (512,)
  once = quick.resolve(c, _get_config)
  assert list(once.lengths) == [512] and once.model == "tiny-random"
  assert quick.resolve(once, _get_config).to_dict() == once.to_dict()
  c.quick = False
  assert quick.resolve(c, _get_config) is c


def test_every_config_has_the_one_quick_convention():
  names = [n[:-3] for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith(".py")
           and not n.startswith("_")]
  assert len(names) >= 10
  for name in names:
    get_config = quick.module_get_config(name)
    full, small = get_config(), get_config(True)
    assert full.quick is False and small.quick is True, name
    assert not hasattr(__import__(f"configs.{name}", fromlist=["x"]), "apply_quick"), name


def test_cli_explicit_config_flags_win_over_quick():
  script = ("import json\nfrom absl import app\nfrom experiments.common import cli\n"
            "cli.define_flags('accuracy')\n"
            "def main(_):\n  c, w = cli.parsed()\n  print(json.dumps([c.to_dict(), w]))\n"
            "cli.run(main)\n")
  out = subprocess.run([sys.executable, "-c", script, "--config.quick=True",
                        "--config.model=smollm2-135m-instruct", "--config.lengths=512",
                        "--workdir=/tmp/x"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  cfg, workdir = json.loads(out.stdout.strip().splitlines()[-1])
  small = quick.module_get_config("accuracy")(True)
  assert cfg["model"] == "smollm2-135m-instruct" and cfg["lengths"] == [512]
  assert cfg["num_samples"] == small.num_samples and cfg["tasks"] == list(small.tasks)
  assert workdir == "/tmp/x"


# ------------------------------------------------------------ progress


def test_progress_prints_one_line_per_update_with_rate_and_eta():
  stream = io.StringIO()
  p = cli.Progress(4, "demo", every=0.0, stream=stream)
  for i in range(4):
    p.update(note=f"item {i}")
  p.update()  # past the end: nothing more
  lines = stream.getvalue().splitlines()
  assert len(lines) == 4 and len(set(lines)) == 4
  assert lines[0].startswith("demo 1/4 (25%)") and "/s, elapsed 0:00:00, eta" in lines[0]
  assert lines[-1].startswith("demo 4/4 (100%)") and "eta 0:00:00 item 3" in lines[-1]
  quiet = io.StringIO()
  q = cli.Progress(100, "slow", every=3600.0, stream=quiet)
  for _ in range(99):
    q.update()
  assert quiet.getvalue() == ""
  q.update()
  assert quiet.getvalue().count("\n") == 1


def test_registry_names_a_runner_and_renderer_for_every_experiment():
  from experiments import registry  # pylint: disable=g-import-not-at-top
  assert set(registry.by_name()) == {
      "accuracy", "perplexity", "long_generation", "attention_error", "budget_reduction",
      "resa_lambda", "resa_calibrate", "svd_analysis", "latency", "needle_keep",
      "ea_needle_diagnosis"}
  for e in registry.EXPERIMENTS:
    assert callable(registry.load(e.run)) and callable(registry.load(e.render)), e.name
    assert os.path.exists(os.path.join(ROOT, "experiments", f"{e.name}.py")), e.name
  for c, p, _ in registry.claims():
    assert callable(registry.load(c.measure)), (p.name, c.claim)
  for p, _ in registry.parts():
    assert os.path.exists(os.path.join(ROOT, "configs", f"{p.name}.py")), p.name


def test_read_records_says_how_many_lines_of_which_file_it_skipped(tmp_path, caplog):
  path = tmp_path / "results.jsonl"
  good = [json.dumps(dict(key=i, x=i)) for i in range(3)]
  path.write_text("\n".join([good[0], "garbage", good[1], "42", good[2], '{"cut": ']) + "\n")
  with caplog.at_level("WARNING"):
    records = results.read_records(str(path))
  assert [r["key"] for r in records] == [0, 1, 2]
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert warnings == [f"{path}: skipped 3 line(s) that are not a JSON record (line 2, 4, 6)"]
