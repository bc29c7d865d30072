"""FlexAttention's BlockMasks as splash masks, in eager calls.

Torch's own tables say which blocks are empty, full or partial; only the partial ones are
evaluated, with the BlockMask's mask_mod (and a masking score_mod's mask, `_score_mod.ScoreMask`)
at every (b, h) of the call whose b or h it reads, as torch's kernels evaluate it. Blocks torch
skips are never computed, and nothing (Lq, Lkv)-sized is built. A mask that differs across the
batch gives one mask per batch element; one that differs across heads, a MultiHeadMask. The
conversions are cached by BlockMask (`block_mask_masks`). Key and value of batch 1 serve every
batch element through `fold`: the batch becomes heads of one batch element.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref

import torch
from torch.nn.attention import flex_attention as _torch_flex

from torch_splash_jax import BlockSparseMask, MultiHeadMask, SplashConstraintError, SplashDtypeError, policy

from . import _compat

# Evaluating partial blocks: how many elements one call of the vmapped mask_mod may produce.
_ELEMENTS_PER_EVALUATION = 1 << 22


def evaluate_blocks(mask_mod, b, h, rows: torch.Tensor, cols: torch.Tensor, shape, block_shape):
    """(n, bq, bkv) bool: mask_mod at batch b[i], head h[i] (ints, or (n,) tensors) over the
    blocks (rows[i], cols[i]) of the block grid, False past the lengths. Called as torch's
    create_mask calls it: vmapped, with 0-d index tensors, and never at an index past the lengths
    (a captured (B, L) tensor indexed there would fail)."""
    (q_len, kv_len), (bq, bkv) = shape, block_shape
    device = rows.device
    b, h = (torch.full_like(rows, i) if isinstance(i, int) else i for i in (b, h))
    q = rows[:, None] * bq + torch.arange(bq, device=device)  # (n, bq)
    kv = cols[:, None] * bkv + torch.arange(bkv, device=device)  # (n, bkv)
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    fn = torch.vmap(fn, in_dims=(0, 0, 0, 0))
    if torch.compiler.is_compiling():  # n is data there, unknown while tracing: one evaluation
        chunks = [slice(None)]
    else:
        step = max(1, _ELEMENTS_PER_EVALUATION // (bq * bkv))
        chunks = [slice(start, start + step) for start in range(0, rows.numel(), step)]
    out = []
    for part in chunks:
        qs, kvs = q[part], kv[part]
        with _compat.mask_mod_indexing():
            allowed = fn(b[part], h[part], qs.clamp(max=q_len - 1), kvs.clamp(max=kv_len - 1))
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise SplashDtypeError(
                f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} returned "
                f"{getattr(allowed, 'dtype', type(allowed).__name__)}: it must return a bool tensor."
            )
        out.append(allowed & (qs < q_len)[:, :, None] & (kvs < kv_len)[:, None, :])
    return torch.cat(out) if out else torch.zeros(0, bq, bkv, dtype=torch.bool, device=device)


def _block_kinds(block_mask, rows: int, cols: int) -> torch.Tensor:
    """(B', H', rows, cols) int8 from torch's ordered tables, on their device: 0 skipped, 1 partial
    (mask_mod applies), 2 full."""

    def dense(num_blocks, indices):
        listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
        target = torch.where(listed, indices.long(), cols)  # unlisted: a column past the end
        table = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.int8, device=indices.device)
        return table.scatter(-1, target, torch.ones_like(target, dtype=torch.int8))[..., :cols]

    kinds = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    if block_mask.full_kv_num_blocks is not None:
        kinds = torch.where(dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices) > 0, 2, kinds)
    return kinds[..., :rows, :]


def _head_mask(mask_mod, b: int, h: int, kinds: torch.Tensor, shape, block_shape, device) -> BlockSparseMask:
    """One (b, h)'s mask: torch's block kinds (CPU), its partial blocks evaluated on `device`
    (where the mask_mod's captured tensors live)."""
    rows, cols = torch.nonzero(kinds == 1, as_tuple=True)
    blocks = evaluate_blocks(mask_mod, b, h, rows.to(device), cols.to(device), shape, block_shape)
    return stored_mask(kinds, rows, cols, blocks.cpu(), shape, block_shape)


def stored_mask(kinds, rows, cols, blocks, shape, block_shape) -> BlockSparseMask:
    """A mask from torch's block kinds (rows, cols) int8 and its partial blocks evaluated (block
    (rows[i], cols[i]) is blocks[i]), all on the CPU."""
    kinds = kinds.clone()
    # a partial block whose elements all hold (or none) is full (or skipped)
    some, every = blocks.flatten(1).any(1), blocks.flatten(1).all(1)
    kinds[rows[~some], cols[~some]] = 0
    kinds[rows[every], cols[every]] = 2
    partial = some & ~every
    rows, cols, blocks = rows[partial], cols[partial], blocks[partial]
    index = torch.full(kinds.shape, -1, dtype=torch.int32)
    index[rows, cols] = torch.arange(rows.numel(), dtype=torch.int32)
    return BlockSparseMask(kinds.numpy(), index.numpy(), blocks.numpy(), shape, block_shape)


# The masks of the BlockMasks converted last, by id: a model's layers share one BlockMask, and its
# conversion (the partial blocks evaluated, the masks hashed) costs 0.03 s at 8K tokens and 0.3 s at
# 128K per call. An entry serves a call while its BlockMask is alive and the call's shape, the
# BlockMask's mask_mod and its traced code (the scalars it captured included), its own tables and
# every tensor the mask_mod reads are the same, the tensors the same objects at the same version (an
# in-place change counts). A mask_mod that cannot be traced is converted at every call.
# A score_mod's mask is kept with it: by the BlockMask and the score_mod, alive while both are (the
# BlockMask when there is one, else the score_mod). Layers run in threads: a lock guards the cache.
_CONVERTED: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
_CONVERTED_LOCK = threading.Lock()


def _versions(tensors: tuple) -> tuple:
    return tuple((t, _compat.tensor_version(t)) for t in tensors)


def _same(held: tuple, now: tuple) -> bool:
    return len(held) == len(now) and all(t is u and version == w for (t, version), (u, w) in zip(held, now))


def block_mask_masks(block_mask, batch: int, heads: int, q_len: int, kv_len: int, score_mask=None, device=None) -> list:
    """The masks a BlockMask means for a (batch, heads, Lq, Lkv) call: one per batch element (one
    mask, or a MultiHeadMask), all equal when the mask does not depend on b. score_mask: the mask
    of a masking score_mod (`_score_mod.ScoreMask`), combined with the BlockMask's (block_mask
    may then be None: every block is evaluated, on `device`)."""
    if block_mask is not None:
        check_block_mask(block_mask, batch, heads, q_len, kv_len)
        device = block_mask.kv_num_blocks.device
    mask_mod = combined(block_mask, score_mask)
    reads, captured, code = _compat.mask_mod_trace(mask_mod, device)
    if captured is None:
        return _convert(block_mask, mask_mod, score_mask is not None, reads, batch, heads, q_len, kv_len, device)
    own = () if block_mask is None else _own_tensors(block_mask)
    now = _versions(tuple(t for t in own if t is not None) + captured)
    block_shape = DEFAULT_BLOCK if block_mask is None else tuple(block_mask.BLOCK_SIZE)
    signature = ((batch, heads, q_len, kv_len), block_shape, code)
    owner = block_mask if block_mask is not None else score_mask.score_mod
    parts = (getattr(block_mask, "mask_mod", None), getattr(score_mask, "score_mod", None))
    key = (id(block_mask), id(parts[1]))
    with _CONVERTED_LOCK:
        held = _CONVERTED.get(key)
        if held is not None:
            alive, held_parts, held_signature, held_tensors, masks = held
            same = all(a is b for a, b in zip(held_parts, parts)) and held_signature == signature
            if alive() is owner and same and _same(held_tensors, now):
                _CONVERTED.move_to_end(key)
                return masks
    masks = _convert(block_mask, mask_mod, score_mask is not None, reads, batch, heads, q_len, kv_len, device)
    try:
        alive = weakref.ref(owner, functools.partial(_forget, key))
    except TypeError:  # a score_mod that takes no weak reference is converted at every call
        return masks
    with _CONVERTED_LOCK:
        _CONVERTED[key] = (alive, parts, signature, now, masks)
        while len(_CONVERTED) > policy.FLEX_MASKS:
            _CONVERTED.popitem(last=False)
    return masks


def _forget(key, _, cache=_CONVERTED, lock=_CONVERTED_LOCK) -> None:
    """Drops an entry whose BlockMask (or score_mod) died; bound to the cache itself, since it may
    run while the interpreter exits, after this module's globals are gone."""
    with lock:
        cache.pop(key, None)


def _own_tensors(block_mask) -> tuple:
    return (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)


# torch's own default BLOCK_SIZE: the blocks a score_mod's mask is evaluated in without a BlockMask.
DEFAULT_BLOCK = (128, 128)


def combined(block_mask, score_mask):
    """The mask_mod a call applies: the BlockMask's, the score_mod's mask, or both."""
    if score_mask is None:
        return block_mask.mask_mod
    if block_mask is None:
        return score_mask
    return _torch_flex.and_masks(block_mask.mask_mod, score_mask)


def call_block_kinds(block_mask, scored: bool, shape, block_shape, device) -> torch.Tensor:
    """(B', H', rows, cols) int8 block kinds (`_block_kinds`) of a call; with a score_mod's mask,
    blocks full for the BlockMask are partial (the score_mod's mask applies there too), and
    without a BlockMask every block is."""
    rows, cols = -(-shape[0] // block_shape[0]), -(-shape[1] // block_shape[1])
    if block_mask is None:
        return torch.ones(1, 1, rows, cols, dtype=torch.int8, device=device)
    kinds = _block_kinds(block_mask, rows, cols)
    return kinds.clamp(max=1) if scored else kinds


def check_block_mask(block_mask, batch: int, heads: int, q_len: int, kv_len: int) -> None:
    if not isinstance(block_mask, _torch_flex.BlockMask):
        raise SplashDtypeError(
            f"block_mask must be a torch BlockMask (create_block_mask) or None, got {type(block_mask).__name__}."
        )
    if tuple(block_mask.seq_lengths) != (q_len, kv_len):
        raise SplashConstraintError(
            f"block_mask is for (Lq, Lkv) = {tuple(block_mask.seq_lengths)} but the call has ({q_len}, {kv_len}): "
            "build it with create_block_mask(mask_mod, B, H, Lq, Lkv) at this call's lengths."
        )
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise SplashConstraintError(
            f"block_mask has (B, H) = ({mask_batch}, {mask_heads}) but the call has ({batch}, {heads}) query "
            "heads: each must be 1 (broadcast) or the call's."
        )


def _convert(block_mask, mask_mod, scored: bool, reads: tuple, batch, heads, q_len, kv_len, device) -> list:
    block_shape = DEFAULT_BLOCK if block_mask is None else tuple(int(n) for n in block_mask.BLOCK_SIZE)
    kinds = call_block_kinds(block_mask, scored, (q_len, kv_len), block_shape, device).cpu()
    keys, assign = evaluation_keys(*reads[:2], *kinds.shape[:2], batch, heads)
    masks = [_head_mask(mask_mod, b, h, kinds[tb, th], (q_len, kv_len), block_shape, device) for b, h, tb, th in keys]
    return per_batch(masks, assign)


def evaluation_keys(reads_b: bool, reads_h: bool, mask_batch: int, mask_heads: int, batch: int, heads: int):
    """Where a BlockMask's mask_mod is evaluated for a (batch, heads) call: the distinct (b, h it
    is evaluated at, b, h of torch's tables), and for each batch element and head the index of its
    own. A mask_mod that never reads b (or h) is evaluated once for every batch element (head)."""
    keys, assign = {}, []
    for b in range(batch):
        row = []
        for h in range(heads):
            key = (b if reads_b else 0, h if reads_h else 0, b if mask_batch > 1 else 0, h if mask_heads > 1 else 0)
            row.append(keys.setdefault(key, len(keys)))
        assign.append(tuple(row))
    return tuple(keys), tuple(assign)


def per_batch(masks: list, assign: tuple) -> list:
    """One mask per batch element (a MultiHeadMask where its heads differ) from the masks evaluated
    and each (b, h)'s index among them; equal masks become one object."""
    seen = {}
    masks = [seen.setdefault(m, m) for m in masks]
    out = []
    for row in assign:
        per_head = [masks[i] for i in row]
        mask = per_head[0] if all(m is per_head[0] for m in per_head) else MultiHeadMask(tuple(per_head))
        out.append(seen.setdefault(mask, mask))
    return out


def fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, ...) as (1, B * Hq, ...), heads ordered (kv head, b, group member): one batch
    element whose query heads group onto the kv heads as each b's did (query head h uses kv head
    h // (heads / kv heads)), so keys and values of batch 1 serve every b uncopied."""
    batch, heads = t.shape[:2]
    return t.unflatten(1, (kv_heads, heads // kv_heads)).transpose(0, 1).reshape(1, batch * heads, *t.shape[2:])


def unfold(t: torch.Tensor, batch: int, kv_heads: int) -> torch.Tensor:
    """`fold`'s inverse: (1, B * Hq, ...) back to (B, Hq, ...)."""
    group = t.shape[1] // (batch * kv_heads)
    return t.reshape(kv_heads, batch, group, *t.shape[2:]).transpose(0, 1).reshape(batch, -1, *t.shape[2:])


def _folded_heads(batch: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(b, h) of each query head of `fold`'s one batch element."""
    group = heads // kv_heads
    return [(b, kv * group + g) for kv in range(kv_heads) for b in range(batch) for g in range(group)]


def folded_assign(assign: tuple, kv_shape: tuple, folding: bool) -> tuple:
    if not folding:
        return assign
    return (tuple(assign[b][h] for b, h in _folded_heads(len(assign), len(assign[0]), kv_shape[1])),)


def folded_masks(masks: list, heads: int, kv_heads: int) -> list:
    """One batch element's mask (one, or per head) from one per b, heads as `fold` orders them."""
    if all(m is masks[0] for m in masks) and not isinstance(masks[0], MultiHeadMask):
        return masks[:1]
    per_head = [m.masks[h] if isinstance(m, MultiHeadMask) else m for m in masks for h in range(heads)]
    folded = [per_head[b * heads + h] for b, h in _folded_heads(len(masks), heads, kv_heads)]
    return [folded[0] if all(m is folded[0] for m in folded) else MultiHeadMask(tuple(folded))]
