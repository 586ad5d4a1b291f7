"""``python -m experiments.claims --workdir=results``: writes REPORT.md (``claims.report``)."""

import os

from absl import app, flags

from experiments.claims import report

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not os.path.isdir(FLAGS.workdir):
    raise app.UsageError(f"--workdir={FLAGS.workdir} is not a directory")
  readme = FLAGS.readme
  if readme is None:  # the README beside the workdir: a copy of results/ elsewhere leaves ours
    readme = os.path.join(os.path.dirname(os.path.abspath(FLAGS.workdir)), "README.md")
  print(open(report.build(FLAGS.workdir, readme), encoding="utf-8").read())


if __name__ == "__main__":
  flags.DEFINE_string("workdir", "results", "Root holding one folder per experiment.")
  flags.DEFINE_string("readme", None, "A file whose claims-head block is rewritten with the "
                      "head of the report (nothing if it has no such block; '' off). Default: "
                      "the README.md in the folder holding --workdir.")
  app.run(main)
