"""The JAX side's one home of the private or unstable APIs torch_splash relies on, and of its
version ranges (torch_splash._compat is the torch side's: torch and torch_xla internals).

JAX's splash kernel is `jax.experimental` (its constructor, MaskInfo's fields and the residuals its
custom_vjp keeps change between releases); lowering at a chosen Mosaic IR version, importing a
DLPack capsule cheaply and compiling an HLO module for a TPU topology reach into `jax._src`; the
TorchTPU stand-in of the tests replaces TorchTPU's kernel runtime. Each entry below says what it
reaches for; `CHECKED` says which releases it was checked against. When a release moves one, the
failure is a `SplashVersionError` naming the entry, the version found and the versions checked.

`SUPPORTED` holds the lower bounds pyproject.toml declares (its dependencies and the `hf` extra's
transformers; a test keeps them equal), and `TESTED` the newest releases the tested sets in locks/
hold. `check_versions` refuses, at import, a Python, torch, JAX, jaxlib or numpy older than its
bound (transformers when `torch_splash.hf` is imported) (unless $TORCH_SPLASH_ALLOW_UNTESTED=1
turns the refusal into a warning), and warns once about a release newer than the tested one: no
upper bound is declared where no break is known (a bound makes pip downgrade the user's framework).
The breaks that are known are named where they bind: torch_xla 2.9's (TORCH_XLA_NEEDS).

Nothing here is imported at import time beyond the standard library: JAX entries import JAX when
used. TorchTPU's one entry is a module name (`TORCHTPU_PALLAS_MODULE`, the kernel runtime the
tests replace with a CPU stand-in); nothing here imports TorchTPU (torch_splash_jax never imports
torch).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import re
import sys
import threading
import warnings

# Lower bounds: the same as pyproject.toml's `dependencies` and `requires-python`, and its `hf`
# extra's transformers (checked when torch_splash.hf is imported).
SUPPORTED = {
    "python": "3.11",
    "torch": "2.9",
    "jax": "0.7.1",
    "jaxlib": "0.7.1",
    "numpy": "2.0",
    "transformers": "5.23",
}
# The newest release of each in the tested sets (locks/): a newer one warns once at import.
TESTED = {
    "python": "3.12",
    "torch": "2.15.0",
    "jax": "0.12.0.1",
    "jaxlib": "0.12.0.1",
    "numpy": "2.5.5",
    "transformers": "5.24.0",
}
# torch_xla 2.9 is built against torch 2.9, and its Pallas extra pins jax 0.7.1.
TORCH_XLA_NEEDS = {"torch": ("2.9", "2.10"), "jax": ("0.7.1", "0.8")}
# The releases every entry below was checked against (the tested sets in locks/).
CHECKED = {
    "jax": ("0.7.1", "0.12.0.1"),
    "libtpu": ("0.0.21", "0.0.52"),
    "tokamax": ("0.0.17",),  # calibration only (torch_splash_jax.tpu_time.calibration)
}
ALLOW_UNTESTED = "TORCH_SPLASH_ALLOW_UNTESTED"


def release(version: str) -> tuple[int, ...]:
    """A version's release numbers: "2.14.1+cu130" -> (2, 14, 1), "0.12.0.1" -> (0, 12, 0, 1)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:4])


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _outside(found: str, low: str, high: str) -> bool:
    return not release(low) <= release(found) < release(high)


def _refuse(message: str) -> None:
    from .errors import SplashVersionError

    if os.environ.get(ALLOW_UNTESTED) == "1":
        warnings.warn(f"torch_splash: {message} (${ALLOW_UNTESTED}=1: going on anyway)", stacklevel=3)
        return
    raise SplashVersionError(f"{message} Set ${ALLOW_UNTESTED}=1 to try anyway.")


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


_WARNED_UNTESTED: set[str] = set()


def check_versions(names=("python", "jax", "jaxlib", "numpy")) -> None:
    """Refuse a Python or package older than SUPPORTED, and warn once about one newer than TESTED
    in its major.minor (torch_splash_jax checks its own; torch_splash adds torch, torch_splash.hf
    transformers)."""
    for name in names:
        found = python_version() if name == "python" else installed(name)
        if found is None:
            continue  # not installed: its own import fails, with its own message
        low, newest = SUPPORTED[name], TESTED[name]
        if release(found) < release(low):
            _refuse(
                f"{name} {found} is older than torch_splash supports ({name} >={low}). "
                f"Install a supported one, e.g. pip install '{name}>={low}'"
                + (" (or a newer Python)." if name == "python" else ".")
            )
        elif release(found)[:2] > release(newest)[:2] and name not in _WARNED_UNTESTED:
            _WARNED_UNTESTED.add(name)
            warnings.warn(
                f"torch_splash: {name} {found} is newer than the newest tested ({newest}), so untested here; "
                "please report what fails with it.",
                stacklevel=3,
            )


