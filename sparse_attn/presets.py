"""Paper presets: each paper's main setting as a ``methods.make`` spec string.

``methods.make(name, **overrides)`` accepts a preset name; keywords override the preset's inline
options (``methods.make("resa-quest", budget=0.05)``).
"""

# name -> spec string (every option inline).
PRESETS = {
    # RESA (Yang et al., ICLR 2026), Sec. 5 "Additional Configuration": 2.5% of the context chosen
    # by the selector, 4 sinks + 64 local tokens a fixed budget on top, prior fixed at the end of
    # prefill (Sec. 4.2), lambda = 1 (Sec. 4.3).
    "resa-quest": "quest:budget=0.025,n_sink=4,local_window=64,forced_count=extra"
                  "+resa:lam=1.0,prior_update=prefill_only,typical_query=mean",
    "resa-arkvale": "arkvale:budget=0.025,n_sink=4,local_window=64,forced_count=extra"
                    "+resa:lam=1.0,prior_update=prefill_only,typical_query=mean",
    "resa-topk": "topk:budget=0.025,n_sink=4,local_window=64,forced_count=extra"
                 "+resa:lam=1.0,prior_update=prefill_only,typical_query=mean",
    # Quest (Tang et al., ICML 2024) as its evaluation code runs it (github mit-han-lab/Quest,
    # evaluation/quest_attention.py): layers 0 and 1 dense (``layer_id < 2``), no sink or local
    # tokens forced, at least 3 chunks of 16 (``max(3, token_budget // chunk_size)``). The
    # budget is the caller's (the library's 10% by default): the authors sweep 512-4096 tokens
    # (scripts/longbench.sh, scripts/passkey.sh), e.g. ``methods.make("quest-paper", budget=1024)``.
    "quest-paper": "quest:n_sink=0,local_window=0,min_tokens=48,dense_layers=2",
    # ReSA (Sun et al. 2025), Sec. 2.1 Eq. 4 and Sec. 3: group-shared block selection,
    # n = max(n_min, ceil(M p)) blocks counting the n_local forced block, no sink block,
    # b = 16, n_min = 16, p = 0.1, dense rectification every f = 32 tokens (Sec. 2.2).
    "rectified": "quest:gqa=group,p=0.1,n_min=16,n_local=1,n_sink=0,forced_count=inside"
                 "+rect:f=32",
    # RetroAttention (Choi et al. 2025), Table 1: Quest with a relative budget of 0.15 of the
    # current context and a 256-token minimum, only the current page forced; window w = 2.
    "retro": "quest:budget=0.15,min_tokens=256,n_sink=0,local_window=1,forced_count=inside"
             "+retro:w=2",
    # Expected Attention (Devoto et al. 2025), Sec. 4 "Experimental setup": Ada-KV head budgets,
    # 512 future positions, eps = 0.01 (0 for needle in a haystack), covariance and value norm;
    # prefill statistics from the prompt's queries. Half the cache evicted (Fig. 3's ratio).
    "expected-attention": "expected_attention:ratio=0.5,head_budget=adakv,n_future=512,eps=0.01,"
                          "use_covariance=true,use_vnorm=true,prefill_stats=all",
}
