r"""RULER-style synthetic accuracy under sparse decoding (see ``configs/accuracy.py``).

  python -m experiments.accuracy --config=configs/accuracy.py --workdir=results/accuracy

Writes ``results.jsonl`` (one record per method x sample), ``accuracy.md`` and
``accuracy_vs_length.png`` into the workdir; a rerun resumes where the last one stopped.
"""

from experiments.common import cli

cli.define_flags("accuracy", mesh=True)  # --mesh=data:2,model:2,seq:2


def main(argv):
  del argv
  mesh = cli.mesh()  # first: --distributed initialises before anything touches a device
  config, workdir = cli.parsed()
  from experiments.tasks import accuracy  # pylint: disable=g-import-not-at-top
  accuracy.run(config, workdir, mesh=mesh, allow_long_context=cli.ALLOW_LONG_CONTEXT.value)
  print(open(f"{workdir}/accuracy.md", encoding="utf-8").read())


if __name__ == "__main__":
  cli.run(main)
