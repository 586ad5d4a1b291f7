"""``experiments.claims.leaderboard``'s figure: panels by method family, one style per method."""

import json
import os

import matplotlib.colors
import pytest

from experiments.claims import leaderboard, report
from sparse_attn import methods

RULER = "RULER (NVIDIA generator)"


def _row(method, share=0.5, accuracy=50.0, protocol="query_agnostic", length=4096,
         bench=RULER):
  return dict(benchmark=bench, protocol=protocol, method=method, budget="-", length=length,
              share=share, accuracy=accuracy, lo=accuracy - 5, hi=accuracy + 5)


def _drawn(monkeypatch, board, tmp_path):
  """The figure ``leaderboard.figure`` draws for ``board`` (kept open), and its saved path."""
  got = {}

  def keep(fig, workdir, name):
    got["fig"] = fig
    path = os.path.join(workdir, name)
    fig.savefig(path, dpi=30)
    return path

  monkeypatch.setattr(leaderboard.render, "save_figure", keep)
  path = leaderboard.figure(board, str(tmp_path))
  return got["fig"], path


@pytest.mark.parametrize("label, family", [
    ("dense", "dense"), ("snapkv@0.5", "compression"),
    ("compactor:head_budget=adakv@0.25", "compression"),
    ("expected-attention@0.5", "compression"),  # a preset of Expected Attention
    ("expected-attention:head_budget=uniform@0.1", "compression"),
    ("quest@0.025", "sparse-decode"), ("quest+resa@0.025", "sparse-decode"),
    ("resa-quest:lam=0.25@0.025", "sparse-decode"), ("rectified:p=0.02", "sparse-decode"),
    ("retro", "sparse-decode"),
    ("rocketkv@0.025", "sparse-decode"),  # eviction, then a subset read per step (SPARSE_DECODE)
    ("resa-quest+calibrated:fit=results/resa_calibrate_qwen/x@0.025", "sparse-decode"),
    ("mystery:x=1@0.5", "other")])
def test_family_of_a_row_label(label, family):
  assert leaderboard.family(label) == family


def test_panels_split_each_group_by_family_with_dense_in_every_panel():
  board = [_row("dense", share=None, accuracy=80.0), _row("snapkv@0.5"),
           _row("compactor:head_budget=adakv@0.5"), _row("expected-attention@0.5"),
           _row("quest@0.025", share=0.05), _row("resa-quest:lam=0.25@0.025", share=0.05),
           _row("rectified", share=0.1), _row("retro", share=0.15), _row("mystery@0.5"),
           _row("dense", share=None, length=8192)]  # a group of dense alone
  got = {k: [r["method"] for r in rs] for k, rs in leaderboard.panels(board).items()}
  assert got == {
      (RULER, "query_agnostic", 4096, "compression", False): [
          "dense", "snapkv@0.5", "compactor:head_budget=adakv@0.5", "expected-attention@0.5"],
      (RULER, "query_agnostic", 4096, "sparse-decode", False): [
          "dense", "quest@0.025", "resa-quest:lam=0.25@0.025", "rectified", "retro"],
      (RULER, "query_agnostic", 4096, "other", False): ["dense", "mystery@0.5"],
      (RULER, "query_agnostic", 8192, "dense", False): ["dense"]}
  assert list(got) == sorted(got, key=lambda k: (k[2], ["compression", "sparse-decode",
                                                        "other", "dense"].index(k[3])))


