"""Python definitions read from their source files, not imported: where a ``_target_`` points and what it accepts.

`python train.py` checks a config before torch and Lightning are imported (`multiloss.config.early`): a user's
mistake is named in a second, not after five of imports. What the checks need of a ``_target_`` — its parameters,
their annotations, its classes' order — is read here from the source with `ast`, the way `inspect` would read it
from the imported object, and to the same result (a test compares the two on every shipped target). Where the
source does not say (a compiled module, a class built by a decorator, a name bound at run time), the answer is
`UNKNOWN`, and the check that needed it waits for the imported object (`multiloss.config.validate`).

Modules already imported, and the standard library's light ones, are used as they are (`Live`).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any


class _Unknown:
    """What the source does not tell."""

    _instance: _Unknown | None = None

    def __new__(cls) -> _Unknown:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()
NOT_BOUND: Any = type("_NotBound", (), {"__repr__": lambda self: "NOT_BOUND"})()  # no such name at run time

# Imported for real when a definition refers to them (as is the whole standard library): light, always installed.
LIGHT_MODULES = frozenset(
    {
        "abc",
        "builtins",
        "collections",
        "dataclasses",
        "datetime",
        "enum",
        "functools",
        "math",
        "numbers",
        "operator",
        "os",
        "pathlib",
        "re",
        "types",
        "typing",
        "typing_extensions",
        "warnings",
        "omegaconf",
        "hydra",
    }
)


@dataclass(eq=False)  # one object a module (parsed once): hashed by identity
class Module:
    """A module's parsed source."""

    name: str
    path: Path
    is_package: bool
    tree: ast.Module = field(repr=False)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Live:
    """A real object, from a module that is already imported or light."""

    value: Any


@dataclass(frozen=True)
class Definition:
    """A class or function defined in a module's source."""

    module: Module
    node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def qualname(self) -> str:
        return f"{self.module.name}.{self.node.name}"

    @property
    def is_class(self) -> bool:
        return isinstance(self.node, ast.ClassDef)


@dataclass(frozen=True)
class Value:
    """A module-level ``name = <expression>`` (a constant, a type alias)."""

    module: Module
    expr: ast.expr


# --- finding and parsing modules ---------------------------------------------------------------------------


@cache
def _spec(name: str) -> Any:
    """The import spec of module ``name``, found without importing anything new (None: no such module)."""
    parent, _, last = name.rpartition(".")
    if not parent or parent in sys.modules:
        try:
            return importlib.util.find_spec(name)  # imports nothing new: the parent, if any, is imported already
        except (ImportError, ValueError):
            return None
    parent_spec = _spec(parent)
    locations = getattr(parent_spec, "submodule_search_locations", None) if parent_spec else None
    for location in locations or ():
        folder = Path(location)
        if (folder / last / "__init__.py").is_file():
            return _FileSpec(name, str(folder / last / "__init__.py"), [str(folder / last)])
        if (folder / f"{last}.py").is_file():
            return _FileSpec(name, str(folder / f"{last}.py"), None)
    for location in locations or ():  # a namespace package, or a compiled module: found, without source
        folder = Path(location)
        if (folder / last).is_dir() or any(folder.glob(f"{last}.*.so")) or any(folder.glob(f"{last}.*.pyd")):
            return _FileSpec(name, None, [str(folder / last)] if (folder / last).is_dir() else None)
    return None


@dataclass
class _FileSpec:
    name: str
    origin: str | None
    submodule_search_locations: list[str] | None


def module_exists(name: str) -> bool:
    return name in sys.modules or _spec(name) is not None


@cache
def parsed(name: str) -> Module | None:
    """Module ``name``'s source, parsed (None: no such module, or no Python source for it)."""
    spec = _spec(name)
    origin = getattr(spec, "origin", None) if spec else None
    if not origin or not origin.endswith(".py"):
        return None
    path = Path(origin)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return Module(name, path, spec.submodule_search_locations is not None, tree)


