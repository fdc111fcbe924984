"""Checks the SGLang adapter's calls against SGLang's own source, read from its wheel with `ast`: no install, no GPU.

Derived from the adapter's source, so that a new call is checked without editing this file:
  - `import sglang...` and `from sglang... import name`: the module and the name exist;
  - `sglang.<name>`: sglang/__init__.py defines it; a call such as `sglang.Engine(model_path=...)` fits its __init__;
  - the attribute that holds the engine (`self.llm = sglang.Engine(...)`) and every chain on it, read, written or
    called (`self.llm.loop = ...`, `self.llm.update_weights_from_tensor(...)`): each attribute exists, and a call's
    keywords and number of positional arguments fit the method's signature;
  - the keys of the dict passed as `sampling_params`: parameters of SGLang's SamplingParams.__init__ (or fields);
  - the string keys read in the adapter's OUTPUT_READERS: written into a result by SGLang's tokenizer manager or
    finish reasons (a key of that name is written there; its meaning and nesting are not checked);
  - the SGLANG_* environment variables the adapter sets: named in SGLang's source;
  - the result of a verb listed in RESULT_TYPES (`result = self.llm.load_lora_adapter(...)`, awaited or not): kept
    whole, not unpacked, and every attribute the adapter reads on it (`result.success`) a field of that class.

The tables below hold what `ast` cannot infer. Not checked: other return values (`ok, message = ...`), whether a
method is a coroutine, the types and meanings of values, and anything only the running engine shows (the GPU tests).
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

ENGINE_MODULE = "sglang"  # the adapter's engine is `sglang.Engine(...)`
# Attributes whose class the source cannot tell: Engine sets tokenizer_manager from a helper's returned tuple.
ATTRIBUTE_TYPES = {
    "sglang.srt.entrypoints.engine.Engine.tokenizer_manager": "sglang.srt.managers.tokenizer_manager.TokenizerManager",
}
# An __init__(self, **kwargs) that passes its keywords on to a class (Engine builds ServerArgs(**kwargs)).
KWARGS_TARGETS = {"sglang.srt.entrypoints.engine.Engine": "sglang.srt.server_args.ServerArgs"}
FORWARDERS = {"call"}  # the adapter's _LoopThread.call(fn, *args, **kwargs) runs fn(*args, **kwargs)
SAMPLING_PARAMS = "sglang.srt.sampling.sampling_params.SamplingParams"
# What a verb returns where its source cannot tell (Engine's LoRA verbs return the tokenizer manager's result through
# loop.run_until_complete): a class whose fields the adapter reads (the unit test checks that chain).
LORA_RESULT = "sglang.srt.managers.io_struct.LoRAUpdateOutput"
RESULT_TYPES = {
    verb: LORA_RESULT
    for verb in (
        "load_lora_adapter",
        "async_load_lora_adapter",
        "unload_lora_adapter",
        "async_unload_lora_adapter",
        "load_lora_adapter_from_tensors",
    )
}
OUTPUT_READERS = ("_output", "_prefill")  # the adapter's functions that read SGLang's result dicts
OUTPUT_WRITERS = ("sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.schedule_batch")


class WheelSource:
    """The Python source of a wheel, parsed from the zip on demand."""

    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())

    def path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.names), None)

    @lru_cache(maxsize=None)
    def tree(self, module: str) -> ast.Module:
        return ast.parse(self.zip.read(self.path(module)).decode())

    @cached_property
    def text(self) -> str:
        return "\n".join(self.zip.read(n).decode(errors="replace") for n in sorted(self.names) if n.endswith(".py"))

    def mentions(self, text: str) -> bool:
        """Whether any .py file has `text` as a quoted string."""
        return f'"{text}"' in self.text or f"'{text}'" in self.text

    def lookup(self, module: str, name: str) -> tuple[str, ast.AST] | None:
        """The last top-level definition of `name` in `module`, followed through imports and LazyImport("m", "x").

        A submodule of that name is a (module, ast.Module)."""
        if self.path(module) is None:
            return None
        found = None
        for node in _top_level(self.tree(module)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = (module, node)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, self.path(module).endswith("__init__.py"))
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", f"{source}.{alias.name}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _target_names(node):
                lazy = _lazy_import(node.value)
                found = ("import", lazy) if lazy else (module, node)
        if found and found[0] == "import":
            source, _, attr = found[1].rpartition(".")
            return self.lookup(source, attr) or self.module(found[1])
        return found or self.module(f"{module}.{name}")

    def module(self, module: str) -> tuple[str, ast.Module] | None:
        return (module, self.tree(module)) if self.path(module) else None

    def find_class(self, qualified: str) -> tuple[str, ast.ClassDef] | None:
        module, _, name = qualified.rpartition(".")
        found = self.lookup(module, name)
        return found if found and isinstance(found[1], ast.ClassDef) else None

    @lru_cache(maxsize=None)
    def members(self, module: str, cls: ast.ClassDef) -> dict[str, ast.AST]:
        """Methods, class attributes and `self.x = ...` attributes of a class and of its bases (found by name)."""
        out: dict[str, ast.AST] = {}
        for base in reversed(cls.bases):
            found = self.lookup(module, base.id) if isinstance(base, ast.Name) else None
            if found and isinstance(found[1], ast.ClassDef):
                out.update(self.members(*found))
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and _is_name(target.value, "self"):
                        out.setdefault(target.attr, node)
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                out.update(dict.fromkeys(_target_names(node), node))
        return out

    @lru_cache(maxsize=None)
    def fields(self, module: str, cls: ast.ClassDef) -> set[str]:
        """A dataclass's fields: the annotated names in its body and its bases' bodies."""
        names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        for base in cls.bases:
            found = self.lookup(module, base.id) if isinstance(base, ast.Name) else None
            if found and isinstance(found[1], ast.ClassDef):
                names |= self.fields(*found)
        return names


@dataclass
class Call:
    """The arguments of one call in the adapter: how many positional ones, and the keywords."""

    positional: int
    keywords: dict[str, ast.expr | None]
    starred: bool = False  # *args or **kwargs: the count and names are unknown

    @classmethod
    def of(cls, args: list[ast.expr], keywords: list[ast.keyword]) -> Call:
        starred = any(isinstance(a, ast.Starred) for a in args) or any(k.arg is None for k in keywords)
        return cls(len(args), {k.arg: k.value for k in keywords if k.arg is not None}, starred)


def check(adapter_source: str, wheel: WheelSource) -> list[str]:
    """Every way the adapter's use of SGLang disagrees with the wheel's source, one line each (empty: none)."""
    adapter = Adapter(adapter_source)
    problems = _check_imports(adapter, wheel) + _check_engine_uses(adapter, wheel)
    problems += _check_sampling_keys(adapter, wheel) + _check_output_keys(adapter, wheel)
    problems += _check_results(adapter, wheel)
    problems += [
        f"line {line}: the adapter sets ${name}, which SGLang's source never names"
        for line, name in adapter.environment_variables
        if not wheel.mentions(name)
    ]
    return problems


class Adapter:
    """The adapter's uses of SGLang, read from its source."""

    def __init__(self, source: str):
        self.tree = ast.parse(source)
        self.parents = {child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}

    @cached_property
    def engine_attribute(self) -> str:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and _sglang_engine_call(node.value):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and _is_name(target.value, "self"):
                        return target.attr
        raise AssertionError("the adapter keeps no `self.<name> = sglang.Engine(...)`: the checker needs one")

    @property
    def imports(self) -> list[tuple[int, str, str | None]]:
        """(line, module, name or None) for each import of sglang."""
        out = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == ENGINE_MODULE]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == ENGINE_MODULE:
                out += [(node.lineno, node.module, a.name) for a in node.names]
        return out

    @property
    def module_uses(self) -> list[tuple[int, str, Call | None]]:
        """(line, name, call or None) for each `sglang.<name>`."""
        return [
            (node.lineno, node.attr, self._call_of(node))
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Attribute) and _is_name(node.value, ENGINE_MODULE)
        ]

    @property
    def engine_uses(self) -> list[tuple[int, list[str], Call | None]]:
        """(line, attribute chain, call or None) for each longest chain on the engine: self.llm.a.b -> [a, b]."""
        out = []
        for node in ast.walk(self.tree):
            chain = _chain(node)
            longest = not isinstance(self.parents.get(node), ast.Attribute)
            if chain[:2] == ["self", self.engine_attribute] and len(chain) > 2 and longest:
                out.append((node.lineno, chain[2:], self._call_of(node)))
        return out

    @property
    def results(self) -> list[tuple[ast.Assign, str, ast.AST]]:
        """(assignment, verb, enclosing function or module) for each `x = [await] self.llm.<verb>(...)` of a verb in
        RESULT_TYPES."""
        out = []
        scopes = [self.tree] + [
            n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Assign):
                continue
            value = node.value.value if isinstance(node.value, ast.Await) else node.value
            chain = _chain(value.func) if isinstance(value, ast.Call) else []
            if chain[:2] == ["self", self.engine_attribute] and len(chain) == 3 and chain[2] in RESULT_TYPES:
                scope = [s for s in scopes if any(n is node for n in ast.walk(s))][-1]  # the innermost
                out.append((node, chain[2], scope))
        return out

    @property
    def environment_variables(self) -> list[tuple[int, str]]:
        return [
            (node.lineno, node.slice.value)
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Subscript) and _chain(node.value) == ["os", "environ"]
            if isinstance(node.slice, ast.Constant) and str(node.slice.value).startswith("SGLANG_")
        ]

    def dict_keys(self, value: ast.expr) -> set[str]:
        """The string keys of a dict literal, or of every dict literal assigned to that name and `name["k"] = ...`."""
        if isinstance(value, ast.Dict):
            return {k.value for k in value.keys if isinstance(k, ast.Constant)}
        keys = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and any(_is_name(t, getattr(value, "id", None)) for t in node.targets):
                keys |= self.dict_keys(node.value) if isinstance(node.value, ast.Dict) else set()
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(value, ast.Name):
                if _is_name(node.value, value.id) and isinstance(node.slice, ast.Constant):
                    keys.add(node.slice.value)
        return keys

    def keys_read_in(self, function: str) -> list[tuple[int, str]]:
        return [
            (node.lineno, node.slice.value)
            for fn in ast.walk(self.tree)
            if isinstance(fn, ast.FunctionDef) and fn.name == function
            for node in ast.walk(fn)
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
        ]

    def _call_of(self, node: ast.expr) -> Call | None:
        """The call that `node` is the function of, directly or through a forwarder: loop.call(node, *args)."""
        parent = self.parents.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            return Call.of(parent.args, parent.keywords)
        forwarder = isinstance(parent, ast.Call) and (_chain(parent.func) or [""])[-1] in FORWARDERS
        if forwarder and parent.args[:1] == [node]:
            return Call.of(parent.args[1:], parent.keywords)
        return None