@functools.cache
def check_torch_xla() -> None:
    """torch_xla's own metadata pins neither torch nor JAX: a mismatched torch fails deep in its C++."""
    found = installed("torch_xla")
    for name, (low, high) in TORCH_XLA_NEEDS.items():
        version = installed(name)
        if found is not None and version is not None and _outside(version, low, high):
            _refuse(
                f"torch_xla {found} works with {name} >={low},<{high}, and {name} {version} is installed. "
                "Install the torch_xla set: pip install 'torch_splash[xla]'."
            )


def _moved(entry: str, error: BaseException) -> BaseException:
    from .errors import SplashVersionError

    return SplashVersionError(
        f"{entry} is not where torch_splash expects it in jax {installed('jax')}, torch_xla "
        f"{installed('torch_xla')}, torch-tpu {installed('torch-tpu')} (checked: {CHECKED}): {error}"
    )


# --- JAX: the splash kernel package (jax.experimental.pallas.ops.tpu.splash_attention) ---------


@functools.cache
def splash_modules():
    """(kernel, mask, mask_info) modules of JAX's splash package."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info

    return kernel, mask, mask_info


def splash_kernel(fwd_info, dq_info, dkv_info, **options):
    """The SplashAttentionKernel `make_splash_mha/mqa` would build, from its forward, dq and dkv
    MaskInfos. Its constructor is not public: its keyword arguments changed between releases."""
    try:
        return splash_modules()[0].SplashAttentionKernel(fwd_info, dq_info, dkv_info, **options)
    except TypeError as error:
        raise _moved("splash_attention_kernel.SplashAttentionKernel(...)", error) from None


def named_kernel_call(kernel, name: str):
    """A Pallas kernel call under a jit named `name`: JAX 0.7 names a kernel's TPU custom call
    after the function jitted around it (`backward_body.1`), where later JAX name it after the
    kernel; the TPU time estimator finds the kernels by those names."""
    import jax

    def call(*args):
        return kernel(*args)

    call.__name__ = call.__qualname__ = name
    return jax.jit(call)


def call_splash_kernel(kernel, *args):
    """What `kernel(*args)` (a SplashAttentionKernel) computes, traced into the caller's own jit.

    The kernel's `__call__` goes through `_splash_attention`, a module-level `jax.jit`: JAX's
    caches keyed on that long-lived function kept about 25 jaxprs and 0.5 MB for every new shape,
    long after the program that traced it was evicted (torch_splash_jax.policy). Its undecorated
    function (`__wrapped__`, which `jax.jit` sets) computes the same thing, and traced inside each
    Program's own jitted functions its entries die with them."""
    try:
        body = splash_modules()[0]._splash_attention.__wrapped__
    except AttributeError as error:
        raise _moved("splash_attention_kernel._splash_attention.__wrapped__", error) from None
    return body(kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info, *args, **kernel.kwargs)


def computable_mask_base() -> type:
    """The base class of a mask the kernel evaluates by its function (`_ComputableMask`)."""
    try:
        return splash_modules()[1]._ComputableMask
    except AttributeError as error:
        raise _moved("splash_attention_mask._ComputableMask", error) from None


def mask_info(data_next, mask_next, block_mask, partial_mask_blocks, q_sequence):
    """A MaskInfo (jax 0.12 added `is_dynamic_mask`, defaulted; the five kept their names)."""
    return splash_modules()[2].MaskInfo(
        data_next=data_next,
        mask_next=mask_next,
        block_mask=block_mask,
        partial_mask_blocks=partial_mask_blocks,
        q_sequence=q_sequence,
    )


def paged_attention():
    """JAX's paged attention kernel (jax.experimental): q (B, Hq, D), pages (Hkv, pages, page, D),
    lengths, page indices; `pages_per_compute_block` (the same in jax 0.7.1 to 0.12)."""
    try:
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel
    except ImportError as error:
        raise _moved("pallas.ops.tpu.paged_attention.paged_attention", error) from None
    return kernel


def ragged_paged_attention():
    """JAX's ragged paged attention kernel (jax.experimental; vLLM's TPU kernel): queries (tokens,
    Hq, D), kv pages (pages, page, 2 Hkv, D) with k and v interleaved along heads, kv lengths, page
    indices, cumulative query lengths, the number of sequences (the same in jax 0.7.1 to 0.12)."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
    except ImportError as error:
        raise _moved("pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention", error) from None
    return kernel


def tokamax_attention_modules():
    """tokamax's Mosaic TPU attention op, its vjp op and its splash kernel module (their Config
    classes take a block configuration as tokamax's caches record it; the public API picks its own)."""
    from tokamax._src.ops.attention import pallas_mosaic_tpu, pallas_mosaic_tpu_vjp
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel

    return pallas_mosaic_tpu, pallas_mosaic_tpu_vjp, splash_attention_kernel