def _is_light(name: str) -> bool:
    """Modules used live: the standard library, the light ones above, and this package's config checks (whose
    `require` and `ConfigError` the reading recognises as themselves)."""
    top = name.partition(".")[0]
    return top in LIGHT_MODULES or top in sys.stdlib_module_names or name.startswith(("multiloss.config.", "builtins"))


def module_ref(name: str) -> Live | Module | Any:
    """Module ``name``: live when light, else its parsed source — even when imported already, so that the reading is
    the same in a process that has imported torch (a test's) as before the imports — and live only when it has no
    Python source (a compiled module already imported); UNKNOWN where neither is there."""
    if _is_light(name) or name == "multiloss.config":
        try:
            return Live(importlib.import_module(name))
        except ImportError:
            return NOT_BOUND
    if _spec(name) is None:
        return NOT_BOUND
    module = parsed(name)
    if module is None and name in sys.modules:
        return Live(sys.modules[name])
    return module if module is not None else UNKNOWN


# --- names bound in a module --------------------------------------------------------------------------------


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _bindings(module: Module, stmt: ast.stmt) -> Iterator[tuple[str, Any]]:
    """The names ``stmt`` binds at its module's top level, each with what it binds it to."""
    if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        yield stmt.name, Definition(module, stmt)
    elif isinstance(stmt, ast.Assign):
        for target in stmt.targets:
            if isinstance(target, ast.Name):
                yield target.id, Value(module, stmt.value)
            else:
                stored = (n for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
                yield from ((n.id, UNKNOWN) for n in stored)  # unpacked (`a, b = ...`); not `a.doc = ...`
    elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
        yield stmt.target.id, Value(module, stmt.value)
    elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
        yield stmt.target.id, UNKNOWN
    elif isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.asname:
                yield alias.asname, ("module", alias.name)
            else:
                top = alias.name.partition(".")[0]
                yield top, ("module", top)
    elif isinstance(stmt, ast.ImportFrom):
        source = _absolute(module, stmt)
        for alias in stmt.names:
            if alias.name != "*":
                yield alias.asname or alias.name, ("from", source, alias.name)
    elif isinstance(stmt, ast.Delete):
        yield from ((t.id, NOT_BOUND) for t in stmt.targets if isinstance(t, ast.Name))
    elif isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
        return  # not bound at run time
    elif isinstance(stmt, ast.If | ast.Try | ast.For | ast.While | ast.With):
        # A branch or a loop may bind or not: what it binds is unknown at the top level.
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                yield node.id, UNKNOWN
            elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node is not stmt:
                yield node.name, UNKNOWN
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    yield (alias.asname or alias.name).partition(".")[0], UNKNOWN


@cache
def _table(module: Module) -> dict[str, Any]:
    """Every name ``module``'s top level binds, with its last binding."""
    table: dict[str, Any] = {}
    for stmt in module.tree.body:
        table.update(_bindings(module, stmt))
    return table


def _binding(module: Module, stmt: ast.stmt, name: str) -> Any:
    """What ``stmt`` binds ``name`` to, if it binds it (None: it does not)."""
    found = None
    for bound_name, bound in _bindings(module, stmt):
        if bound_name == name:
            found = bound
    return found


@cache
def _star_sources(module: Module) -> tuple[str, ...]:
    return tuple(
        _absolute(module, s)
        for s in module.tree.body
        if isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names)
    )


@cache
def lookup(module: Module, name: str, _depth: int = 0) -> Any:
    """What ``module``'s top-level ``name`` is at run time: a `Definition`, `Value`, `Live`, `Module`, UNKNOWN, or
    NOT_BOUND (no such name: a config naming it fails to import)."""
    if _depth > 12:
        return UNKNOWN
    bound = _table(module).get(name)
    if bound is UNKNOWN or isinstance(bound, Definition | Value):
        return bound
    if isinstance(bound, tuple) and bound[0] == "module":
        return module_ref(bound[1])
    if isinstance(bound, tuple):  # from <source> import <name>: its submodule of that name, else a name there
        _, source, attribute = bound
        if module_exists(f"{source}.{attribute}"):
            return module_ref(f"{source}.{attribute}")
        return attribute_of(module_ref(source), attribute, source, _depth + 1)
    if bound is NOT_BOUND:
        return NOT_BOUND
    for source in _star_sources(module):
        found = attribute_of(module_ref(source), name, source, _depth + 1)
        if found is not NOT_BOUND:
            return found if not name.startswith("_") else NOT_BOUND
    if module.is_package and module_exists(f"{module.name}.{name}"):
        return module_ref(f"{module.name}.{name}")  # what `package.name` is once its submodule is imported
    if any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in module.tree.body):
        return UNKNOWN  # a module-level __getattr__ serves names the source does not bind
    if hasattr(builtins, name):
        return Live(getattr(builtins, name))
    return NOT_BOUND


