"""How JAX programs reach torch: DLPack capsules to JAX arrays on the CPU (zero-copy), the
program lowered to an HLO module for torch_xla's lazy graph, or a program numbered for TorchTPU's
`jax_op`, which exports it itself.

DLPack has a per-call budget: `jax.dlpack.from_dlpack` spends about 130 us per array on a 2-core
CPU (mostly generic dtype and placement work around one C++ call); the C++ call alone takes about
15 us. An attention call moves 5 to 9 arrays, so the public path alone would cost about
1 ms per attention call at small sizes. We call the C++ import directly and fall back to the
public API if it moves.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref

import jax
import jax.numpy as jnp

from . import compat, mosaic


@functools.cache
def _cpu_device():
    return jax.devices("cpu")[0]


_IMPORT = compat.dlpack_import()  # None: a JAX without the direct import, so the public one


class _Capsule:
    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, *args, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def from_capsule(capsule) -> jax.Array:
    """A jax.Array over a CPU DLPack capsule's buffer (the capsule is consumed)."""
    if _IMPORT is not None:
        return _IMPORT(capsule, _cpu_device(), None)
    return jax.dlpack.from_dlpack(_Capsule(capsule))


def hlo_module(
    fn, args: tuple[tuple[tuple[int, ...], str], ...], platform: str, mosaic_version: int | None = None
) -> bytes:
    """`fn` at these (shape, dtype name) arguments, lowered for `platform` ("cpu" or "tpu") to a
    serialized HLO module: what torch_xla splices into its lazy graph.

    Lowering names its platform instead of asking JAX's default backend: a Mosaic kernel lowered
    for TPU is serialized into its custom call and compiled by XLA where it runs, so JAX needs no
    TPU backend and never opens a TPU that torch_xla owns. keep_unused: the caller passes every
    argument as a parameter, so none may be pruned. TPU kernels are serialized at the Mosaic IR
    version `torch_splash_jax.mosaic` decides (`mosaic_version` overrides it, for tests).
    """
    return lowered(fn, args, platform, mosaic_version).compiler_ir("hlo").as_serialized_hlo_module_proto()


def lowered(fn, args: tuple[tuple[tuple[int, ...], str], ...], platform: str, mosaic_version: int | None = None):
    """`fn` lowered as `hlo_module` lowers it, before the conversion to HLO: JAX's `Lowered`."""
    structs = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in args]
    traced = jax.jit(fn, keep_unused=True).trace(*structs)
    if platform != "tpu":
        return traced.lower(lowering_platforms=(platform,))
    version = mosaic.ir_version() if mosaic_version is None else mosaic_version
    with compat.mosaic_ir_version(version):
        return traced.lower(lowering_platforms=(platform,))


_MLIR_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32", "int64": "i64", "bool": "i1"}


def _tensor_type(shape, dtype: str) -> str:
    return f"tensor<{''.join(f'{d}x' for d in shape)}{_MLIR_TYPES[dtype]}>"


def _collectives_module(name: str, inputs: list[str], outputs: list[str], body: list[str], results=()) -> bytes:
    """A StableHLO module of one function from `inputs` (%a0, ...) to `outputs` (the values
    `results` names, by default %r0, ...) as a serialized HLO module. Each collective has a
    channel (handle i + 1) between partitions: for torch_xla's manual-sharding region, where every
    device runs the module on its own shard and without a channel XLA would read the device ids
    as replicas."""
    params = ", ".join(f"%a{i}: {t}" for i, t in enumerate(inputs))
    results = ", ".join(results or (f"%r{i}" for i in range(len(outputs))))
    text = "\n".join(
        [
            f"module @{name} {{",
            f"  func.func public @main({params}) -> ({', '.join(outputs)}) {{",
            *body,
            f"    return {results} : {', '.join(outputs)}",
            "  }",
            "}",
        ]
    )
    return compat.hlo_module_from_stablehlo(text)


def _channel(i: int) -> str:
    return f"channel_handle = #stablehlo.channel_handle<handle = {i + 1}, type = 1>"


def permute_module(args: tuple[tuple[tuple[int, ...], str], ...], pairs: tuple[tuple[int, int], ...]) -> bytes:
    """A module that sends each argument (shape, dtype name) from device `source` to device
    `target` for each (source, target) of `pairs`: one XLA collective permute per argument, as
    JAX's `ppermute` under `shard_map` lowers."""
    listed = ", ".join(f"[{a}, {b}]" for a, b in pairs)
    types = [_tensor_type(shape, dtype) for shape, dtype in args]
    body = [
        f'    %r{i} = "stablehlo.collective_permute"(%a{i}) {{source_target_pairs = dense<[{listed}]> : '
        f"tensor<{len(pairs)}x2xi64>, {_channel(i)}}} : ({t}) -> {t}"
        for i, t in enumerate(types)
    ]
    return _collectives_module("ring_permute", types, types, body)