def _check_imports(adapter: Adapter, wheel: WheelSource) -> list[str]:
    problems = []
    for line, module, name in adapter.imports:
        if wheel.path(module) is None:
            problems.append(f"line {line}: the adapter imports {module}, which the wheel does not have")
        elif name is not None and wheel.lookup(module, name) is None:
            problems.append(f"line {line}: the adapter imports {name} from {module}, which does not define it")
    for line, name, call in adapter.module_uses:
        found = wheel.lookup(ENGINE_MODULE, name)
        if found is None:
            problems.append(f"line {line}: the adapter uses {ENGINE_MODULE}.{name}, which sglang/__init__.py lacks")
        elif call and isinstance(found[1], ast.ClassDef):
            problems += _check_constructor(wheel, *found, call, f"line {line}")
    return problems


def _check_constructor(wheel: WheelSource, module: str, cls: ast.ClassDef, call: Call, where: str) -> list[str]:
    qualified = f"{module}.{cls.name}"
    if qualified in KWARGS_TARGETS:
        found = wheel.find_class(KWARGS_TARGETS[qualified])
        if found is None:
            return [f"{where}: {KWARGS_TARGETS[qualified]} is no `class` statement here: adapt KWARGS_TARGETS"]
        module, cls = found
        qualified = f"{module}.{cls.name}"
    init = wheel.members(module, cls).get("__init__")
    if isinstance(init, ast.FunctionDef):
        return _check_signature(init, call, f"{where}: {qualified}")
    fields = wheel.fields(module, cls)  # a dataclass or msgspec.Struct: keywords are its fields
    return [f"{where}: {qualified} has no field {name!r}" for name in call.keywords if name not in fields]


