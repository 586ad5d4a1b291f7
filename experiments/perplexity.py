r"""Perplexity under sparse decoding (see ``configs/perplexity.py``).

  python -m experiments.perplexity --config=configs/perplexity.py --workdir=results/perplexity

Writes ``results.jsonl`` (one record per method x view x decode length), ``perplexity.md`` and
the sweep / interval figures into the workdir; a rerun resumes where the last one stopped.
"""

from experiments.common import cli

cli.define_flags("perplexity", mesh=True)  # --mesh=data:2,model:2,seq:2


def main(argv):
  del argv
  mesh = cli.mesh()  # first: --distributed initialises before anything touches a device
  config, workdir = cli.parsed()
  from experiments.tasks import perplexity  # pylint: disable=g-import-not-at-top
  perplexity.run(config, workdir, mesh=mesh)
  print(open(f"{workdir}/perplexity.md", encoding="utf-8").read())


if __name__ == "__main__":
  cli.run(main)