def tokamax_causal_mask(window_size: int | None = None):
    """tokamax's causal mask for its attention ops' `mask` argument (a window: the keys each query sees)."""
    from tokamax._src.ops.attention import base

    return base.CausalMask(window_size=window_size)


def kernel_mask_infos(kernel) -> dict:
    """{"forward", "dq", "dkv": MaskInfo or None} of a SplashAttentionKernel (its fields)."""
    return {"forward": kernel.fwd_mask_info, "dq": kernel.dq_mask_info, "dkv": kernel.dkv_mask_info}


def downcast_to_small_type(array):
    """A block table in the smallest integer type holding it, as JAX's own builder stores it."""
    try:
        return splash_modules()[2]._downcast_to_small_type(array)
    except AttributeError as error:
        raise _moved("splash_attention_mask_info._downcast_to_small_type", error) from None


def lane_repeat(x, times: int):
    """x (rows, 128) repeated `times` along its lanes, in a Pallas TPU kernel: Pallas's own
    `repeat` where it has one (jax 0.7), `jnp.tile` where it was removed (jax 0.12 lowers it)."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    if hasattr(pltpu, "repeat"):
        return pltpu.repeat(x, times, axis=1)
    return jnp.tile(x, (1, times))


def logsumexp_residual(leaves: list, out):
    """The logsumexp among the leaves of the splash custom_vjp's vjp function: JAX names no
    residual, so it is the one float32 array shaped like `out` without its last axis."""
    import jax.numpy as jnp

    found = [x for x in leaves if x.shape == out.shape[:-1] and x.dtype == jnp.float32]
    if len(found) != 1:
        raise _moved("the splash kernel's logsumexp residual", f"{len(found)} candidates among {len(leaves)} leaves")
    return found[0]


def is_tracer(value) -> bool:
    import jax

    return isinstance(value, jax.core.Tracer)


# --- JAX: lowering TPU kernels at a chosen Mosaic IR version (jax._src.tpu_custom_call) -------

_LOWERING = threading.Lock()


@contextlib.contextmanager
def mosaic_ir_version(version: int):
    """Lower TPU kernels at this Mosaic IR version. JAX reads it from
    `tpu_custom_call.get_ir_version(ctx)` each time it lowers a kernel (jax 0.7.1 and 0.12 alike)
    and offers no public setting, so the function is replaced while lowering, under a lock."""
    from jax._src import tpu_custom_call

    with _LOWERING:
        jax_guess = tpu_custom_call.get_ir_version
        tpu_custom_call.get_ir_version = lambda ctx: version
        try:
            yield
        finally:
            tpu_custom_call.get_ir_version = jax_guess


@contextlib.contextmanager
def export_ignoring_forward_compatibility():
    """As TorchTPU's jax_op exports: the newest serialization, not the 6-month-compatible one."""
    import jax

    with jax._src.config.export_ignore_forward_compatibility(True):
        yield


# --- JAX / XLA client: DLPack import and deviceless compilation (jax._src.lib.xla_client) ----


def dlpack_import():
    """XLA's direct import of a DLPack capsule as a CPU buffer (about 15 us, against about 130 us
    through `jax.dlpack.from_dlpack`), or None where this JAX does not have it."""
    try:
        from jax._src.lib import xla_client

        return xla_client._xla.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):
        return None


def hlo_module_from_text(text: str) -> bytes:
    """HLO text (what torch_xla prints for a pending graph) as a serialized HLO module."""
    try:
        from jax._src.lib import xla_client

        parse = getattr(xla_client._xla, "hlo_module_from_text", None)
        if parse is None:  # jaxlib 0.12 moved it to its HLO module
            from jaxlib import _hlo

            parse = _hlo.hlo_module_from_text
    except (ImportError, AttributeError) as error:
        raise _moved("hlo_module_from_text", error) from None
    return parse(text).as_serialized_hlo_module_proto()


def hlo_module_from_stablehlo(text: str) -> bytes:
    """StableHLO text as a serialized HLO module (what torch_xla splices into its lazy graph)."""
    try:
        from jax._src.lib import xla_client

        convert = xla_client._xla.mlir.mlir_module_to_xla_computation
    except (ImportError, AttributeError) as error:
        raise _moved("mlir_module_to_xla_computation", error) from None
    return convert(text, use_tuple_args=False, return_tuple=True).as_serialized_hlo_module_proto()


