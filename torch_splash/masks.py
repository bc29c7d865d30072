"""Masks for `torch_splash.attention`: shape-free specs, bound to (Lq, Lkv) at call time.

`"causal"` is SDPA's `is_causal` (top-left aligned: `CausalMask(offset=0)`). `CausalMask(offset)`
lets row i see keys j <= i + offset; `offset = Lkv - Lq` is the bottom-right alignment of
KV-cache decoding. Rows that see no key return 0, as SDPA does.
"""

from jax_core.masks import CausalMask, FullMask

__all__ = ["CausalMask", "FullMask"]
