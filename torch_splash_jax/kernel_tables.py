"""A plan's splash kernel and the block tables it runs with.

An unsharded plan whose heads share one structured mask gets a kernel with its block tables
(MaskInfos, built by `tables`) as constants. A plan sharded along the query sequence, or over heads
with one mask per head, and a mask read from stored blocks take their tables as inputs instead
(every device's, split along the shards, or rounded up in shape), so that one program serves every
device and every mask of the same shapes. `KernelTables` holds which it is, the tables, and the
kernel for the tables a program is given; `splash_program.Program` builds on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import compat
from . import masks as _masks
from . import tables as _tables
from .plan import Plan

_splash, _, _mask_info = compat.splash_modules()


class KernelTables:
    """One plan's block tables (constants, or inputs with `tables()` and `table_axes()`) and its
    splash kernel."""

    def __init__(self, plan: Plan):
        self.plan = plan
        # Plans sharded along the query sequence, or over heads with one mask per head, take
        # their block tables (and query positions) as inputs, one slice per device, since every
        # device runs this same program: `tables()` gives them, `table_axes()` their sharding.
        self.sharded = plan.q_shards > 1 or plan.head_shards > 1
        # An unsharded mask read from stored blocks (data, or one mask per head) takes its tables
        # and partial blocks as inputs too, in shapes rounded up (`tables.partial_mask_info`): a
        # mask with other contents in the same shapes (documents packed anew) runs the same jitted
        # functions, so neither JAX nor torch_xla compiles again.
        self.stored = not self.sharded and _masks.shared_structured_mask(plan.mask) is None
        self.takes_tables = self.sharded or self.stored
        # JAX's tables only where one of its kernels runs (the active-block kernels, which serve
        # unsharded calls only, add their own: `splash_program.Program`)
        jax_kernels = "splash" in (plan.forward_kernel, plan.backward_kernel)
        self._infos = _table_infos(plan, rounded=self.stored) if self.takes_tables and jax_kernels else None
        self._table_arrays = self._flat_tables() if self._infos is not None else []
        # A sharded plan's stored partial blocks are the same on every device: constants, made
        # outside any trace.
        self._partial_blocks = [
            None if info is None or info.partial_mask_blocks is None else jnp.asarray(info.partial_mask_blocks)
            for info in (self._infos[1] if self.sharded and self._infos is not None else ())
        ]
        # A mask with no allowed pair at all gets no kernel (JAX's table builder asserts on it,
        # and no output block would ever be written): the answer is 0 with zero gradients.
        # (a sharded plan without JAX's kernels: the active kernels' lists say, `Program`)
        if self._infos is not None:
            self.no_pairs = not self._infos[1][0].block_mask.any()
        else:
            self.no_pairs = not self.sharded and not _has_allowed_pair(plan)
        self._kernel = None if self.no_pairs or self.takes_tables else _build_kernel(plan)

    @property
    def kernel(self):
        """The splash kernel with this plan's block tables as constants (what the TPU time
        estimate reads); None for a sharded plan, and without allowed pairs."""
        if self._kernel is None and self.stored and not self.no_pairs:
            infos = (self._infos or _table_infos(self.plan, rounded=True))[1]
            self._kernel = _kernel(self.plan, [None if i is None else _only_shard(i) for i in infos], None)
        return self._kernel

    def tables(self) -> list[np.ndarray]:
        """A sharded program's extra inputs, the tables of every device: the query positions
        (S, P) of a mask function, then each kernel's data_next, mask_next (when partial blocks
        are stored) and block_mask (S, H or 1, q blocks, width). S is the query-sequence shards,
        H all query heads (per-head tables only)."""
        return self._table_arrays

    def _flat_tables(self) -> list[np.ndarray]:
        positions, infos = self._infos
        tables = [] if positions is None else [positions]
        for info in infos:
            if info is not None:
                tables += _per_device(info)
                if self.stored and info.partial_mask_blocks is not None:
                    tables.append(info.partial_mask_blocks[None])  # the leading shard axis every table has
        return tables

    def table_axes(self) -> list[tuple[str, ...]]:
        """What each of `tables()` is split along, axis by axis from the first: ("seq",) or
        ("seq", "heads"); a device's slice keeps a leading axis of 1 (`device_tables`)."""
        if self.stored:  # one device's: every device holds them whole
            return [("seq",)] * len(self.tables())
        return [("seq", "heads") if t.ndim == 4 and t.shape[1] > 1 else ("seq",) for t in self.tables()]

    def device_tables(self, seq_shard: int, head_shard: int = 0) -> list[np.ndarray]:
        """The slice of `tables()` the device holding that sequence shard and head shard takes."""
        heads = slice(head_shard * self.plan.num_q_heads, (head_shard + 1) * self.plan.num_q_heads)
        return [
            t[seq_shard : seq_shard + 1, heads] if "heads" in axes else t[seq_shard : seq_shard + 1]
            for t, axes in zip(self.tables(), self.table_axes())
        ]

    def blocks_per_shard(self) -> list[int]:
        """For a sequence-sharded program: the forward kernel's blocks each shard computes (the
        non-empty entries of its block tables, every head's where heads have their own), the
        measure of how evenly causal work is spread."""
        masks = self._infos[1][0].block_mask
        return [int(n) for n in (masks != 0).reshape(self.plan.q_shards, -1).sum(axis=1)]

    def _kernel_for(self, tables):
        """The kernel, and the arrays of its block tables the vjp may keep: a sharded program's
        are this device's slice of its inputs (leading axis 1), as are a stored-block mask's (its
        partial blocks too); the others' are constants."""
        if not self.takes_tables:
            return self.kernel, []
        positions, infos = self._infos
        given = iter(tables)
        q_sequence = None if positions is None else next(given)[0]
        mine, kept = [], [] if q_sequence is None else [q_sequence]
        for info, partial_blocks in zip(infos, self._partial_blocks or [None] * len(infos)):
            if info is None:
                mine.append(None)
                continue
            data_next, *mask_next, block_mask = (next(given)[0] for _ in _per_device(info))
            kept += [data_next, *mask_next, block_mask]
            if self.stored and info.partial_mask_blocks is not None:
                partial_blocks = next(given)[0]
                kept.append(partial_blocks)
            mine.append(compat.mask_info(data_next, (mask_next or [None])[0], block_mask, partial_blocks, q_sequence))
        mask_function = None if positions is None else _sharded_bound_mask(self.plan).mask_function
        return _kernel(self.plan, mine, mask_function), kept

    def devices_with_work(self) -> list[bool]:
        """For a sharded program: whether each sequence shard's tables have a block to compute."""
        if self.no_pairs:
            return [False] * self.plan.q_shards
        block_mask = self._infos[1][0].block_mask
        return [bool(b) for b in (block_mask != 0).reshape(block_mask.shape[0], -1).any(axis=1)]

    def has_work(self, tables):
        """Whether this device's slice of a sharded program's tables has a block to compute: a
        traced bool, or True when every device has one (a ring step where a device has none skips
        its kernels there)."""
        if all(self.devices_with_work()):
            return True
        positions, (forward, *_) = self._infos
        block_mask = tables[(positions is not None) + len(_per_device(forward)) - 1]
        return jnp.any(block_mask != 0)


