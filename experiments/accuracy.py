r"""RULER-style synthetic accuracy under sparse decoding (see ``configs/accuracy.py``).

  python -m experiments.accuracy --config=configs/accuracy.py --workdir=results/accuracy

Writes ``results.jsonl`` (one record per method x sample), ``accuracy.md`` and
``accuracy_vs_length.png`` into the workdir; a rerun resumes where the last one stopped.
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("accuracy")