def attribute_of(owner: Any, name: str, owner_name: str, _depth: int = 0) -> Any:
    """``owner.name``, where ``owner`` is a resolved module (or a live object)."""
    if isinstance(owner, Live):
        if hasattr(owner.value, name):
            return Live(getattr(owner.value, name))
        if inspect.ismodule(owner.value) and module_exists(f"{owner_name}.{name}"):
            return module_ref(f"{owner_name}.{name}")
        return NOT_BOUND
    if isinstance(owner, Module):
        found = lookup(owner, name, _depth)
        if found is NOT_BOUND and module_exists(f"{owner.name}.{name}"):
            return module_ref(f"{owner.name}.{name}")
        return found
    return UNKNOWN if owner is UNKNOWN else NOT_BOUND


def locate(path: str) -> tuple[Any, str | None]:
    """What Hydra's ``get_object(path)`` would return, read from source, and, when it would fail, Hydra's message.

    Mirrors ``hydra._internal.utils._locate``: the first part imported, each next one an attribute or else a
    submodule. Returns (``UNKNOWN``, None) where the source cannot tell.
    """
    parts = path.split(".")
    if not path or not all(parts):
        return UNKNOWN, None
    first = module_ref(parts[0])
    if first is NOT_BOUND:
        error = f"ModuleNotFoundError(\"No module named '{parts[0]}'\")"
        return NOT_BOUND, f"Error loading '{path}':\n{error}\nAre you sure that module '{parts[0]}' is installed?"
    found = first
    for m in range(1, len(parts)):
        owner_name = ".".join(parts[:m])
        is_module = isinstance(found, Module) or (isinstance(found, Live) and inspect.ismodule(found.value))
        if not is_module:
            if isinstance(found, Live) and hasattr(found.value, parts[m]):
                found = Live(getattr(found.value, parts[m]))
                continue
            return UNKNOWN, None  # an attribute of a class or an object: not read from source here
        found = attribute_of(found, parts[m], owner_name)
        if found is NOT_BOUND:
            name = ".".join(parts[: m + 1])
            error = f"ModuleNotFoundError(\"No module named '{name}'\")"
            return NOT_BOUND, (
                f"Error loading '{path}':\n{error}\nAre you sure that '{parts[m]}' is importable from module "
                f"'{owner_name}'?"
            )
        if found is UNKNOWN:
            return UNKNOWN, None
    return resolve(found), None


def resolve(ref: Any) -> Any:
    """A `Value` whose expression is a plain name or attribute, followed to what it names."""
    for _ in range(12):
        if not isinstance(ref, Value):
            return ref
        if isinstance(ref.expr, ast.Name | ast.Attribute):
            ref = name_in(ref.module, ref.expr)
        else:
            return ref
    return UNKNOWN


def name_in(module: Module, expr: ast.expr) -> Any:
    """What a name or a dotted attribute (``nn.Module``) in ``module``'s top level refers to."""
    if isinstance(expr, ast.Name):
        return resolve(lookup(module, expr.id))
    if isinstance(expr, ast.Attribute):
        owner = name_in(module, expr.value)
        if isinstance(owner, Module):
            return resolve(attribute_of(owner, expr.attr, owner.name))
        if isinstance(owner, Live):
            name = getattr(owner.value, "__name__", "") if inspect.ismodule(owner.value) else ""
            return resolve(attribute_of(owner, expr.attr, name))
        if isinstance(owner, Definition) and owner.is_class:
            for stmt in owner.node.body:
                bound = _binding(owner.module, stmt, expr.attr)
                if isinstance(bound, Definition | Value):
                    return resolve(bound)
        return UNKNOWN if owner is not NOT_BOUND else NOT_BOUND
    return UNKNOWN


