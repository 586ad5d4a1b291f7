"""The report's figure links: a claim row links the plot of the folder whose records it read."""

import json
import os

import numpy as np

from experiments.claims import report as claims
from experiments.claims import verdicts
from tests.claim_records import accuracy_records


def test_claim_figure_comes_from_the_folder_of_the_records_it_read(tmp_path):
  """The EA row reads the aligned run (in ruler_compression/): its figure link goes there, not
  to the part's folder holding the earlier variant's records and plot."""
  agnostic = dict(budget=0.5, protocol="query_agnostic")
  old = accuracy_records("expected-attention", np.ones(20), **agnostic) + accuracy_records(
      "keydiff", np.zeros(20), **agnostic)
  new = [dict(r, generator=verdicts.RULER_GENERATOR) for r in old]
  for name, recs in (("accuracy_compression", old), ("ruler_compression", new)):
    os.makedirs(tmp_path / name)
    (tmp_path / name / "accuracy_vs_length.png").write_bytes(b"png")
    with open(tmp_path / name / "results.jsonl", "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in recs)
  files = claims.read_files(str(tmp_path))
  rows = claims.claim_rows(claims.load(str(tmp_path), files), str(tmp_path),
                           folders=claims.folders_of(files, str(tmp_path)))
  (row,) = [r for r in rows if r["source"] == "EA Table 1"]
  assert row["figure"] == "[accuracy_vs_length.png](ruler_compression/accuracy_vs_length.png)"
  assert "read" not in row
  (row,) = [r for r in claims.claim_rows(claims.load(str(tmp_path), files), str(tmp_path))
            if r["source"] == "EA Table 1"]  # without folders: the part's own folder
  assert row["figure"] == "[accuracy_vs_length.png](accuracy_compression/accuracy_vs_length.png)"