def compile_hlo_for(proto: bytes, targets: tuple, partitions: int, donors: tuple[int, ...] = ()):
    """Compile a serialized HLO module for these (deviceless TPU) devices; the executable. The
    parameters numbered in `donors` are buffer donors: the compiler may reuse each one's buffer for
    an output of its shape, as it does for the donors torch_xla declares at a step boundary."""
    from jax._src.lib import xla_client

    module = xla_client._xla.mlir.hlo_to_stablehlo(proto)
    if donors:
        module = _with_buffer_donors(module, donors)
    return compile_stablehlo_for(module, targets, partitions)


def _with_buffer_donors(bytecode: bytes, donors: tuple[int, ...]) -> bytes:
    """The module with `jax.buffer_donor` on these arguments of its entry function: the conversion
    from HLO drops the module's own buffer_donor list, and this attribute is how a StableHLO module
    says the same to the compiler (what JAX's donate_argnums emits when it leaves the pairing to
    XLA)."""
    from jax._src.interpreters import mlir

    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(bytecode)
        main = next(
            op
            for op in module.body.operations
            if "sym_name" in op.attributes and mlir.ir.StringAttr(op.attributes["sym_name"]).value == "main"
        )
        count = len(mlir.ir.FunctionType(mlir.ir.TypeAttr(main.attributes["function_type"]).value).inputs)
        if max(donors) >= count:
            raise ValueError(f"buffer donors {sorted(donors)} for an entry function of {count} parameters")
        old = list(mlir.ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes else []
        old += [mlir.ir.DictAttr.get({})] * (count - len(old))
        attrs = []
        for number, entries in enumerate(old):
            entries = {named.name: named.attr for named in mlir.ir.DictAttr(entries)}
            if number in donors:
                entries["jax.buffer_donor"] = mlir.ir.BoolAttr.get(True)
            attrs.append(mlir.ir.DictAttr.get(entries))
        main.attributes["arg_attrs"] = mlir.ir.ArrayAttr.get(attrs)
        return mlir.module_to_bytecode(module)


def entry_parameter_count(proto: bytes) -> int:
    """How many parameters a serialized HLO module's entry computation takes."""
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client

    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(xla_client._xla.mlir.hlo_to_stablehlo(proto))
        main = next(
            op
            for op in module.body.operations
            if "sym_name" in op.attributes and mlir.ir.StringAttr(op.attributes["sym_name"]).value == "main"
        )
        return len(mlir.ir.FunctionType(mlir.ir.TypeAttr(main.attributes["function_type"]).value).inputs)


def compile_stablehlo_for(module, targets: tuple, partitions: int):
    """Compile a StableHLO module (text or bytecode) for these (deviceless TPU) devices."""
    import numpy as np
    from jax._src.lib import xla_client

    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions = 1, partitions
    build.use_spmd_partitioning = partitions > 1
    build.device_assignment = xla_client.DeviceAssignment.create(np.arange(partitions, dtype=np.int32)[None])
    devices = xla_client.DeviceList(targets[:partitions])
    try:
        return targets[0].client.compile(module, devices, options)  # jaxlib 0.7.1 takes text or bytecode
    except TypeError:  # jaxlib 0.12 takes a parsed module only
        from jax._src.interpreters import mlir

        with mlir.make_ir_context():
            parsed = mlir.ir.Module.parse(module) if isinstance(module, (str, bytes)) else module
            return targets[0].client.compile(parsed, devices, options)


def portable_artifact_module(serialized: bytes):
    """The StableHLO module of a portable artifact (`Exported.mlir_module_serialized`, what
    TorchTPU's runtime receives), parsed."""
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client

    with mlir.make_ir_context():
        return xla_client._xla.mlir.deserialize_portable_artifact(serialized)


def run_portable_artifact_on_cpu(serialized: bytes, arrays: list) -> list:
    """Compile a portable artifact for JAX's CPU device and run it on these arrays: the tests'
    stand-in for TorchTPU's kernel runtime, on modules of interpret-mode kernels."""
    import jax
    from jax._src.lib import xla_client

    device = jax.devices("cpu")[0]
    executable = device.client.compile_and_load(
        serialized, xla_client.DeviceList((device,)), xla_client.CompileOptions()
    )
    results = executable.execute_sharded([jax.device_put(a, device) for a in arrays])
    return [shards[0] for shards in results.disassemble_into_single_device_arrays()]


# --- TorchTPU (torch_tpu._internal.pallas) -----------------------------------------------------

# The module whose `tpu_torch_pallas` (the kernel runtime: register_custom_kernel,
# lookup_custom_kernel, call_custom_kernel) and `torch_placeholder` (output buffers on device
# "tpu") the tests replace with a CPU stand-in.
TORCHTPU_PALLAS_MODULE = "torch_tpu._internal.pallas.pallas"
