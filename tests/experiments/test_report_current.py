"""The committed results/REPORT.md is what the committed records give: regenerated here from a
copy of results/ (and the README, whose claims head the report rewrites), byte for byte."""

import os
import shutil

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
