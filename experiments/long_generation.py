r"""Long-generation fidelity of sparse decoding against dense (see ``configs/long_generation.py``).

  python -m experiments.long_generation --config=configs/long_generation.py --workdir=results/long_generation

Writes ``results.jsonl`` (one record per method), ``long_generation.md`` and
``long_generation.png`` into the workdir; a rerun resumes where the last one stopped.
"""

from experiments.common import cli

cli.define_flags("long_generation", mesh=True)  # --mesh=data:2,model:2,seq:2


def main(argv):
  del argv
  mesh = cli.mesh()  # first: --distributed initialises before anything touches a device
  config, workdir = cli.parsed()
  from experiments.tasks import long_generation  # pylint: disable=g-import-not-at-top
  long_generation.run(config, workdir, mesh=mesh)
  print(open(f"{workdir}/long_generation.md", encoding="utf-8").read())


if __name__ == "__main__":
  cli.run(main)
