"""The committed results/REPORT.md is what the committed records give: regenerated here from a
copy of results/ (and the README, whose claims head the report rewrites), byte for byte."""

import os
import shutil

import pytest

from experiments.claims import report as claims

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_committed_report_regenerates_byte_identical(tmp_path):
  root = tmp_path / "results"
  shutil.copytree(os.path.join(REPO, "results"), root)
  readme = tmp_path / "README.md"
  shutil.copy(os.path.join(REPO, "README.md"), readme)
  path = claims.build(str(root), str(readme))
  committed = open(os.path.join(REPO, "results", "REPORT.md"), encoding="utf-8").read()
  assert open(path, encoding="utf-8").read() == committed, (
      "results/REPORT.md is stale: run `python -m experiments.claims --workdir=results` and "
      "commit what it writes")
  assert readme.read_text(encoding="utf-8") == open(os.path.join(REPO, "README.md"),
                                                    encoding="utf-8").read()


def _workdir_groups():
  """``(workdir, experiment) -> records`` of every committed results file."""
  from experiments.common import results  # pylint: disable=g-import-not-at-top
  groups = {}
  for path in sorted(results.find_results(os.path.join(REPO, "results"))):
    for r in results.read_records(path):
      groups.setdefault((os.path.dirname(path), r.get("experiment")), []).append(r)
  return groups


@pytest.mark.slow
def test_every_committed_workdir_markdown_regenerates_byte_identical(tmp_path, monkeypatch):
  """Each results/<workdir>/<experiment>.md is its renderer's output of the records beside it
  (a renderer change that alters a committed page must re-render and commit it)."""
  from experiments import registry, report  # pylint: disable=g-import-not-at-top
  from experiments.common import render  # pylint: disable=g-import-not-at-top

  def drawn_not_rasterised(fig, workdir, name):
    """The figures are built (their code runs) but not laid out and saved as PNGs: that took
    two thirds of this test, and only the markdown is compared here."""
    render.plt.close(fig)
    path = os.path.join(workdir, name)
    open(path, "wb").close()
    return path

  monkeypatch.setattr(render, "save_figure", drawn_not_rasterised)
  stale = []
  for i, ((workdir, name), recs) in enumerate(sorted(_workdir_groups().items())):
    experiment = registry.get(name)
    out = tmp_path / str(i)
    md = report.render_experiment(experiment, recs, str(out))
    committed = os.path.join(workdir, md)
    if (not os.path.exists(committed) or open(committed, encoding="utf-8").read()
        != (out / md).read_text(encoding="utf-8")):
      stale.append(os.path.relpath(committed, REPO))
  assert not stale, f"stale rendered pages (re-render them from their records): {stale}"


@pytest.mark.parametrize("board,earlier,rows", [
    ("leaderboard_sparse", "ruler_accuracy", {"dense", "quest"}),
    ("leaderboard_compression", "ruler_compression", {"dense", "snapkv"})])
def test_leaderboard_reference_rows_repeat_earlier_runs(board, earlier, rows):
  """The leaderboards' reference rows (dense, and Quest / SnapKV, each pair's other side) give
  the same predictions as the earlier workdirs on the same samples (same model, protocol and
  generator; other runs and revisions), so pairs by sample hold across runs (a method rerun
  after a fix pairs with an earlier run's reference cells). Older records keep only the first
  300 characters of a prediction: a cut one is compared as a prefix."""
  from experiments.common import results  # pylint: disable=g-import-not-at-top
  read = lambda name: {r["key"]: r for r in results.read_records(
      os.path.join(REPO, "results", name, "results.jsonl"))}
  new, old = read(board), read(earlier)
  shared = sorted(set(new) & set(old))
  assert {new[k]["method"].split("@")[0] for k in shared} == rows
  assert len(shared) >= 100 and len({new[k]["run"] for k in shared} | {
      old[k]["run"] for k in shared}) >= 2, len(shared)
  for k in shared:
    a, b = old[k]["prediction"], new[k]["prediction"]
    short = min(len(a), len(b))
    assert a[:short] == b[:short] and (a == b or short >= 300), k