def _check_engine_uses(adapter: Adapter, wheel: WheelSource) -> list[str]:
    engine = wheel.lookup(ENGINE_MODULE, "Engine")
    if engine is None or not isinstance(engine[1], ast.ClassDef):
        return [f"the wheel's {ENGINE_MODULE}/__init__.py defines no class Engine"]
    problems = []
    for line, chain, call in adapter.engine_uses:
        module, cls = engine
        for i, attr in enumerate(chain):
            qualified = f"{module}.{cls.name}"
            member = wheel.members(module, cls).get(attr)
            if member is None:
                problems.append(f"line {line}: {qualified} has no attribute {attr!r}")
                break
            if i + 1 < len(chain):
                found = wheel.find_class(ATTRIBUTE_TYPES.get(f"{qualified}.{attr}", ""))
                if found is None:
                    problems.append(f"line {line}: cannot tell the class of {qualified}.{attr}: adapt ATTRIBUTE_TYPES")
                    break
                module, cls = found
            elif call and isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems += _check_signature(member, call, f"line {line}: {qualified}.{attr}")
    return problems


def _check_signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: Call, where: str) -> list[str]:
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args if p.arg not in ("self", "cls")]
    keywords = {p.arg for p in a.args + a.kwonlyargs if p.arg not in ("self", "cls")}
    problems = []
    if not call.starred and a.vararg is None and call.positional > len(positional):
        problems.append(f"{where} takes {len(positional)} positional arguments, the adapter passes {call.positional}")
    if a.kwarg is None:
        problems += [f"{where} has no parameter {name!r}" for name in call.keywords if name not in keywords]
    return problems