# --- classes: bases, order, attributes ----------------------------------------------------------------------


def own_packages(definition: Definition) -> frozenset[str]:
    """The packages a definition's reading looks into: its own top-level package's, and multiloss's."""
    return frozenset({definition.module.name.partition(".")[0], "multiloss"})


@dataclass(frozen=True)
class External:
    """A base class of a package not read (``within``): named, not looked into."""

    module: Module
    name: str  # as the source writes it (``L.LightningModule``)


@cache
def bases(cls: Definition, within: frozenset[str] | None = None) -> list[Any] | None:
    """``cls``'s bases, each a class `Definition`, a live class, or (outside the top-level packages ``within``, when
    given) an `External` (None: one the source does not tell)."""
    found: list[Any] = []
    for expr in cls.node.bases:
        if isinstance(expr, ast.Subscript):  # Generic[T], Protocol[T]: the class subscripted
            expr = expr.value
        package = _package_of(cls.module, expr)
        if within is not None and package not in within and not _is_light(package):
            found.append(External(cls.module, ast.unparse(expr)))
            continue
        base = name_in(cls.module, expr)
        if isinstance(base, Live) and inspect.isclass(base.value):
            found.append(base.value)
        elif isinstance(base, Definition) and base.is_class:
            found.append(base)
        else:
            return None
    return found or [object]


def _package_of(module: Module, expr: ast.expr) -> str:
    """The top-level package a name (``nn.Module``, ``LightningModule``) comes from, told from ``module``'s imports
    alone (nothing parsed): the builtins' and the standard library's count as their own."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return ""
    bound = _table(module).get(expr.id)
    if isinstance(bound, tuple):
        return bound[1].partition(".")[0]  # ("module", name) or ("from", module, attribute)
    if bound is None and hasattr(builtins, expr.id):
        return "builtins"
    return module.name.partition(".")[0]


@cache
def mro(cls: Any, within: frozenset[str] | None = None) -> list[Any] | None:
    """The method resolution order of a class `Definition` (C3, as Python computes it), or None. ``within``: only
    classes of those top-level packages are looked into; the others are `External` (the order of the classes looked
    into stays right while no external class derives from one of them)."""
    return _mro(cls, 0, within)


@cache
def _mro(cls: Any, depth: int, within: frozenset[str] | None) -> list[Any] | None:
    if inspect.isclass(cls):
        return list(cls.__mro__)
    if isinstance(cls, External):
        return [cls]
    if depth > 30:
        return None
    direct = bases(cls, within)
    if direct is None:
        return None
    orders = []
    for base in direct:
        order = _mro(base, depth + 1, within)
        if order is None:
            return None
        orders.append(order)
    merged = _c3([*orders, list(direct)])
    return None if merged is None else [cls, *merged]


def _c3(sequences: list[list[Any]]) -> list[Any] | None:
    result: list[Any] = []
    sequences = [list(s) for s in sequences if s]
    while sequences:
        for seq in sequences:
            head = seq[0]
            if not any(head in s[1:] for s in sequences):
                break
        else:
            return None  # inconsistent: Python would refuse the class
        result.append(head)
        sequences = [[c for c in s if c != head] for s in sequences]
        sequences = [s for s in sequences if s]
    return result


def class_attribute(cls: Definition, name: str, within: frozenset[str] | None = None) -> Any:
    """The expression ``name`` is set to in the body of the first class of ``cls``'s order that sets it (classes of
    packages outside ``within``, when given, are taken not to set it)."""
    for klass in mro(cls, within) or [cls]:
        if isinstance(klass, External):
            continue
        if inspect.isclass(klass):
            return Live(getattr(klass, name)) if hasattr(klass, name) else NOT_BOUND
        for stmt in klass.node.body:
            bound = _binding(klass.module, stmt, name)
            if bound is not None:
                return bound
    return NOT_BOUND


@cache
def method(cls: Any, name: str) -> Any:
    """The function ``name`` defined in a class's own body (a `Definition`, a live function), None if not there,
    UNKNOWN if set some other way."""
    if inspect.isclass(cls):
        return Live(vars(cls)[name]) if name in vars(cls) else None
    bound = None
    for stmt in cls.node.body:
        found = _binding(cls.module, stmt, name)
        if found is not None:
            bound = found
    if bound is None:
        return None
    return bound if isinstance(bound, Definition) else UNKNOWN


def is_subclass(cls: Definition, qualname: str) -> bool | None:
    """Whether ``cls`` has a class of that qualified name (``module.Class``) in its order (None: unknown); only the
    classes of its own package and of that class's are looked into."""
    within = frozenset({cls.module.name.partition(".")[0], qualname.partition(".")[0]})
    order = mro(cls, within)
    if order is None:
        return None
    names = [
        f"{c.__module__}.{c.__qualname__}" if inspect.isclass(c) else "" if isinstance(c, External) else c.qualname
        for c in order
    ]
    return qualname in names


