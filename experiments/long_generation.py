r"""Long-generation fidelity of sparse decoding against dense (see ``configs/long_generation.py``).

  python -m experiments.long_generation --config=configs/long_generation.py --workdir=results/long_generation

Writes ``results.jsonl`` (one record per method), ``long_generation.md`` and
``long_generation.png`` into the workdir; a rerun resumes where the last one stopped.
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("long_generation")