def _check_sampling_keys(adapter: Adapter, wheel: WheelSource) -> list[str]:
    found = wheel.find_class(SAMPLING_PARAMS)
    if found is None:
        return [f"{SAMPLING_PARAMS} is no `class` statement here: adapt SAMPLING_PARAMS"]
    problems = []
    for line, _, call in adapter.engine_uses:
        if call and "sampling_params" in call.keywords:
            keys = adapter.dict_keys(call.keywords["sampling_params"])
            problems += _check_constructor(wheel, *found, Call(0, dict.fromkeys(sorted(keys))), f"line {line}")
    return problems


def _check_output_keys(adapter: Adapter, wheel: WheelSource) -> list[str]:
    written = set()
    for module in OUTPUT_WRITERS:
        for node in ast.walk(wheel.tree(module)):
            if isinstance(node, ast.Dict):
                written |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                written |= {node.slice.value} if isinstance(node.slice, ast.Constant) else set()
    return [
        f"line {line}: the adapter reads {key!r} from SGLang's output, which SGLang never writes"
        for reader in OUTPUT_READERS
        for line, key in adapter.keys_read_in(reader)
        if key not in written
    ]


def _check_results(adapter: Adapter, wheel: WheelSource) -> list[str]:
    problems = []
    for node, verb, scope in adapter.results:
        found = wheel.find_class(RESULT_TYPES[verb])
        if found is None:
            problems.append(
                f"line {node.lineno}: {RESULT_TYPES[verb]} is no `class` statement here: adapt RESULT_TYPES"
            )
            continue
        name = found[1].name
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            problems.append(f"line {node.lineno}: {verb} returns {name}, an object, which the adapter unpacks")
            continue
        fields, held = wheel.fields(*found), node.targets[0].id
        problems += [
            f"line {n.lineno}: the adapter reads {held}.{n.attr}, but {name} (what {verb} returns) has no field "
            f"{n.attr!r}"
            for n in ast.walk(scope)
            if isinstance(n, ast.Attribute) and _is_name(n.value, held) and isinstance(n.ctx, ast.Load)
            if n.attr not in fields
        ]
    return problems


def _top_level(tree: ast.Module):
    """A module's statements, looking inside if/try/with blocks but not into functions or classes."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            stack += [n for block in reversed(blocks) for n in reversed(block)]


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module
    parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join(parts + ([node.module] if node.module else []))


def _lazy_import(value: ast.expr | None) -> str | None:
    """The dotted name `m.x` for LazyImport("m", "x")."""
    if isinstance(value, ast.Call) and _chain(value.func)[-1:] == ["LazyImport"] and len(value.args) == 2:
        if all(isinstance(a, ast.Constant) for a in value.args):
            return f"{value.args[0].value}.{value.args[1].value}"
    return None


def _target_names(node: ast.Assign | ast.AnnAssign) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _chain(node: ast.expr) -> list[str]:
    """["self", "llm", "loop"] for self.llm.loop; [] for anything that is not a plain dotted name."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _chain(node.value)
        return head + [node.attr] if head else []
    return []


def _is_name(node: ast.AST, name: str | None) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _sglang_engine_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _chain(node.func) == [ENGINE_MODULE, "Engine"]
