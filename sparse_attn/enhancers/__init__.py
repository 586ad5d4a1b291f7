"""Enhancers that compose with any selector: RESA, ReSA rectification, RetroAttention.

``resa`` (Yang et al., ICLR 2026): residual estimation of the unselected keys.
``rectify`` (Sun et al. 2025): periodic dense rectification of the KV cache.
``retro`` (Choi et al. 2025): retrospective updates of the last ``w - 1`` outputs.
``compose``: the per-layer pipeline of a selector with its enhancers (``methods.Method``).
"""

from sparse_attn.enhancers import rectify, resa, retro
