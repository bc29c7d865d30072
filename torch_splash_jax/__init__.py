"""The JAX side of torch_splash: block planning, masks and the splash programs. Never imports torch.

`__all__` is what a caller uses: the masks, `BlockSizes`, `plan(...)` (a `Plan`), `program(plan)`
(its `Program`: forward, infer, backward; a `DecodePlan`'s: forward), `decode` (the decode kernel's
plan and default rule), `balanced_chunk_order` and the errors. The other names
imported here serve torch_splash (its checks, padding and the empty-row logsumexp)."""

from . import compat
from .errors import SplashConstraintError, SplashDtypeError, SplashError, SplashVersionError

compat.check_versions()

from . import decode
from .block_sizes import BlockSizes
from .decode import DecodePlan
from .kernel_limits import lane_padded as lane_padded  # for torch_splash
from .masks import (
    BlockSparseMask,
    CausalMask,
    ChunkedCausalMask,
    DenseMask,
    FullMask,
    LocalMask,
    Mask,
    MultiHeadMask,
    PrefixMask,
)
from .plan import Plan, plan
from .program_cache import program
from .sequence_layout import balanced_chunk_order
from .sequence_layout import check_context_parallel as check_context_parallel  # for torch_splash
from .sequence_layout import check_sequence_layout as check_sequence_layout  # for torch_splash
from .splash_program import EMPTY_ROW_LSE as EMPTY_ROW_LSE  # for torch_splash
from .splash_program import Program

__all__ = [
    "BlockSizes",
    "BlockSparseMask",
    "CausalMask",
    "ChunkedCausalMask",
    "DecodePlan",
    "DenseMask",
    "FullMask",
    "LocalMask",
    "Mask",
    "MultiHeadMask",
    "Plan",
    "PrefixMask",
    "Program",
    "SplashConstraintError",
    "SplashDtypeError",
    "SplashError",
    "SplashVersionError",
    "balanced_chunk_order",
    "decode",
    "plan",
    "program",
]
