"""FlexAttention under torch.compile, and the gradients of both paths.

Under torch.compile the BlockMask is data of the graph, not an object Python can read: it is
converted inside the graph (`graph_tables`), and the custom ops `flex_forward` / `flex_backward`
build the masks from those tensors where they run (`graph_masks`), then call the kernels as an
eager call does. `gradients` gives dq, dk, dv from the output's and the logsumexp's gradients, for
the compiled ops and the eager `flex._WithLogsumexp` alike.
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np
import torch

from torch_splash_jax import SplashConstraintError, policy

from . import _checks, _compat, _flex_masks, _score_mod
from .api import attention, attention_backward


def refuse_double_backward() -> None:
    if torch.is_grad_enabled():  # create_graph=True
        raise SplashConstraintError(
            "torch_splash.flex_attention supports one backward pass, not double backward "
            "(create_graph=True): the splash dq/dkv kernels have no derivative of their own."
        )


def gradients(query, key, value, out, lse, d_out, d_lse, mask, *, scale=None, soft_cap=None):
    """dq, dk, dv from the output's gradient d_out and the logsumexp's d_lse (None: none).

    With g = d_lse, the logits' gradient is dS = P * (dP - (D - g)), D = rowsum(dO * O) the row
    statistic the dq/dkv kernels compute: the kernels run on value and d_out each with one more
    column, of ones in value and g in d_out, and a 0 in out, so that dP gains g and D stays; the
    extra column of dv is dropped. A row that sees no key has P = 0, so its g adds nothing."""
    if d_lse is None or not bool(d_lse.ne(0).any()):
        return attention_backward(query, key, value, out, lse, d_out, mask, scale=scale, soft_cap=soft_cap)
    ones = value.new_ones(value.shape[:-1] + (1,))
    g = torch.nan_to_num(d_lse, nan=0.0, posinf=0.0, neginf=0.0).to(d_out.dtype)[..., None]
    value, out, d_out = (
        torch.cat([value, ones], -1),
        torch.cat([out, out.new_zeros(out.shape[:-1] + (1,))], -1),
        torch.cat([d_out, g], -1),
    )
    dq, dk, dv = attention_backward(query, key, value, out, lse, d_out, mask, scale=scale, soft_cap=soft_cap)
    return dq, dk, dv[..., :-1]


# Under torch.compile the BlockMask is data of the graph, not an object this module can read: it is
# converted inside the graph. Torch's tables become block kinds; the partial blocks (how many is
# data: `partial_blocks`, a size Dynamo leaves unknown) are evaluated with the mask_mod, traced by
# Dynamo; and the `flex_forward` / `flex_backward` ops build the masks from those tensors where
# they run, then call the kernels as an eager call does. A new packing of documents is new data for
# the same graph.


@_compat.constant_while_tracing
def _reads(mask_mod, device) -> tuple[bool, bool]:
    """Whether a mask_mod reads b and h, decided while Dynamo traces (every mask_mod of the same
    code and captured functions reads the same)."""
    reads, _, _ = _compat.mask_mod_trace(mask_mod, device)
    return reads[0], reads[1]


@_compat.constant_while_tracing
def _call_text(assign: tuple, shape: tuple, block_shape: tuple, scale, cap) -> str:
    return json.dumps(dict(assign=assign, shape=shape, block_shape=block_shape, scale=scale, soft_cap=cap))


@functools.lru_cache(maxsize=policy.PLAN_TEXTS)
def _read_call(text: str) -> dict:
    call = json.loads(text)
    call["assign"] = tuple(tuple(row) for row in call["assign"])
    return call


def traced(query, key, value, block_mask, scale, cap, score_mod=None, reads=None):
    """What flex_attention runs under torch.compile: (out, lse). score_mod: a masking score_mod
    whose mask reads `reads` of (b, h, q_idx, kv_idx)."""
    batch, heads, q_len, _ = _checks.static_shape(query)
    kv_len = _checks.static_shape(key)[2]
    if block_mask is None and score_mod is None:
        table = where = blocks = None
        assign, block_shape = ((0,) * heads,) * batch, (q_len, kv_len)
    else:
        table, where, blocks, assign, block_shape = graph_tables(
            block_mask, batch, heads, (q_len, kv_len), score_mod, reads, query.device
        )
    kv_batch, kv_heads = _checks.static_shape(key)[:2]
    folding = kv_batch != batch
    assign = _flex_masks.folded_assign(assign, (kv_batch, kv_heads), folding)
    text = _call_text(assign, (q_len, kv_len), block_shape, _checks.static_float(scale), _checks.static_float(cap))
    if not folding:
        return flex_forward(query, key, value, table, where, blocks, text)
    out, lse = flex_forward(_flex_masks.fold(query, kv_heads), key, value, table, where, blocks, text)
    return _flex_masks.unfold(out, batch, kv_heads), _flex_masks.unfold(lse, batch, kv_heads)


def graph_tables(block_mask, batch: int, heads: int, shape=None, score_mod=None, reads=None, device=None):
    """A BlockMask (and a masking score_mod's mask) as the compiled path's graph computes it for a
    (batch, heads) call: the block kinds of each (b, h) evaluated (K, rows, cols) int8,
    `partial_blocks` of them, those blocks evaluated (n + 1, bq, bkv) bool (the stand-in's
    included), for each batch element and head the index of its own among the K, and the block
    shape."""
    score_mask = None if score_mod is None else _score_mod.ScoreMask(score_mod)
    if block_mask is not None:
        q_len, kv_len, *block_shape = _checks.static_ints(*block_mask.seq_lengths, *block_mask.BLOCK_SIZE)
        device = block_mask.kv_num_blocks.device
        mask_reads = _reads(block_mask.mask_mod, device)
    else:
        (q_len, kv_len), block_shape, mask_reads = shape, list(_flex_masks.DEFAULT_BLOCK), (False, False)
    if reads is not None:
        mask_reads = (mask_reads[0] or reads[0], mask_reads[1] or reads[1])
    kinds = _flex_masks.call_block_kinds(block_mask, score_mask is not None, (q_len, kv_len), block_shape, device)
    keys, assign = _flex_masks.evaluation_keys(*mask_reads, *_checks.static_shape(kinds)[:2], batch, heads)
    table = torch.stack([kinds[tb, th] for _, _, tb, th in keys])
    where = partial_blocks(table)
    b = torch.tensor([key[0] for key in keys], device=where.device)[where[:, 0]]
    h = torch.tensor([key[1] for key in keys], device=where.device)[where[:, 0]]
    mask_mod = _flex_masks.combined(block_mask, score_mask)
    blocks = _flex_masks.evaluate_blocks(mask_mod, b, h, where[:, 1], where[:, 2], (q_len, kv_len), block_shape)
    return table, where, blocks, assign, tuple(block_shape)


@torch.library.custom_op("torch_splash::partial_blocks", mutates_args=())
def partial_blocks(kinds: torch.Tensor) -> torch.Tensor:
    """(n + 1, 3) int64: (table, row, column) of each partial block (kind 1) of the (K, rows, cols)
    block kinds, then one stand-in (0, 0, 0) that the masks leave out: the count is data, and
    tracing takes it as at least 1."""
    return torch.cat([torch.nonzero(kinds == 1), kinds.new_zeros((1, 3), dtype=torch.int64)])


@partial_blocks.register_fake
def _(kinds):
    return kinds.new_empty((_compat.dynamic_size(1), 3), dtype=torch.int64)


def graph_masks(table, where, blocks, assign: tuple, shape: tuple, block_shape: tuple) -> list:
    """One mask per batch element from `graph_tables`' tensors, where the compiled path's ops run;
    kept by content (`_GRAPH_MASKS`)."""
    key = _content_key(repr((assign, shape, block_shape)), (table, where, blocks))
    masks = _GRAPH_MASKS.get(key)
    if masks is None:  # two threads may both build them: equal masks, one kept
        masks = _GRAPH_MASKS.setdefault(key, _built_masks(table, where, blocks, assign, shape, block_shape))
    return masks


# The masks built last, by the content of the tensors they were built from. Every layer that passes
# one BlockMask, and the backward, gives its op equal tensors (often the very same ones: AOTAutograd
# merges common subexpressions, though not always the evaluated blocks), and building the masks
# costs 0.17 s at 128K tokens, where their key costs 0.02 s.
_GRAPH_MASKS = policy.Recent(policy.FLEX_MASKS)


def _content_key(text: str, tensors) -> bytes:
    digest = hashlib.blake2b(text.encode())
    for t in tensors:
        array = t.cpu().numpy()
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.packbits(array) if array.dtype == bool else array.tobytes())
    return digest.digest()


def _built_masks(table, where, blocks, assign: tuple, shape: tuple, block_shape: tuple) -> list:
    table, where, blocks = table.cpu(), where[:-1].cpu(), blocks[:-1].cpu()  # without the stand-in
    masks = []
    for k in range(table.shape[0]):
        own = where[:, 0] == k
        masks.append(_flex_masks.stored_mask(table[k], where[own, 1], where[own, 2], blocks[own], shape, block_shape))
    return _flex_masks.per_batch(masks, assign)


def _masks_of(table, where, blocks, call: str) -> tuple[list, dict]:
    """For a call of the compiled path's ops: one mask per batch element (None: every key), and
    the options of `attention`."""
    options = _read_call(call)
    kwargs = dict(scale=options["scale"], soft_cap=options["soft_cap"])
    if table is None:
        return [None] * len(options["assign"]), kwargs
    shape, block_shape = tuple(options["shape"]), tuple(options["block_shape"])
    return graph_masks(table, where, blocks, options["assign"], shape, block_shape), kwargs


@torch.library.custom_op("torch_splash::flex_forward", mutates_args=())
def flex_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor | None,
    where: torch.Tensor | None,
    blocks: torch.Tensor | None,
    call: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention's output and logsumexp (torch's convention) for the masks these tensors make."""
    masks, kwargs = _masks_of(table, where, blocks, call)
    out, lse = by_batch_element(attention, (query, key, value), masks, return_lse=True, **kwargs)
    return out.contiguous(), lse.contiguous()  # as the fake


@flex_forward.register_fake
def _(query, key, value, table, where, blocks, call):
    return query.new_empty(query.shape[:-1] + value.shape[-1:]), query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torch_splash::flex_backward", mutates_args=())
def flex_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    d_lse: torch.Tensor | None,
    table: torch.Tensor | None,
    where: torch.Tensor | None,
    blocks: torch.Tensor | None,
    call: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of flex_forward from its outputs' gradients, by the dq/dkv kernels."""
    masks, kwargs = _masks_of(table, where, blocks, call)
    grads = by_batch_element(gradients, (query, key, value, out, lse, d_out, d_lse), masks, **kwargs)
    return tuple(t.contiguous() for t in grads)  # as the fake


@flex_backward.register_fake
def _(query, key, value, out, lse, d_out, d_lse, table, where, blocks, call):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)  # contiguous


def _save_for_backward(ctx, inputs, output):
    query, key, value, table, where, blocks, call = inputs
    ctx.call, ctx.table = call, table is not None
    ctx.save_for_backward(query, key, value, *output, *((table, where, blocks) if ctx.table else ()))


def _flex_gradients(ctx, d_out, d_lse):
    refuse_double_backward()
    query, key, value, out, lse, *mask = ctx.saved_tensors
    d_out = torch.zeros_like(out) if d_out is None else d_out
    dq, dk, dv = flex_backward(query, key, value, out, lse, d_out, d_lse, *(mask or (None,) * 3), ctx.call)
    return dq, dk, dv, None, None, None, None


flex_forward.register_autograd(_flex_gradients, setup_context=_save_for_backward)


def by_batch_element(fn, tensors: tuple, masks: list, **options):
    """``fn(*tensors, mask, **options)`` with one mask per batch element (None: every key): one call
    where the masks are one, else one per batch element, its results concatenated."""
    if all(m is masks[0] for m in masks):
        return fn(*tensors, masks[0], **options)
    parts = [
        fn(*(None if t is None else t[b : b + 1] for t in tensors), masks[b], **options) for b in range(len(masks))
    ]
    return tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)
