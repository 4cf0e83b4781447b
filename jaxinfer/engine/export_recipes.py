"""Which exported program a warm start needs, found without tracing it.

Why: the export cache (export_cache.py) names each lowered program by a hash of its jaxpr, so a warm start still
traces every program to find its file. On one H200 a second start of the bench's engine (Llama-3-8B shape) spent
9.5 of its 17.1 s to the first token in that tracing loop, with every program then read from a file
(docs/PERFORMANCE.md, "Start times on an H200"); on a 2-core CPU a SmolLM2 engine 2.5 of 9.7 s.

What: after a program has been traced once, a small JSON "recipe" is written beside the exported programs. Its
name is a hash of everything the trace is made from, each of which can be read without tracing:

- the program's identity: the entry point and what the runner closes over (`ModelRunner.program_identity`: the
  model family and config, the mesh and its devices, the sharding rules, the attention implementation);
- its arguments' tree, shapes, dtypes and shardings, and its static arguments;
- the code: a hash of every source file of jaxinfer and pallas_kernels (`source_digest`), and the state of their
  loaded modules (`module_state`: each module-level constant's value and each module-level function's or class's
  name, so a tuning table changed at run time, or a function swapped for another, changes the name);
- JAX's configuration, the JAX, jaxlib, NumPy and Python versions, the backend and its devices.

The recipe holds the program's file name (its jaxpr hash), its donated arguments, its compiler options and its
output tree; a start that finds it reads the exported program straight away. Whatever the hash cannot describe
deterministically (an object whose repr holds an address) just gives a name no later start finds, which costs the
trace, never a wrong program. `JAXINFER_EXPORT_RECIPE_CHECK=1` traces every program anyway and raises where a
recipe led to another program than the trace names (tests/engine/test_export_cache.py runs engines that way).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import json
import os
import pkgutil
import sys
import types
from pathlib import Path
from typing import Any

import jax
import numpy as np

CHECK_ENV = "JAXINFER_EXPORT_RECIPE_CHECK"
RECIPE_DIR = "recipes"
_PACKAGES = ("jaxinfer", "pallas_kernels")
# Module-level bookkeeping that changes as a process runs and that no trace reads (arrival numbers, warnings and
# announcements already given, parsed chat templates): left out, so that a second engine of one process finds its
# recipes.
BOOKKEEPING = frozenset({
    ("jaxinfer.engine.sequence", "_arrival_counter"), ("jaxinfer.platform", "_announced"),
    ("jaxinfer.engine.export_cache", "_WARNED"), ("pallas_kernels.quantized_matmul", "_WARNED"),
    ("pallas_kernels.ragged_paged_attention", "_WARNED"), ("jaxinfer.tokenizer", "_TEMPLATE_CACHE"),
})
_BACKEND_RUNTIMES = {"gpu": ("jax.experimental.pallas.mosaic_gpu", "jax.experimental.pallas.triton"),
                     "tpu": ("jax.experimental.pallas.tpu",)}
_DEPTH = 4  # how deep `_describe` goes into nested containers before it gives up (a name no start finds)


class Undescribable(Exception):
    """A value `_describe` cannot render the same way in every process."""


def check_requested() -> bool:
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


@functools.cache
def source_digest() -> str:
    """SHA-256 of every .py file of the jaxinfer and pallas_kernels packages, by relative path (once a process)."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root.parent).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _describe(value: Any, depth: int = 0) -> str:
    """A text for `value` that is the same in every process where the value is (module docstring)."""
    if depth > _DEPTH:
        raise Undescribable("nested too deep")
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return repr(value)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, tuple | list):
        return f"{type(value).__name__}({', '.join(_describe(v, depth + 1) for v in value)})"
    if isinstance(value, set | frozenset):
        return f"{type(value).__name__}({', '.join(sorted(_describe(v, depth + 1) for v in value))})"
    if isinstance(value, dict):
        items = sorted((_describe(k, depth + 1), _describe(v, depth + 1)) for k, v in value.items())
        return f"{type(value).__name__}({', '.join(f'{k}: {v}' for k, v in items)})"
    if isinstance(value, functools.partial):
        return (f"partial({_describe(value.func, depth + 1)}, {_describe(value.args, depth + 1)}, "
                f"{_describe(value.keywords, depth + 1)})")
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return _name(value)  # a function, class or jitted function: by where it was defined
    if isinstance(value, np.ndarray):
        if value.size > 1 << 16:
            raise Undescribable("a large array")
        return f"ndarray({value.shape}, {value.dtype}, {hashlib.sha256(value.tobytes()).hexdigest()})"
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return f"{_name(type(value))}({_describe(fields, depth + 1)})"
    text = repr(value)
    if " at 0x" in text or "object at" in text:
        raise Undescribable(f"{type(value).__qualname__} has no stable repr")
    return f"{_name(type(value))}:{text}"


def describe(value: Any) -> str | None:
    """`_describe(value)`, or None where the value has no text that is the same in every process."""
    try:
        return _describe(value)
    except Undescribable:
        return None


def module_state() -> str:
    """SHA-256 of the module-level names of every loaded jaxinfer and pallas_kernels module (module docstring).
    A value with no stable text makes the name its process's alone: that module's constants are then unknown."""
    h = hashlib.sha256()
    for name in sorted(n for n in sys.modules if n.split(".")[0] in _PACKAGES):
        module = sys.modules[name]
        if module is None:
            continue
        for key, value in sorted(vars(module).items()):
            if key.startswith("__") or (name, key) in BOOKKEEPING:
                continue
            text = describe(value) or f"unstable {id(value)}"  # no stable text: this process only
            h.update(f"{name}.{key}={text}\n".encode())
    return h.hexdigest()