# --- signatures -----------------------------------------------------------------------------------------


@dataclass
class Parameter:
    name: str
    kind: inspect._ParameterKind
    default: ast.expr | None  # None: no default
    annotation: ast.expr | None
    has_default: bool


@dataclass
class Function:
    """A function's parameters, and the module its annotations and defaults are read in."""

    module: Module | None
    node: ast.FunctionDef | ast.AsyncFunctionDef | None
    parameters: list[Parameter]
    live: Any = None  # the real function, for a live one


def function_of(ref: Any) -> Function | None:
    if isinstance(ref, Definition) and not ref.is_class:
        return Function(ref.module, ref.node, _parameters(ref.node))
    if isinstance(ref, Live) and callable(ref.value):
        try:
            sig = inspect.signature(ref.value)
        except (TypeError, ValueError):
            return None
        params = [Parameter(p.name, p.kind, None, None, p.default is not p.empty) for p in sig.parameters.values()]
        return Function(None, None, params, live=ref.value)
    return None


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Parameter]:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    kind = inspect.Parameter
    params = [
        Parameter(
            a.arg,
            kind.POSITIONAL_ONLY if i < len(args.posonlyargs) else kind.POSITIONAL_OR_KEYWORD,
            d,
            a.annotation,
            d is not None,
        )
        for i, (a, d) in enumerate(zip(positional, defaults))
    ]
    if args.vararg:
        params.append(Parameter(args.vararg.arg, kind.VAR_POSITIONAL, None, args.vararg.annotation, False))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        params.append(Parameter(a.arg, kind.KEYWORD_ONLY, d, a.annotation, d is not None))
    if args.kwarg:
        params.append(Parameter(args.kwarg.arg, kind.VAR_KEYWORD, None, args.kwarg.annotation, False))
    return params


def initializers(target: Any) -> list[tuple[Any, Function]] | None:
    """``(class, __init__)`` for each class in ``target``'s order that defines ``__init__`` (what
    `multiloss.config.validate` reads of an imported class) as far as the first that takes no ``**kwargs``, or
    ``[(None, function)]`` for a function; None if the source does not tell."""
    is_function = not target.is_class if isinstance(target, Definition) else not inspect.isclass(target.value)
    if is_function:
        function = function_of(target)
        return None if function is None else [(None, function)]
    cls = target.value if isinstance(target, Live) else target
    if isinstance(cls, Definition) and any(not _harmless_decorator(d) for d in cls.node.decorator_list):
        return None  # a decorator may write the class's __init__ (dataclass, attrs)
    if isinstance(cls, Definition):
        own = method(cls, "__init__")
        function = function_of(own) if isinstance(own, Definition) else None
        if function is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in function.parameters):
            return [(cls, function)]  # it takes no other keys: the classes after it need not be read
    order = list(cls.__mro__) if inspect.isclass(cls) else mro(cls)
    if order is None:
        return None
    found = []
    for klass in order:
        init = method(klass, "__init__")
        if init is None:
            continue
        function = function_of(init) if init is not UNKNOWN else None
        if function is None:
            return None
        found.append((klass, function))
    return found


