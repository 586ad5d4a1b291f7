r"""Which context tokens each compression method keeps, and whether the needle survives.

  python -m experiments.needle_keep --config=configs/needle_keep.py --workdir=results/needle_keep

See ``configs/needle_keep.py`` (protocol) and ``experiments/analysis/needle_keep.py``.
Writes ``results.jsonl``, ``needle_keep.md`` and ``needle_keep.png``; a rerun resumes.
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("needle_keep")