def _jax_block_sizes(plan: Plan) -> _splash.BlockSizes:
    fields = plan.block_sizes()
    for layout in ("q_layout", "k_layout", "v_layout"):
        if layout in fields:
            fields[layout] = _splash.QKVLayout[fields[layout]]
    return _splash.BlockSizes(**fields)


def _build_kernel(plan: Plan) -> _splash.SplashAttentionKernel:
    """The kernel of an unsharded plan, its block tables constants of the program."""
    shared = _masks.shared_structured_mask(plan.mask)
    if shared is None:
        _, infos = _table_infos(plan)
        return _kernel(plan, [None if info is None else _only_shard(info) for info in infos], None)
    bound = _masks.bind(shared, 1, plan.q_len_padded, plan.kv_len_padded, plan.kv_len).masks[0]
    mask_function = getattr(bound, "mask_function", None)
    infos = [
        None
        if layout is None
        else jax.tree.map(
            jnp.array,
            _tables.mask_info(
                shared, plan.q_len_padded, plan.kv_len_padded, plan.kv_len, *layout, mask_function is not None
            ),
        )
        for layout in _kernel_tables(plan)
    ]
    return _kernel(plan, infos, mask_function)


def _has_allowed_pair(plan: Plan) -> bool:
    """Whether any head's mask allows a (query, key) pair: from block bounds for structured masks
    (a dense (H, Lq, Lkv) evaluation of per-head masks would need 50 GB at 112K tokens)."""
    blocks = plan.block_sizes()
    heads = plan.mask.masks if isinstance(plan.mask, _masks.MultiHeadMask) else (plan.mask,)
    for mask in heads:
        if not mask.blockwise:
            allowed = mask.dense(plan.q_len, plan.kv_len).any()
        else:
            allowed = _tables.block_mask_table(
                mask, plan.q_len_padded, plan.kv_len_padded, plan.kv_len, blocks["block_q"], blocks["block_kv"]
            ).any()
        if allowed:
            return True
    return False