@functools.cache
def _import_kernels() -> None:
    """Every pallas_kernels module, which tracing imports lazily (the GPU kernels on a GPU, the attention package
    on its first use), so that the modules `module_state` sees are the same before and after a start traces: a
    second engine of one process then finds its recipes too. A module no start has loaded cannot have been
    changed, so leaving one out only costs recipes, never a wrong program."""
    import pallas_kernels

    for info in pkgutil.walk_packages(pallas_kernels.__path__, "pallas_kernels."):
        importlib.import_module(info.name)
    # And Pallas's own modules for this backend's kernels, which the kernels import when they are traced. Without
    # them a program read untraced did not compile on an H200: XLA could not materialize a Mosaic GPU kernel's
    # host symbols (its runtime comes with jax.experimental.mosaic.gpu). On a CPU the kernels only run
    # interpreted, and importing Mosaic GPU there costs a second.
    for runtime in _BACKEND_RUNTIMES.get(jax.default_backend(), ()):
        try:
            importlib.import_module(runtime)
        except ImportError:
            pass


def environment_digest() -> str:
    """What every program of a start shares: versions, devices, JAX's configuration, the code and its modules.
    Taken once before a start traces anything (precompile), since tracing imports modules lazily."""
    _import_kernels()
    devices = jax.devices()
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    h = hashlib.sha256()
    for part in (jax.__version__, jax.lib.__version__, np.__version__, sys.version, jax.default_backend(),
                 [(d.id, d.device_kind, d.process_index) for d in devices], config, source_digest(), module_state()):
        h.update(repr(part).encode())
    return h.hexdigest()


def leaf_signature(leaves: list[Any]) -> list[tuple[Any, str, str]]:
    """Each flat argument's shape, dtype and sharding: part of both the program's key and its recipe's."""
    return [(leaf.shape, str(leaf.dtype), str(getattr(leaf, "sharding", None))) for leaf in leaves]


def recipe_key(identity: str, environment: str, leaves: list[Any], in_tree: Any, static: dict[str, Any]) -> str:
    """The recipe's file name for one program: its identity, its arguments (tree, shapes, dtypes, shardings), its
    static arguments and the start's environment."""
    h = hashlib.sha256()
    for part in (identity, environment, repr(in_tree), _describe(dict(static)), leaf_signature(leaves)):
        h.update(repr(part).encode())
    return h.hexdigest()


# Output trees as JSON: each node its type (by module and name) and its auxiliary data, each leaf null.
def _encode(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return {type(value).__name__: [_encode(v) for v in value]}
    raise Undescribable(f"auxiliary data of type {type(value).__qualname__}")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        ((kind, items),) = value.items()
        return (tuple if kind == "tuple" else list)(_decode(v) for v in items)
    return value


def tree_to_json(treedef: Any) -> Any:
    """A JSON form of a pytree structure whose node types are builtins or classes of this package and whose
    auxiliary data are plain values; Undescribable otherwise."""
    data = treedef.node_data()
    if data is None:
        return None  # a leaf
    kind, aux = data
    if kind.__module__ != "builtins" and kind.__module__.split(".")[0] not in _PACKAGES:
        raise Undescribable(f"node type {_name(kind)}")
    return {"type": [kind.__module__, kind.__qualname__], "aux": _encode(aux),
            "children": [tree_to_json(c) for c in treedef.children()]}


def tree_from_json(obj: Any) -> Any:
    if obj is None:
        return jax.tree.structure(0)
    module, qualname = obj["type"]
    if module != "builtins" and module.split(".")[0] not in _PACKAGES:
        raise ValueError(f"a recipe names node type {module}.{qualname}")
    if (module, qualname) == ("builtins", "NoneType"):
        kind = type(None)  # not a name in builtins
    else:
        kind = importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
    children = [tree_from_json(c) for c in obj["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, (kind, _decode(obj["aux"])), children)


@dataclasses.dataclass(frozen=True)
class Recipe:
    program: str  # the exported program's file stem (export_cache.program_key)
    donated: tuple[int, ...]  # flat argument indices
    options: dict[str, Any]  # the jit's compiler options
    out_tree: Any  # tree_to_json of the output structure
    name: str  # the traced function's name, for messages


def recipe_path(directory: Path, key: str) -> Path:
    return directory / RECIPE_DIR / f"{key}.json"


def read(directory: Path, key: str) -> Recipe | None:
    """The recipe of that name, or None where there is none or it cannot be read."""
    try:
        raw = json.loads(recipe_path(directory, key).read_text())
        return Recipe(program=str(raw["program"]), donated=tuple(int(i) for i in raw["donated"]),
                      options=dict(raw["options"]), out_tree=raw["out_tree"], name=str(raw["name"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def encode(program: str, donated: tuple[int, ...], options: dict[str, Any], out_tree: Any,
           name: str) -> bytes | None:
    """The recipe's file contents, or None where its output tree or options have no JSON form that rebuilds them
    exactly (that program is then traced on every start, as before)."""
    try:
        tree = tree_to_json(out_tree)
        if tree_from_json(tree) != out_tree:
            return None
        text = json.dumps({"program": program, "donated": list(donated), "options": options, "out_tree": tree,
                           "name": name}, sort_keys=True)
    except (Undescribable, TypeError, ValueError, AttributeError):
        return None
    if json.loads(text)["options"] != options:  # e.g. a tuple that JSON would return as a list
        return None
    return text.encode()


__all__ = ["CHECK_ENV", "Recipe", "check_requested", "describe", "encode", "environment_digest", "leaf_signature",
           "module_state", "read", "recipe_key", "recipe_path", "source_digest", "tree_from_json", "tree_to_json"]
