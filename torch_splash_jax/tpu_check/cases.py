"""What `tpu_check` runs: the fidelity cases (every kernel and feature, forward and gradients) and
the timing rows (the calls its table reports), each a `Call` that plans like any other.

Pure Python: the masks are built from their names when a case runs (`Call.mask`), so that the
orchestrating process imports no JAX.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention call: shapes, dtype, mask (a constructor expression over torch_splash_jax's
    masks, or "dense" / "per-head" for a stored or per-head mask built from a seed, "causal-tensor" for
    causal as a bool array) and options."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int = 128
    head_dim_v: int | None = None
    dtype: str = "bfloat16"
    mask: str = "CausalMask(0)"
    segment_ids: bool = False
    soft_cap: float | None = None
    sinks: bool = False
    kernel: str = "splash"  # or "decode"
    blocks: tuple = ()  # explicit BlockSizes fields, (name, value) pairs
    generation: str | None = None  # the TPU generation its kernels are built for (Plan.generation)

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def mask_object(self):
        """The torch_splash_jax mask this call's `mask` names."""
        import numpy as np

        from .. import masks

        if self.mask == "dense":  # a stored mask: random blocks, as a data mask's tables hold them
            rng = np.random.default_rng(0)
            return masks.DenseMask(rng.random((self.q_len, self.kv_len)) > 0.3)
        if self.mask == "causal-tensor":  # causal as a bool tensor (as HF hands a 4-D mask over): stored blocks
            return masks.DenseMask(np.tri(self.q_len, self.kv_len, dtype=bool))
        if self.mask == "per-head":
            choices = [masks.CausalMask(0), masks.LocalMask(128), masks.FullMask(), masks.CausalMask(5)]
            return masks.MultiHeadMask(tuple(choices[h % len(choices)] for h in range(self.q_heads)))
        return eval(self.mask, {"__builtins__": {}}, vars(masks))  # noqa: S307 (this package's masks only)

    def plan(self, platform: str):
        """The call's plan: the decode kernel's or JAX's splash kernels'."""
        from .. import block_sizes, decode
        from ..plan import plan

        fields = dict(
            batch=self.batch,
            num_q_heads=self.q_heads,
            num_kv_heads=self.kv_heads,
            q_len=self.q_len,
            kv_len=self.kv_len,
            head_dim=self.head_dim,
            head_dim_v=self.dv,
            dtype=self.dtype,
            mask=self.mask_object(),
            scale=self.head_dim**-0.5,
            soft_cap=self.soft_cap,
            has_segment_ids=self.segment_ids,
            has_sinks=self.sinks,
            platform=platform,
        )
        if self.kernel == "decode":
            return decode.decode_plan(**fields)
        # JAX's splash kernels at the plan's blocks: the baseline the active kernels are timed against
        explicit = dict(dict(self.blocks), forward_kernel="splash")
        generation = self.generation if platform == "tpu" else None
        return plan(**fields, block_sizes=block_sizes.BlockSizes(**explicit), generation=generation)

    def scaled(self, factor: int) -> Call:
        """The same call with lengths divided by `factor` (at least 128), batch at most 2: the CPU's
        quick run of a TPU-sized row."""

        def shrink(n):
            return max(min(n, 128), n // factor)

        return dataclasses.replace(self, batch=min(self.batch, 2), q_len=shrink(self.q_len), kv_len=shrink(self.kv_len))


def _c(name, batch, hq, hkv, lq, lkv, **options) -> Call:
    return Call(name, batch, hq, hkv, lq, lkv, **options)


# Every kernel and feature once, at sizes the chip runs in a moment. Tolerance: `TOLERANCE`.
FIDELITY = (
    _c("causal", 1, 8, 8, 1024, 1024),
    _c("full", 1, 8, 8, 1024, 1024, mask="FullMask()"),
    _c("window", 1, 8, 8, 2048, 2048, mask="LocalMask(255, 0)"),
    _c("chunked", 1, 8, 8, 2048, 2048, mask="ChunkedCausalMask(512)"),
    _c("prefix-or-causal", 1, 8, 8, 1024, 1024, mask="CausalMask(0) | PrefixMask(100)"),
    _c("stored-mask", 1, 4, 4, 1024, 1024, mask="dense"),
    _c("per-head-masks", 2, 4, 2, 1024, 1024, mask="per-head"),
    _c("segment-ids-batch-2", 2, 8, 8, 1024, 1024, segment_ids=True),
    _c("soft-cap", 1, 8, 8, 1024, 1024, soft_cap=30.0),
    _c("sinks", 1, 8, 8, 1024, 1024, sinks=True),
    _c("gqa", 2, 16, 4, 1024, 1024),
    _c("mqa", 1, 8, 1, 1024, 1024),
    _c("mqa-batch-2", 2, 8, 1, 1024, 1024),
    _c("d64", 1, 8, 8, 1024, 1024, head_dim=64),
    _c("d256", 1, 8, 8, 1024, 1024, head_dim=256),
    _c("dv-ne-d", 1, 8, 8, 1024, 1024, head_dim=128, head_dim_v=64),
    _c("float32", 1, 8, 8, 1024, 1024, dtype="float32"),
    _c("float16", 1, 8, 8, 1024, 1024, dtype="float16"),
    _c("off-grid-1000", 2, 8, 2, 1000, 1000),
    _c("cross-300x1000", 1, 8, 8, 300, 1000, mask="CausalMask(700)"),
    _c("batch-4-in-heads", 4, 8, 2, 1024, 1024),
    _c("batch-4-loop-ids-window", 4, 8, 2, 1024, 1024, segment_ids=True, mask="LocalMask(255, 0)"),
    _c("decode", 4, 32, 8, 1, 4096, mask="CausalMask(4095)", segment_ids=True, kernel="decode"),
    _c("decode-sinks-soft-cap", 2, 8, 2, 4, 2048, mask="CausalMask(2044)", segment_ids=True, sinks=True,
       soft_cap=30.0, kernel="decode"),
)  # fmt: skip
# Relative max error (max |kernel - reference| / max |reference|) of the output and of each
# gradient, against a float32 reference at `highest` matmul precision on the same inputs. The
# kernels round the softmax weights to the inputs' dtype before the second matmul (bfloat16: a
# relative error of up to 2**-8 per weight), and the MXU multiplies float32 in bfloat16 passes; the
# first run on a v5e measured at most 0.8% over these features. 2% leaves room for other inputs
# without passing a wrong mask or scale, which errs by tens of percent.
TOLERANCE = 0.02

# MaxText's splash blocks (its `sa_block_*` defaults): the baseline JAX's splash runs at.
MAXTEXT_BLOCKS = dict(
    block_q=512,
    block_kv=512,
    block_kv_compute=512,
    block_q_dkv=512,
    block_kv_dkv=512,
    block_kv_dkv_compute=512,
    block_q_dq=512,
    block_kv_dq=512,
    use_fused_bwd_kernel=False,
)

# Training rows: forward and forward+backward (a step), B=1 unless said.
TRAINING = (
    _c("causal 16K 16/16 D128", 1, 16, 16, 16384, 16384),
    _c("full 16K 16/16 D128", 1, 16, 16, 16384, 16384, mask="FullMask()"),
    _c("causal 16K 32/8 D128", 1, 32, 8, 16384, 16384),
    _c("causal 16K 8/8 D256", 1, 8, 8, 16384, 16384, head_dim=256),
    _c("window 4096 at 32K 16/16 D128", 1, 16, 16, 32768, 32768, mask="LocalMask(4095, 0)"),
    _c("B=4 causal 1K 16/16 D128", 4, 16, 16, 1024, 1024),
    _c("B=4 causal 2K 16/16 D128", 4, 16, 16, 2048, 2048),
    _c("B=4 causal 4K 16/16 D128", 4, 16, 16, 4096, 4096),
    _c("B=8 causal 2K 32/8 D128", 8, 32, 8, 2048, 2048),
    _c("B=8 causal 4K 32/8 D128", 8, 32, 8, 4096, 4096),
    _c("B=8 documents 2K 32/8 D128", 8, 32, 8, 2048, 2048, segment_ids=True),
    _c("causal 16K 16/16 D128, a bool tensor", 1, 16, 16, 16384, 16384, mask="causal-tensor"),
    _c("per-head masks 16K 16/16 D128", 1, 16, 16, 16384, 16384, mask="per-head"),
)
# Decode rows: one token against a whole cache, and against caches of ragged lengths (each
# sequence's as segment ids, as HF generation hands them over); chunked prefill against a 32K
# cache at B=1.
DECODE = (
    _c("decode B=8 32K 32/8 D128", 8, 32, 8, 1, 32768, mask="CausalMask(32767)", kernel="decode"),
    _c("decode B=32 4K 32/8 D128", 32, 32, 8, 1, 4096, mask="CausalMask(4095)", kernel="decode"),
    _c("decode B=8 4K 32/8 D128", 8, 32, 8, 1, 4096, mask="CausalMask(4095)", kernel="decode"),
    _c("decode B=8 32K 32/8 D128, ragged (segment ids)", 8, 32, 8, 1, 32768, mask="CausalMask(32767)",
       segment_ids=True, kernel="decode"),
    _c("prefill 16 tokens (64 rows) at 32K", 1, 32, 8, 16, 32768, mask="CausalMask(32752)", kernel="decode"),
    _c("prefill 128 tokens (512 rows) at 32K", 1, 32, 8, 128, 32768, mask="CausalMask(32640)", kernel="decode"),
    _c("prefill 512 tokens (2048 rows) at 32K", 1, 32, 8, 512, 32768, mask="CausalMask(32256)", kernel="decode"),
)  # fmt: skip
# XLA's dense attention holds the (B, H, Lq, Lkv) float32 logits: rows past this many bytes of them
# are not run (at 16K tokens, 16 heads: 16 GiB, the whole chip).
DENSE_MAX_LOGIT_BYTES = 2 << 30

MASK_NAMES = {
    "causal": "CausalMask(0)",
    "full": "FullMask()",
}


def parse_call(shape: str, mask: str = "causal", dtype: str = "bfloat16") -> Call:
    """A user's call from `--shape B,Hq,Hkv,Lq,Lkv,D` (Lkv may be left out: Lq) and `--mask causal |
    full | window:W (the last W tokens) | chunked:C | an expression over torch_splash_jax's masks`:
    the decode kernel's where torch_splash.attention would take it for a call without gradients."""
    from ..errors import SplashConstraintError

    try:
        numbers = [int(n) for n in shape.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) == 5:
        numbers.insert(4, numbers[3])
    if len(numbers) != 6 or min(numbers) < 1:
        raise SplashConstraintError(
            f"--shape {shape!r}: expected B,Hq,Hkv,Lq,Lkv,D (or B,Hq,Hkv,L,D), positive integers, e.g. 4,32,8,4096,128."
        )
    kind, _, value = mask.partition(":")
    if kind == "window" and value.isdigit():
        expression = f"LocalMask({int(value) - 1}, 0)"
    elif kind == "chunked" and value.isdigit():
        expression = f"ChunkedCausalMask({int(value)})"
    else:
        expression = MASK_NAMES.get(mask, mask)
    from .. import decode

    b, hq, hkv, lq, lkv, d = numbers
    call = Call(f"--shape {shape} --mask {mask}", b, hq, hkv, lq, lkv, head_dim=d, dtype=dtype, mask=expression)
    try:
        spec = call.mask_object()
    except Exception as error:
        raise SplashConstraintError(
            f"--mask {mask!r}: {error}. Use causal, full, window:W, chunked:C or an expression such as "
            "'CausalMask(0) & LocalMask(1023)'."
        ) from None
    # the kernel torch_splash.attention takes for such a call without gradients
    if hq % hkv == 0 and decode.takes_by_default(hq, hkv, lq, lkv):
        if decode.refusal(spec, sharded=False, block_sizes=None, dtype=dtype) is None:
            call = dataclasses.replace(call, kernel="decode")
    return call


def visible_pairs(call: Call) -> int | None:
    """The (query, key) pairs a call's mask allows, per batch element and head, for the masks the
    timing rows use (full, causal, a causal window); None where they are data (segment ids) or the
    mask is another."""
    import re

    lq, lkv = call.q_len, call.kv_len
    if call.segment_ids:
        return None
    if call.mask == "FullMask()":
        return lq * lkv
    if call.mask == "CausalMask(0)" and lq == lkv:
        return lq * (lq + 1) // 2
    window = re.fullmatch(r"LocalMask\((\d+), 0\)", call.mask)
    if window and lq == lkv:
        w = min(int(window[1]) + 1, lq)  # each row sees itself and the w - 1 keys before it
        return w * lq - w * (w - 1) // 2
    return None


def forward_flops(call: Call) -> float | None:
    """The forward's matmul flops (q k^T and p v over the visible pairs), the MXU's useful work."""
    pairs = visible_pairs(call)
    return None if pairs is None else 2.0 * pairs * (call.head_dim + call.dv) * call.batch * call.q_heads


def by_name() -> dict[str, Call]:
    return {call.name: call for call in FIDELITY + TRAINING + DECODE}
