"""Task experiments: RULER-style accuracy, perplexity under sparse decoding, long generation.

Library code for the entry points ``experiments/{accuracy,perplexity,long_generation,report}.py``:
``ruler`` / ``haystack`` (the sample generator), ``scoring``, ``specs`` (method rows),
``decoding`` (shared prefill, greedy and lockstep teacher-forced loops), ``reuse`` (top-k reuse
baseline and selection overlap), and one module per experiment.
"""
