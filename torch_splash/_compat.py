"""The torch side's one home of the private or unstable APIs of torch, torch_xla and transformers
it relies on, and of the device guard that runs before JAX is imported.

torch_splash_jax.compat is the JAX side's twin (JAX's splash internals, jax._src, TorchTPU's kernel
runtime, the version ranges); torch_splash_jax itself never imports torch or torch_xla, so what
needs them lives here. Each entry says what it reaches for; `CHECKED` says which releases it was
checked against (the tested sets in locks/). Importing this module imports neither JAX nor torch:
torch_splash's `__init__` runs `keep_jax_off_the_tpu` first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import threading
import types
import warnings

CHECKED = {"torch": ("2.9.0", "2.15.0"), "torch_xla": ("2.9.0",), "torch-tpu": ("0.2.0",), "transformers": ("5.24.0",)}


# --- The device guard (torch_xla._internal.jax_workarounds) -------------------------------------


def keep_jax_off_the_tpu() -> None:
    """On a TPU host torch_xla or TorchTPU owns the TPU, and JAX opening it too hangs torch_xla
    (torch_xla issues 8793 and 8954) and competes with TorchTPU. JAX only lowers the kernels for
    TPU, which needs no TPU backend (torch_splash_jax.transport.hlo_module), so JAX is kept on the CPU
    unless the caller set JAX_PLATFORMS. TorchTPU installs libtpu where JAX finds it, so its
    presence alone is the sign (on a machine without a TPU, JAX would otherwise try the TPU and
    print libtpu's errors). If JAX is not imported yet, torch_xla opens the TPU first, as torch_xla's
    own guard (`jax_import_guard`, private) does."""
    torch_xla_tpu = os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
    if not torch_xla_tpu and importlib.util.find_spec("torch_tpu") is None:
        return
    jax_came_first = "jax" in sys.modules
    if torch_xla_tpu and not jax_came_first:
        from torch_xla._internal.jax_workarounds import jax_import_guard

        jax_import_guard()
    import jax
    from jax._src import xla_bridge

    if os.environ.get("JAX_PLATFORMS"):
        return
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
    elif jax.devices()[0].platform != "cpu":
        warnings.warn(
            "torch_splash: JAX opened the TPU before torch_splash was imported, so torch_xla's or "
            "TorchTPU's computations may hang (torch_xla issue 8793). Import torch_splash before "
            "running JAX code, or set JAX_PLATFORMS=cpu.",
            stacklevel=4,
        )


# --- torch (torch._dynamo, torch.utils._pytree) ---------------------------------------------------


def nonstrict_trace(fn):
    """Dynamo runs `fn` as plain Python on fake tensors and keeps only what it calls in the graph."""
    import torch

    return torch._dynamo.nonstrict_trace(fn)


def mask_mod_indexing():
    """The mode torch's own `create_mask` evaluates mask_mods under: `tensor[b, q_idx]` with
    0-d index tensors becomes an indexing op that vmap batches (else it calls `.item()`)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    return TransformGetItemToIndex()


def mask_mod_trace(fn, device) -> tuple[tuple[bool, bool, bool, bool], tuple | None, str | None]:
    """A mask_mod traced on 0-d index tensors (torch.fx's make_fx, under the indexing mode above):
    which of its arguments (b, h, q_idx, kv_idx) its computation reads, the tensors it reads besides
    them (the very objects it captured), and the traced code (the scalars it captured are constants
    there). Where it cannot be traced: every argument counts as read, and the rest is unknown (None)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        with mask_mod_indexing():
            module = make_fx(fn)(*(torch.tensor(0, device=device) for _ in range(4)))
    except Exception:  # noqa: BLE001  any failure only costs the evaluation at every (b, h)
        return (True, True, True, True), None, None
    reads = tuple(bool(node.users) for node in module.graph.nodes if node.op == "placeholder")
    if len(reads) != 4:
        return (True, True, True, True), None, None
    captured = tuple(getattr(module, node.target) for node in module.graph.nodes if node.op == "get_attr")
    if not all(isinstance(t, torch.Tensor) for t in captured):
        return reads, None, None
    return reads, captured, module.code


def score_mod_graph(fn, device):
    """A score_mod traced on a 0-d float32 score and 0-d int32 indices (torch.fx's make_fx, under the
    indexing mode above), as a torch.fx GraphModule: its nodes are aten ops, a captured tensor a
    `get_attr` of the very object captured. Raises whatever tracing raises."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    score = torch.tensor(0.0, device=device)
    with mask_mod_indexing():
        return make_fx(fn)(score, *(torch.tensor(0, dtype=torch.int32, device=device) for _ in range(4)))


def value_preserving_ops() -> set:
    """The aten ops a traced score_mod may apply to a value without changing it (copies, aliases,
    device moves: a constant made on the CPU and moved to torch_xla's device shows as one)."""
    import torch

    aten = torch.ops.aten
    return {
        aten.clone.default,
        aten.alias.default,
        aten.detach.default,
        aten._to_copy.default,
        aten.lift_fresh_copy.default,
    }


def constant_while_tracing(fn):
    """Dynamo calls `fn` (on arguments it holds as constants) while it traces, and keeps its result
    as a constant of the graph, guarded only as those arguments are."""
    import torch

    return torch._dynamo.assume_constant_result(fn)


def break_unless_constant(value, why: str) -> None:
    """While Dynamo traces: a graph break unless Dynamo holds `value` as a constant, one that
    `constant_while_tracing` functions may take (a function made inside the traced code, such as a
    closure over a module's buffer, is not: its cells are values of the trace). Without fullgraph
    the call then runs eagerly, where the function exists; under fullgraph Dynamo raises its
    Unsupported error with `why` as the explanation. Outside a trace, nothing."""
    from torch._dynamo.comptime import comptime

    comptime(_break_unless_constant)


def break_graph(why: str) -> None:
    """While Dynamo traces: a graph break, so that the call runs eagerly (where a refusal raises
    the SplashError itself); under fullgraph, Dynamo's Unsupported error says `why` first, rather
    than "Observed exception" around a raise in the traced code."""
    from torch._dynamo.comptime import comptime

    comptime(_break_graph)


def _break_graph(ctx) -> None:
    ctx.graph_break(ctx.get_local("why").as_python_constant())


def _break_unless_constant(ctx) -> None:
    # Runs at trace time on break_unless_constant's frame: its locals are Dynamo's variables.
    if not ctx.get_local("value").is_python_constant():
        ctx.graph_break(ctx.get_local("why").as_python_constant())


def dynamic_size(minimum: int):
    """A size only the data decides, in a custom op's fake implementation (an unbacked SymInt of at
    least `minimum`). torch 2.15 allows one under Dynamo as it is; torch 2.9's public
    `new_dynamic_size` refuses unless `capture_dynamic_output_shape_ops` is set, so the size is made
    as that would make it."""
    import torch
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    ctx = torch.library.get_ctx()
    try:
        return ctx.new_dynamic_size(min=minimum)
    except DynamicOutputShapeException:
        if ctx._shape_env is None:  # no symbolic shapes at all (a plain FakeTensorMode)
            raise
        size = ctx._shape_env.create_unbacked_symint()
        _constrain_range_for_size(size, min=minimum)
        return size


def torch_sdpa():
    """torch's own SDPA: the builtin that `torch.nn.functional.scaled_dot_product_attention` is
    bound to (the same object, torch 2.9 and 2.15). Reached here rather than through that
    attribute, which users rebind to install the drop-in: looking it up there would call the
    drop-in itself."""
    import torch

    return torch._C._nn.scaled_dot_product_attention


def tensor_version(t) -> int:
    """The version counter torch bumps on every in-place change of a tensor (and of its views)."""
    return t._version


def register_constant(cls: type) -> None:
    """Dynamo passes instances of `cls` into a nonstrict_trace region as constants it guards on."""
    import torch

    torch.utils._pytree.register_constant(cls)


def overrides_torch_function(t) -> bool:
    """Whether a tensor's class overrides `__torch_function__` (a subclass such as CausalBias), as
    its handler's underlying function tells."""
    import torch

    handler = getattr(type(t).__torch_function__, "__func__", None)
    return handler is not torch.Tensor.__torch_function__.__func__


# --- torch: route_flex's patch of torch.nn.attention.flex_attention.flex_attention ----------------
#
# torch_splash.route_flex has torch's function object run another function's call while its block
# lasts, by swapping the object's code (a compiled wrapper made before the block reaches the object
# by its code), and rebinds the module globals bound to it. Checked against torch's function in
# CHECKED["torch"]'s releases (no free variables) and CHECKED["torch-tpu"]'s patched one (four), whose
# code is only ever replaced by code of as many free variables, as CPython requires.

_SWAP_LOCK = threading.Lock()
_SWAPS: dict[int, list] = {}  # id(function) -> [blocks open, its own (code, defaults, kwdefaults)]


@contextlib.contextmanager
def function_calls(fn, module: str, name: str):
    """While the block lasts, calling the function object `fn` calls `module.name` instead, with
    the same arguments. Blocks nested or open in several threads at once share one swap: the first
    to enter makes it, the last to leave, whatever the order, puts back fn's own code exactly."""
    with _SWAP_LOCK:
        entry = _SWAPS.get(id(fn))
        if entry is None:
            own = (fn.__code__, fn.__defaults__, fn.__kwdefaults__)
            fn.__code__ = _trampoline(module, name, len(own[0].co_freevars))
            fn.__defaults__, fn.__kwdefaults__ = None, None
            entry = _SWAPS[id(fn)] = [0, own]
        entry[0] += 1
    try:
        yield
    finally:
        with _SWAP_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                fn.__code__, fn.__defaults__, fn.__kwdefaults__ = entry[1]
                del _SWAPS[id(fn)]


def _trampoline(module: str, name: str, free_variables: int):
    """Code that imports `module` and returns `module.name(*args, **kwargs)`: it runs among the
    patched function's globals, so it imports what it calls. Its free variables are declared,
    never read."""
    from torch_splash_jax import policy

    return _trampolines(policy.TRAMPOLINES)(module, name, free_variables)


# The bounded cache is made on first use, sized by policy.TRAMPOLINES then: this module imports
# nothing of the packages at import time.
@functools.cache
def _trampolines(size: int):
    @functools.lru_cache(maxsize=size)
    def build(module: str, name: str, free_variables: int):
        cells = [f"_cell{i}" for i in range(free_variables)]
        lines = ["def _outer():", *(f"    {c} = None" for c in cells), "    def _call(*args, **kwargs):"]
        if cells:
            lines += ["        if False:", f"            ({', '.join(cells)},)"]
        lines += [
            f"        from {module} import {name}",
            f"        return {name}(*args, **kwargs)",
            "    return _call",
        ]
        namespace = {}
        exec("\n".join(lines), namespace)
        return namespace["_outer"]().__code__

    return build


def module_namespaces() -> list[dict]:
    """The globals of every loaded module."""
    return [d for d in (getattr(m, "__dict__", None) for m in list(sys.modules.values())) if isinstance(d, dict)]


# --- torch_xla (torch_xla._XLAC, torch_xla.core.xla_builder) ------------------------------------


def needs_materialization_each(tensors) -> list[bool]:
    """For each torch_xla tensor, whether it is part of a pending (unexecuted) lazy graph."""
    import torch_xla

    return list(torch_xla._XLAC._check_tensor_need_materialization(list(tensors)))


def needs_materialization(tensors) -> bool:
    return any(needs_materialization_each(tensors))


def view_base(tensor):
    """The tensor `tensor` is a view of (an index, a slice, a reshape of it), or None (torch's
    `Tensor._base`, which views of torch_xla tensors carry too)."""
    return tensor._base


def materialize(tensors) -> None:
    """Execute the pending graph of these torch_xla tensors and wait for it."""
    import torch_xla

    torch_xla._XLAC._xla_sync_multi(list(tensors), devices=[], wait=True)


def sharding_spec(tensor) -> str:
    """torch_xla's sharding annotation of a tensor, as text ("" when it has none)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def pending_hlo_text(tensors) -> str:
    """The HLO text of the pending graph that computes these torch_xla tensors."""
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def buffer_pointer(tensor) -> int:
    """The device buffer address of a materialised torch_xla tensor (tests: DLPack shares it)."""
    import torch_xla

    return torch_xla._XLAC._unsafe_buffer_pointer(tensor)


def wait_device_ops() -> None:
    """Wait until every device has finished the work queued on it (benchmarks' timings)."""
    import torch_xla

    torch_xla._XLAC._xla_wait_device_ops([])


def pending_hlo_proto(tensors) -> bytes:
    """The pending graph that computes these torch_xla tensors as a serialized HLO module: the
    same module as `pending_hlo_text`, without the round trip through text that XLA's parser does
    not always take back."""
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo_proto(list(tensors))


def tensor_id(tensor) -> int:
    """torch_xla's unique id of the tensor (what orders its live tensors at a step boundary)."""
    import torch_xla

    return torch_xla._XLAC._xla_get_tensor_id(tensor)


def tensor_alias_id(tensor) -> int:
    """The id of the tensor whose buffer this tensor replaces when it is computed: its own id, or
    the id of the tensor it updates in place (functionalization carries it over). torch_xla
    prints it ("AliasID: N") in its tensor debug info and exposes it nowhere else."""
    import re

    import torch_xla

    info = torch_xla._XLAC._get_xla_tensor_debug_info(tensor)
    found = re.search(r"^AliasID: (-?\d+)$", info, re.MULTILINE)
    if found is None:
        from torch_splash_jax.errors import SplashVersionError

        raise SplashVersionError(
            f"torch_xla {_version('torch_xla')} no longer prints a tensor's AliasID in "
            f"_get_xla_tensor_debug_info (checked: {CHECKED['torch_xla']}); torch_splash.fit cannot "
            "tell which buffers a step donates."
        )
    return int(found[1])


def graph_parameters(tensors) -> tuple[list[int], list]:
    """The parameters of the pending graph of these tensors, in the graph's parameter order: for
    each, the id of the tensor whose buffer it is (-1 for constants torch_xla made itself), and a
    tensor of its shape and dtype."""
    import torch_xla

    ids, data = torch_xla._XLAC._get_tensors_xla_device_data_node(list(tensors))
    return list(ids), list(data)


def param_aliasing_enabled() -> bool:
    """torch_xla donates at a step boundary unless XLA_ENABLE_PARAM_ALIASING is false or automatic
    sharding is on (XLAGraphExecutor::GetBufferDonors)."""
    false = ("0", "false", "no", "off")
    if os.environ.get("XLA_ENABLE_PARAM_ALIASING", "1").strip().lower() in false:
        return False
    return os.environ.get("XLA_AUTO_SPMD", "0").strip().lower() in false


def _version(package: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def in_graph_function(name: str, hlo_module_proto: bytes):
    """A function of torch_xla tensors that adds this HLO module to the lazy graph."""
    import torch_xla.core.xla_builder as xla_builder

    computation = xla_builder.computation_from_module_proto(name, hlo_module_proto)
    return xla_builder.xla_computation_as_func(computation, name)


# --- transformers (masking_utils' mask closures) -------------------------------------------------

# The masking_utils factories whose closures the HF adapter reads (torch_splash.hf): one call of
# each, to find the code its closures share, and the variables it captures that the adapter reads.
_HF_FACTORIES = {
    "and_masks": (lambda mu: mu.and_masks(mu.causal_mask_function), ("mask_functions",)),
    "sliding_window_overlay": (lambda mu: mu.sliding_window_overlay(1), ("sliding_window",)),
    "sliding_window_bidirectional_overlay": (
        lambda mu: mu.sliding_window_bidirectional_overlay(1),
        ("sliding_window",),
    ),
    "chunked_overlay": (lambda mu: mu.chunked_overlay(1, None), ("chunk_size", "left_padding")),
    "packed_sequence_mask_function": (
        lambda mu: mu.packed_sequence_mask_function(None),
        ("packed_sequence_mask",),
    ),
    "remap_positions_for_packed_sequence": (
        lambda mu: mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None),
        ("mask_function", "position_ids"),
    ),
}


def _transformers_moved(what: str, error: object):
    from torch_splash_jax import SplashVersionError
    from torch_splash_jax.compat import installed

    return SplashVersionError(
        f"transformers {installed('transformers')}: {what} ({error}). torch_splash.hf reads transformers' "
        f"mask functions there, checked against transformers {', '.join(CHECKED['transformers'])}: install one "
        "of those (pip install 'torch_splash[hf]'), or use attn_implementation='sdpa' with this transformers."
    )


@functools.cache
def hf_masking():
    """The masking_utils functions the HF adapter calls or compares with (torch_splash.hf): a
    namespace, so one that transformers moved is a SplashVersionError naming transformers, here."""
    from transformers import masking_utils

    names = ("causal_mask_function", "bidirectional_mask_function", "sdpa_mask", "prepare_padding_mask")
    try:
        return types.SimpleNamespace(**{name: getattr(masking_utils, name) for name in names})
    except AttributeError as error:
        raise _transformers_moved("masking_utils lacks a function torch_splash.hf calls", error) from None


@functools.cache
def _hf_factory_codes() -> dict:
    from transformers import masking_utils

    codes = {}
    for name, (make, _) in _HF_FACTORIES.items():
        try:
            codes[make(masking_utils).__code__] = name
        except (AttributeError, TypeError) as error:
            raise _transformers_moved(f"masking_utils.{name} is not the mask-function factory it was", error) from None
    return codes


def hf_mask_closure(fn) -> tuple[str | None, dict]:
    """Which transformers masking_utils factory made the mask function `fn` (its name, or None),
    and the variables of its closure the adapter reads, by name. Every closure a factory returns
    shares the factory's code object, which identifies it; the captured names are the factory's
    locals, which transformers does not document (checked: CHECKED["transformers"]): one that is
    gone is a SplashVersionError naming transformers."""
    code = getattr(fn, "__code__", None)
    factory = _hf_factory_codes().get(code) if code is not None else None
    if factory is None:
        return None, {}
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    wanted = _HF_FACTORIES[factory][1]
    missing = [name for name in wanted if name not in cells]
    if missing:
        raise _transformers_moved(
            f"the closures of masking_utils.{factory} no longer capture {missing}", f"they capture {sorted(cells)}"
        )
    return factory, {name: cells[name] for name in wanted}
