"""The JAX side of torch_splash: block planning, masks and the splash programs. Never imports torch."""

from . import compat
from .errors import SplashConstraintError, SplashDtypeError, SplashError, SplashVersionError

compat.check_versions()

from . import decode
from .decode import DecodePlan
from .kernels import EMPTY_ROW_LSE, TRACES, Program
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
from .plan import (
    BlockSizes,
    Plan,
    balanced_chunk_order,
    check_context_parallel,
    check_sequence_layout,
    lane_padded,
    plan,
)
from .programs import program

__all__ = [
    "BlockSizes",
    "BlockSparseMask",
    "CausalMask",
    "ChunkedCausalMask",
    "DecodePlan",
    "DenseMask",
    "EMPTY_ROW_LSE",
    "LocalMask",
    "Mask",
    "MultiHeadMask",
    "PrefixMask",
    "FullMask",
    "Plan",
    "Program",
    "SplashConstraintError",
    "SplashDtypeError",
    "SplashError",
    "SplashVersionError",
    "TRACES",
    "balanced_chunk_order",
    "check_context_parallel",
    "check_sequence_layout",
    "decode",
    "lane_padded",
    "plan",
    "program",
]
