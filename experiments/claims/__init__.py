"""The reproduction report: each paper claim next to what this library measures.

  python -m experiments.claims --workdir=results     # writes results/REPORT.md

``report`` builds ``REPORT.md`` and the README's head from the claims registered in
``experiments.registry``; the measures live by kind: ``table`` (RESA's analysis figures),
``tasks`` (RULER and long-generation accuracy of the selectors), ``compression`` (Expected
Attention against the eviction baselines), ``decoders_2025`` (TidalDecode, ShadowKV, Twilight
and RocketKV against dense on the sparse leaderboard), ``sweeps`` (lambda and budget sweeps),
``generation`` (perplexity and retro's effective budget), ``speed`` (latency and memory);
``row`` holds ``Measured``, what every measure returns, ``verdicts`` the shared verdict rules
and ``leaderboard`` the accuracy leaderboard.
"""
