"""The design's rules about what may import what, read from the source (docs/design.md, "Layout"):

- torch_splash_jax imports neither torch nor what builds on it (torch_xla, TorchTPU, transformers);
  test_tpu_compile.py runs it with those unimportable;
- no import cycles among the package's modules, lazy (function-level) imports included;
- private names (a leading underscore) of JAX, torch, torch_xla, TorchTPU, transformers or tokamax
  are reached only from the compatibility modules, and no module reaches for another module's
  private names;
- the tooling (torch_splash_jax.tpu_time, the TPU-time estimator; torch_splash_jax.tpu_check, the
  real-chip check) is never imported by the runtime: not by its source, and not by `import
  torch_splash` and attention calls (checked in a fresh process)."""

import ast
import pathlib

from helpers import run_python

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("torch_splash", "torch_splash_jax")
COMPAT = {"torch_splash._compat", "torch_splash_jax.compat"}
EXTERNAL = ("jax", "jaxlib", "torch", "torch_xla", "torch_tpu", "transformers", "tokamax")
TORCH_WORLD = ("torch", "torch_xla", "torch_tpu", "transformers")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = ast.parse(path.read_text(), filename=str(path))
    return found


def _subpackages() -> set[str]:
    return {_module_name(path) for package in PACKAGES for path in (ROOT / package).rglob("__init__.py")}


def _imports(name: str, tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the module, at any depth."""
    package = name if name in _subpackages() else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((base, [alias.name for alias in node.names], node.lineno))
    return out


def _internal_targets(modules: dict, imported: str, names: list[str]) -> list[str]:
    """The package modules an import reaches: the module itself, and any submodule it names."""
    targets = [imported] if imported in modules else []
    return targets + [f"{imported}.{n}" for n in names if f"{imported}.{n}" in modules]


def test_the_jax_side_imports_nothing_of_torch():
    offending = [
        f"{name}:{line} imports {imported}"
        for name, tree in _modules().items()
        if name.startswith("torch_splash_jax")
        for imported, _, line in _imports(name, tree)
        if imported.split(".")[0] in TORCH_WORLD
    ]
    assert not offending, offending


def test_no_import_cycles():
    modules = _modules()
    graph = {
        name: {
            target
            for imported, names, _ in _imports(name, tree)
            for target in _internal_targets(modules, imported, names)
            if target != name and not name.startswith(target + ".")  # a package's own __init__
        }
        for name, tree in modules.items()
    }

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [cycle for cycle in map(cycle_from, graph) if cycle]
    assert not cycles, cycles


def _private(attribute: str) -> bool:
    return attribute.startswith("_") and not attribute.startswith("__")


def test_private_names_are_reached_only_from_the_compatibility_modules():
    modules = _modules()
    offending = []
    for name, tree in modules.items():
        aliases = {}  # local name -> the module it is bound to
        for imported, names, line in _imports(name, tree):
            internal = imported.split(".")[0] in PACKAGES
            if not internal and name in COMPAT:
                continue
            if not internal and imported.split(".")[0] in EXTERNAL:
                if any(_private(part) for part in imported.split(".")) or any(map(_private, names)):
                    offending.append(f"{name}:{line} imports a private name of {imported}")
            if (
                internal
                and any(_private(n) for n in names)
                and not (imported == name.rsplit(".", 1)[0] and all(f"{imported}.{n}" in modules for n in names))
            ):
                offending.append(f"{name}:{line} imports private {names} from {imported}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        if name in COMPAT:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and aliases.get(root.id, "").split(".")[0] in EXTERNAL:
                    offending.append(f"{name}:{node.lineno} reaches {ast.unparse(node)}")
    assert not offending, "\n".join(offending)


# The JAX side's tooling: the TPU time estimator and the real-chip check.
TOOLING = ("torch_splash_jax.tpu_time", "torch_splash_jax.tpu_check")
# Tooling on the torch side, run by users on purpose (`python -m torch_splash.fit`, and the modules
# it is split into; the real-chip check's run through the bridge), never by a call.
TORCH_SIDE_TOOLING = ("torch_splash.fit", "torch_splash._fit_", "torch_splash._bridge_check")


def test_the_runtime_source_never_imports_the_tpu_time_tooling():
    modules = _modules()
    offending = [
        f"{name}:{line} imports {imported}"
        for name, tree in modules.items()
        if not name.startswith((*TOOLING, *TORCH_SIDE_TOOLING))
        for imported, names, line in _imports(name, tree)
        for target in [imported, *(f"{imported}.{n}" for n in names)]
        if target in TOOLING or target.startswith(tuple(t + "." for t in TOOLING))
    ]
    assert not offending, offending


_CALLS = """
import json, sys
import torch
import torch_splash
q, k, v = (torch.randn(1, 1, 128, 32, requires_grad=True) for _ in range(3))
torch_splash.attention(q, k, v, "causal").sum().backward()
with torch.no_grad():
    torch_splash.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(128, 128, dtype=torch.bool).tril())
print(json.dumps({"modules": sorted(sys.modules)}))
"""


def test_import_and_attention_calls_load_none_of_the_tooling():
    """In a fresh process (most of its time is importing torch and JAX): `import torch_splash`, a
    forward and backward call and the SDPA drop-in's mask path load no module of the TPU-time
    tooling, no tokamax and not the fit check."""
    loaded = run_python("-c", _CALLS, cwd=ROOT, timeout=600)[-1]["modules"]
    assert "torch_splash_jax.splash_program" in loaded  # the calls ran the kernels
    tooling = [
        m for m in loaded if m in TOOLING or m.startswith((*(t + "." for t in TOOLING), "tokamax", *TORCH_SIDE_TOOLING))
    ]
    assert not tooling, tooling


# Reaching into a function's or object's internals: as private as a leading underscore.
INTROSPECTION = {
    "__code__",
    "__closure__",
    "__globals__",
    "__defaults__",
    "__kwdefaults__",
    "__dict__",
    "__func__",
    "__self__",
}


def test_dunder_access_to_other_objects_internals_is_only_in_the_compatibility_modules():
    """`fn.__code__`, `getattr(m, "__dict__")` and the like, on anything but the module's own
    `self` / `cls`, are made only in the compatibility modules."""
    offending = []
    for name, tree in _modules().items():
        if name in COMPAT:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in INTROSPECTION:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    offending.append(f"{name}:{node.lineno} reaches {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
                attribute = node.args[1]
                if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and isinstance(attribute, ast.Constant):
                    if attribute.value in INTROSPECTION:
                        offending.append(f"{name}:{node.lineno} reaches {ast.unparse(node)}")
    assert not offending, "\n".join(offending)