def test_a_crowded_compression_panel_is_split_by_what_the_scores_read(monkeypatch, tmp_path):
  """Over ``CROWDED`` compression methods: a panel per ``signal`` (attention weights, query
  statistics, keys alone), in that order, dense in each; at most ``CROWDED``: one panel."""
  info = [i for i in methods.available("compression")  # (RocketKV: with the sparse decoders)
          if leaderboard.family(i.name) == "compression"]
  assert len(info) > leaderboard.CROWDED
  board = [_row("dense", share=None, accuracy=80.0)] + [_row(f"{i.name}@0.5") for i in info]
  got = {k[3]: [r["method"] for r in rs] for k, rs in leaderboard.panels(board).items()}
  assert list(got) == ["compression:attention", "compression:queries", "compression:keys"]
  for sig, rows in got.items():
    assert rows[0] == "dense" and rows[1:] == [f"{i.name}@0.5" for i in info
                                               if f"compression:{i.signal}" == sig]
  assert "knorm@0.5" in got["compression:keys"] and "snapkv@0.5" in got["compression:attention"]
  fig, _ = _drawn(monkeypatch, board, tmp_path)
  assert [a.get_title().split("\n")[1] for a in fig.axes if a.get_title()] == [
      leaderboard.FAMILY_TITLES[k] for k in got]
  few = board[:1 + leaderboard.CROWDED]
  assert [k[3] for k in leaderboard.panels(few)] == ["compression"]


def test_figure_titles_name_the_family_and_dense_is_in_every_panel(monkeypatch, tmp_path):
  board = [_row("dense", share=None, accuracy=80.0), _row("snapkv@0.5"),
           _row("quest@0.025", share=0.05), _row("mystery@0.5"),
           _row("dense", share=None, accuracy=70.0, protocol="query_aware"),
           _row("finch@0.5", protocol="query_aware")]
  fig, path = _drawn(monkeypatch, board, tmp_path)
  assert os.path.getsize(path) > 0
  titled = [a for a in fig.axes if a.get_title()]
  assert [a.get_title().split("\n")[1] for a in titled] == [
      "compression (eviction)", "compression (eviction)",
      "sparse decode (a subset read per step)", "other (not in the catalog)"]
  assert titled[0].get_title().startswith(f"{RULER}, query_aware, 4096 tokens")
  for a in titled:  # dense: the dashed black line of each panel
    assert [ln.get_label() for ln in a.lines if ln.get_linestyle() == "--"] == ["dense"]
  assert leaderboard.figure([], str(tmp_path)) is None


def test_a_crowded_panel_of_the_whole_catalog_keeps_one_style_per_method(monkeypatch,
                                                                          tmp_path):
  names = [i.name for i in methods.available() if i.family != "dense"]
  assert len(names) >= 30
  # every catalog method in one panel ("~x": a name the catalog does not hold -> "other")
  board = [_row("dense", share=None, accuracy=90.0)] + [
      _row(f"{n}~x@0.5", share=0.05 * (1 + i % 10), accuracy=i) for i, n in enumerate(names)]
  assert [k[3] for k in leaderboard.panels(board)] == ["other"]
  fig, _ = _drawn(monkeypatch, board, tmp_path)
  panel, slot = fig.axes  # the legend beside the panel, in its own slot
  pairs = [(matplotlib.colors.to_hex(c.lines[0].get_color()), c.lines[0].get_marker())
           for c in panel.containers]
  assert len(pairs) == len(set(pairs)) == len(names)
  assert panel.get_legend() is None
  assert len(slot.get_legend().get_texts()) == len(names) + 1  # dense too
  # the catalog split by family: one style per method in every panel it is drawn in
  board = [_row("dense", share=None)] + [_row(f"{n}@0.5") for n in names] + [
      _row(f"{n}@0.5", protocol="query_aware") for n in names]
  fig, _ = _drawn(monkeypatch, board, tmp_path)
  styles = {}
  for a in fig.axes:
    drawn = [(c.get_label(), matplotlib.colors.to_hex(c.lines[0].get_color()),
              c.lines[0].get_marker()) for c in a.containers]
    assert len({d[1:] for d in drawn}) == len(drawn)
    for label, *style in drawn:
      assert styles.setdefault(label, style) == style


