"""Task experiments: RULER-style accuracy, perplexity under sparse decoding, long generation.

Library code for the experiments ``accuracy``, ``perplexity`` and ``long_generation``:
``ruler`` / ``haystack`` (the sample generator), ``scoring``, ``decoding`` (shared prefill,
greedy and lockstep teacher-forced loops), and one module per experiment. The method rows
(``experiments.common.specs``) and the top-k reuse baseline (``experiments.common.reuse``) are
shared with the analysis experiments.
"""