def _kernel_tables(plan: Plan):
    """(block_shape, is_dkv, shrink_grid) of each kernel's tables, in the order the kernel takes
    them: forward, dq (None when fused into dkv), dkv."""
    b = _jax_block_sizes(plan)
    fused = b.use_fused_bwd_kernel
    return [
        ((b.block_q, b.block_kv), False, True),
        None if fused else ((b.block_q_dq, b.block_kv_dq), False, True),
        ((b.block_q_dkv, b.block_kv_dkv), True, not fused),
    ]


def _sharded_bound_mask(plan: Plan) -> _masks.BoundMask:
    return _masks.BoundMask(
        _masks.shared_structured_mask(plan.mask), plan.q_len_padded, plan.kv_len_padded, plan.kv_len
    )


def _table_infos(plan: Plan, rounded: bool = False) -> tuple[np.ndarray | None, list]:
    """Every device's block tables: (the query positions (S, P) when the kernel evaluates a shared
    structured mask from them, else None; the forward, dq and dkv MaskInfos (None for a dq fused
    into dkv), whose tables have a leading sequence-shard axis and then a head axis). rounded:
    stored tables in rounded shapes (`tables.partial_mask_info`)."""
    shared = _masks.shared_structured_mask(plan.mask)
    positions = plan.shard_positions()
    kv_len = plan.kv_len
    if shared is not None and not plan.ring:
        build = functools.partial(_tables.sharded_mask_info, shared, positions)
    else:  # stored blocks; a ring step's keys are not the ones the kernel counts, so it always has them
        heads = plan.mask.masks if isinstance(plan.mask, _masks.MultiHeadMask) else (plan.mask,)
        rows = np.where(np.arange(plan.q_len_padded) < plan.q_len, positions, -1)  # padding rows: hidden
        kv_len *= plan.q_shards if plan.ring else 1
        build = functools.partial(
            _tables.partial_mask_info,
            heads,
            rows,
            plan.q_len * plan.q_shards,
            head_shards=plan.head_shards,
            kv_positions=plan.ring_kv_positions() if plan.ring else None,
            rounded=rounded,
        )
        positions = None
    infos = [None if layout is None else build(plan.kv_len_padded, kv_len, *layout) for layout in _kernel_tables(plan)]
    return positions, infos


def _per_device(info: _mask_info.MaskInfo) -> list[np.ndarray]:
    """The tables of a MaskInfo that differ from device to device, in the order programs take them."""
    return [t for t in (info.data_next, info.mask_next, info.block_mask) if t is not None]


def _only_shard(info: _mask_info.MaskInfo) -> _mask_info.MaskInfo:
    """An unsharded plan's MaskInfo as constants: its one shard's tables, every head's."""
    tables = {name: getattr(info, name) for name in ("data_next", "mask_next", "block_mask")}
    return jax.tree.map(jnp.asarray, info._replace(**{k: t[0] for k, t in tables.items() if t is not None}))


def _kernel(plan: Plan, infos: list, mask_function) -> _splash.SplashAttentionKernel:
    """The kernel `make_splash_mha/mqa` would build, from the forward, dq and dkv MaskInfos."""
    return compat.splash_kernel(
        *infos,
        block_sizes=_jax_block_sizes(plan),
        is_mqa=plan.is_mqa,
        save_residuals=False,
        mask_value=_splash.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=plan.soft_cap,
        residual_checkpoint_name=None,
        mask_function=mask_function,
        interpret=plan.platform != "tpu",
    )