def test_the_report_reads_the_leaderboard_compression_workdirs(tmp_path):
  """``results/leaderboard_compression(_qa)``: the report finds every ``results.jsonl`` under
  its root (no list of workdirs to extend), a missing one is simply not there."""
  for name, protocol in (("leaderboard_compression", "query_agnostic"),
                         ("leaderboard_compression_qa", "query_aware")):
    os.makedirs(tmp_path / name)
    with open(tmp_path / name / "results.jsonl", "w", encoding="utf-8") as f:
      for method, score in (("dense", 1.0), ("snapkv@0.5", 0.0)):
        f.write(json.dumps(dict(experiment="accuracy", protocol=protocol, method=method,
                                budget=None if method == "dense" else 0.5, length=4096,
                                task="niah_single_1", seed=0, depth=0.5, score=score,
                                config={}, num_tokens=4096)) + "\n")
  board = leaderboard.rows(report.load(str(tmp_path))["accuracy"])
  assert {(r["protocol"], r["method"]) for r in board} == {
      (p, m) for p in ("query_agnostic", "query_aware") for m in ("dense", "snapkv@0.5")}


def test_a_row_over_fewer_tasks_than_dense_is_drawn_apart_dotted_and_hollow(monkeypatch,
                                                                              tmp_path):
  """Its mean is over other tasks than dense's: a panel of its own after its family's (every
  budget of that method there), dotted and hollow, its label saying how many tasks."""
  board = [dict(_row("dense", share=None, accuracy=90.0), tasks=12),
           dict(_row("snapkv@0.5"), tasks=12), dict(_row("snapkv@0.25", share=0.25), tasks=12),
           dict(_row("knorm@0.5"), tasks=12), dict(_row("knorm@0.25", share=0.25), tasks=2),
           dict(_row("quest@0.025", share=0.05), tasks=12)]
  got = {k: [r["method"] for r in rs] for k, rs in leaderboard.panels(board).items()}
  assert got == {
      (RULER, "query_agnostic", 4096, "compression", False): [
          "dense", "snapkv@0.5", "snapkv@0.25"],
      (RULER, "query_agnostic", 4096, "compression", True): [
          "dense", "knorm@0.5", "knorm@0.25"],
      (RULER, "query_agnostic", 4096, "sparse-decode", False): ["dense", "quest@0.025"]}
  fig, _ = _drawn(monkeypatch, board, tmp_path)
  full, partial, sparse = fig.axes
  assert not full.get_title().endswith(leaderboard.PARTIAL_TITLE)
  assert partial.get_title().endswith(leaderboard.PARTIAL_TITLE)
  assert not sparse.get_title().endswith(leaderboard.PARTIAL_TITLE)
  drawn = {c.get_label(): c.lines[0] for a in (full, partial) for c in a.containers}
  assert [c.get_label() for c in full.containers] == ["snapkv"]
  assert [c.get_label() for c in partial.containers] == ["knorm (2 of 12 tasks)"]
  assert drawn["snapkv"].get_linestyle() == "-"
  assert drawn["snapkv"].get_markerfacecolor() != "none"
  assert drawn["knorm (2 of 12 tasks)"].get_linestyle() == ":"
  assert drawn["knorm (2 of 12 tasks)"].get_markerfacecolor() == "none"
  for a in fig.axes:  # dense in every panel
    assert [ln.get_label() for ln in a.lines if ln.get_linestyle() == "--"] == ["dense"]


def test_rows_reading_every_token_stay_in_view(monkeypatch, tmp_path):
  """ThinK prunes key channels, not tokens (its rows read 100% of the context): dodged
  sideways beside other rows at 100%, every point stays inside the axes."""
  board = [_row("dense", share=None)] + [_row(f"{n}@0.5", share=1.0)
                                         for n in ("think", "snapkv", "knorm", "tova")]
  fig, _ = _drawn(monkeypatch, board, tmp_path)
  (panel,) = fig.axes
  lo, hi = panel.get_xlim()
  xs = [x for c in panel.containers for x in c.lines[0].get_xdata()]
  assert len(xs) == 4 and all(lo <= x <= hi for x in xs) and max(xs) > 100