def _harmless_decorator(expr: ast.expr) -> bool:
    """Class decorators that leave ``__init__`` as written (a registration, a final marker)."""
    name = expr.func if isinstance(expr, ast.Call) else expr
    text = ast.unparse(name)
    return text.rsplit(".", 1)[-1] in {"final", "runtime_checkable", "total_ordering", "unique"}


# --- annotations ----------------------------------------------------------------------------------------


def annotation(module: Module, expr: ast.expr) -> Any:
    """The object an annotation evaluates to at run time (as ``typing.get_type_hints`` gives it); ``typing.Any``
    for a part the source cannot build (a class of a module not imported: the check is left to the imported
    object), NOT_BOUND when a name in it is not bound at run time (get_type_hints would fail)."""
    try:
        return _annotation(module, expr)
    except _NotBound:
        return NOT_BOUND


class _NotBound(Exception):
    pass


def _annotation(module: Module, expr: ast.expr) -> Any:
    import typing

    if isinstance(expr, ast.Constant):
        if expr.value is None:
            return type(None)
        if isinstance(expr.value, str):
            try:
                inner = ast.parse(expr.value, mode="eval").body
            except SyntaxError:
                return typing.Any
            return _annotation(module, inner)
        return expr.value
    if isinstance(expr, ast.Name | ast.Attribute):
        if _names_a_class_elsewhere(module, expr):
            return typing.Any  # a class of a module not imported: typeguard could not check it here anyway
        ref = name_in(module, expr)
        if ref is NOT_BOUND:
            raise _NotBound
        if isinstance(ref, Live):
            return ref.value
        if isinstance(ref, Value):
            return _annotation(ref.module, ref.expr)  # a type alias
        return typing.Any
    if isinstance(expr, ast.Subscript):
        origin = _annotation(module, expr.value)
        if origin is typing.Any:
            return typing.Any
        items = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
        args = [_literal_or_annotation(module, origin, e) for e in items]
        try:
            return origin[tuple(args)] if len(args) > 1 else origin[args[0]]
        except TypeError:
            return typing.Any
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        left, right = _annotation(module, expr.left), _annotation(module, expr.right)
        try:
            return left | right
        except TypeError:
            return typing.Union[left, right]  # noqa: UP007  (what `X | "Y"` forms give get_type_hints)
    if isinstance(expr, ast.List):
        return [_annotation(module, e) for e in expr.elts]
    return typing.Any


def _names_a_class_elsewhere(module: Module, expr: ast.expr) -> bool:
    """A CamelCase name imported from a package that is not light (``Tensor``, ``nn.Module``, ``Callback``): a class,
    not a type alias, by convention (``_PRECISION_INPUT``, ``ParamsT`` are read) — told without parsing its module."""
    last = expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""
    camel = last[:1].isupper() and not last.isupper() and not last.endswith("T") and "_" not in last
    package = _package_of(module, expr)
    return camel and package != module.name.partition(".")[0] and not _is_light(package)


def _literal_or_annotation(module: Module, origin: Any, expr: ast.expr) -> Any:
    import typing

    if origin is typing.Literal or getattr(origin, "__name__", "") == "Literal":
        try:
            return ast.literal_eval(expr)
        except ValueError:
            return typing.Any
    return _annotation(module, expr)


def literal(module: Module | None, expr: ast.expr | None) -> Any:
    """A default or a class attribute's value when it is a literal (numbers, strings, tuples, None...), else UNKNOWN."""
    if expr is None:
        return UNKNOWN
    try:
        return ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        if module is not None and isinstance(expr, ast.Name | ast.Attribute):
            ref = name_in(module, expr)
            if isinstance(ref, Live):
                return ref.value
            if isinstance(ref, Value):
                return literal(ref.module, ref.expr)
        return UNKNOWN


def forget() -> None:
    """Drop every module parsed and every answer kept: the trees are many small objects, and alive they would make
    each of the garbage collector's passes over the heap (through the imports that follow) that much longer."""
    for kept in (_spec, parsed, _table, _star_sources, lookup, bases, mro, _mro, method):
        kept.cache_clear()