def exchange_module(
    args: tuple[tuple[tuple[int, ...], str], ...],
    dims: tuple[int, ...],
    moves: tuple[tuple[int, tuple[tuple[int, int], ...]], ...],
    in_turn: bool = False,
) -> bytes:
    """A module that rebuilds each argument (shape, dtype name) from halves other devices send
    (a sequence layout changed shard by shard): each is split into two halves along its dim in
    `dims`, and for each (half, pairs) of `moves`, device `source` of each pair sends that half to
    be the same half of device `target`. A collective permute gives zeros where a device is no
    target, and each device receives each half from one move, so a half is the sum of its moves'
    results: one permute per move and argument. in_turn: the arguments move one after another (an
    optimization barrier ties each to the one before it), for tensors that all exist before the
    exchange, which all at once would each be alive twice, as sent and as received."""
    body, handles = [], itertools.count()
    types = [_tensor_type(shape, dtype) for shape, dtype in args]
    results = []
    for i, ((shape, dtype), dim, t) in enumerate(zip(args, dims, types)):
        source = f"%a{i}"
        if i and in_turn:
            pair = f"{types[i - 1]}, {t}"
            body.append(f'    %o{i}:2 = "stablehlo.optimization_barrier"({results[-1]}, %a{i}) : ({pair}) -> ({pair})')
            results[-1], source = f"%o{i}#0", f"%o{i}#1"
        half = list(shape)
        half[dim] //= 2
        h = _tensor_type(half, dtype)
        for j in (0, 1):
            start = [0] * len(shape)
            start[dim] = j * half[dim]
            limit = [b + n for b, n in zip(start, half)]
            body.append(
                f'    %a{i}h{j} = "stablehlo.slice"({source}) {{start_indices = array<i64: {_ints(start)}>, '
                f"limit_indices = array<i64: {_ints(limit)}>, strides = array<i64: {_ints([1] * len(shape))}>}} "
                f": ({t}) -> {h}"
            )
        sums = {}
        for m, (j, pairs) in enumerate(moves):
            listed = ", ".join(f"[{a}, {b}]" for a, b in pairs)
            body.append(
                f'    %a{i}m{m} = "stablehlo.collective_permute"(%a{i}h{j}) {{source_target_pairs = '
                f"dense<[{listed}]> : tensor<{len(pairs)}x2xi64>, {_channel(next(handles))}}} : ({h}) -> {h}"
            )
            if j in sums:
                body.append(f'    %a{i}s{m} = "stablehlo.add"({sums[j]}, %a{i}m{m}) : ({h}, {h}) -> {h}')
            sums[j] = f"%a{i}s{m}" if j in sums else f"%a{i}m{m}"
        body.append(
            f'    %r{i} = "stablehlo.concatenate"({sums[0]}, {sums[1]}) {{dimension = {dim} : i64}} : ({h}, {h}) -> {t}'
        )
        results.append(f"%r{i}")
    return _collectives_module("sequence_exchange", types, types, body, results)


def _ints(values) -> str:
    return ", ".join(str(v) for v in values)


# Programs by number, for caches outside torch_splash_jax (torch_xla's in-graph functions, TorchTPU's one
# `jax_op`, where the number is a static argument and part of TorchTPU's cache key): numbers are
# never reused, so a cached number can never name another program, and programs are held weakly,
# so a cache keyed on a number keeps no evicted program alive.
_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_NUMBER: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT_NUMBER = itertools.count()
_NUMBERING = threading.Lock()


def program_number(fn) -> int:
    """The number `numbered_program` knows this jitted program by."""
    with _NUMBERING:
        number = _NUMBERS.get(fn)
        if number is None:
            number = _NUMBERS[fn] = next(_NEXT_NUMBER)
            _BY_NUMBER[number] = fn
        return number


def numbered(number: int):
    """The jitted program `program_number` gave this number (it must still be alive)."""
    return _BY_NUMBER[number]


def numbered_program(tensors: list[jax.Array], program: int) -> list[jax.Array]:
    """The program numbered `program` on these arrays: the JAX function TorchTPU's `jax_op`
    exports (for TPU, with `jax.export`) and registers as the custom op torch_splash::tpu_program."""
    out = _BY_NUMBER[program](*tensors)
    return list(out) if isinstance(out, (tuple, list)) else [out]
