r"""Expected Attention's expected score per key against the question's true attention (needles).

  python -m experiments.ea_needle_diagnosis --config=configs/ea_needle_diagnosis.py \
      --workdir=results/ea_needle_diagnosis

See ``configs/ea_needle_diagnosis.py`` (protocol) and
``experiments/analysis/ea_needle_diagnosis.py``. Writes ``results.jsonl``,
``ea_needle_diagnosis.md`` and ``ea_needle_diagnosis.png``; a rerun resumes.
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("ea_needle_diagnosis")
