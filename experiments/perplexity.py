r"""Perplexity under sparse decoding (see ``configs/perplexity.py``).

  python -m experiments.perplexity --config=configs/perplexity.py --workdir=results/perplexity

Writes ``results.jsonl`` (one record per method x view x decode length), ``perplexity.md`` and
the sweep / interval figures into the workdir; a rerun resumes where the last one stopped.
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("perplexity")
