"""What a constructor would reject of its arguments, found in its source before anything is imported.

A component checks its arguments first thing in ``__init__`` (``require(batch_size >= 1, ...)``, torch's
``if not 0.0 <= lr: raise ValueError(...)``, Lightning's ``if max_steps < -1: raise ...``). `rejection` follows
that code with the config's values, statement by statement, as far as it can tell what the code does: plain
values, comparisons, the pure built-ins, ``super().__init__``, calls into functions and classes whose source it
reads (`multiloss.config.source`). Nothing is imported for it and no call of the code is made: each statement is
read, never run. Where a value comes from something it cannot read (a network built, a call into a compiled
module), that value is unknown, and so is every check that uses it; where the code's path can no longer be told
(a branch on an unknown value that may return, a ``try``), it stops. So it only ever reports an error the real
constructor raises on the same values; the rest is left to the real constructor, once torch is imported.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import math
import operator
import os
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from multiloss.config import source
from multiloss.config.errors import ConfigError, require
from multiloss.config.source import NOT_BOUND, UNKNOWN, Definition, Live, Module, Value

MAX_DEPTH = 3  # calls followed inside calls (a class's chain of ``super().__init__`` counts as one)
LIBRARY_DEPTH = 1  # ... for a library's own class (the Trainer, an optimizer): its checks sit in the constructor
MAX_STEPS = 20_000  # statements and expressions read for one constructor
MAX_SIZE = 10_000  # the longest sequence built while reading
# The tests set it (and MULTILOSS_STRICT_EARLY=1 for their commands): a construct the reading fails on raises, where a
# user's run leaves the check to the run's own.
STRICT = os.environ.get("MULTILOSS_STRICT_EARLY") == "1"


@dataclass(frozen=True)
class Raised:
    """An exception other than `ConfigError` the source raises: its class's qualified name(s) and its message."""

    classes: tuple[str, ...]  # the qualified names in the exception class's order (``builtins.ValueError``, ...)
    message: str

    def is_a(self, *names: str) -> bool:
        return any(name in self.classes for name in names)


def construct(target: Any, arguments: Mapping[str, Any]) -> tuple[ConfigError | Raised | None, Any]:
    """What ``target(**arguments)`` raises among the checks its source makes that can be told from ``arguments``
    alone (`UNKNOWN` for an argument whose value is not known), or None; and the instance it leaves, as far as its
    source tells (its attributes), or UNKNOWN."""
    reader = _Reader(target)
    return _read(lambda: reader.call(_Callable(target), [], dict(arguments), depth=0))


def rejection(target: Any, arguments: Mapping[str, Any]) -> ConfigError | Raised | None:
    """`construct`'s error alone."""
    return construct(target, arguments)[0]


def method_rejection(cls: Definition, instance: Any, name: str, *args: Any) -> ConfigError | Raised | None:
    """What ``instance.name(*args)`` raises, for an instance whose constructor was read (`construct`)."""
    reader = _Reader(cls)
    fn = _find_method(cls, name, reader.packages)
    if not isinstance(fn, Definition):
        return None
    owner = _defining_class(cls, name, reader.packages)
    return _read(lambda: reader.run_function(fn, [instance, *args], {}, depth=0, owner=owner))[0]


def _read(reading: Callable[[], Any]) -> tuple[ConfigError | Raised | None, Any]:
    """``reading()``'s value, or the error it surely raises; (None, UNKNOWN) where it cannot be told."""
    try:
        return None, reading()
    except _Raise as raised:
        return raised.error, UNKNOWN
    except (_Stop, _Return, _Break, _Continue, RecursionError):
        return None, UNKNOWN
    except Exception:  # a construct this reader gets wrong: the real constructor still checks, later
        if STRICT:
            raise
        return None, UNKNOWN


def _find_method(cls: Definition, name: str, within: frozenset[str] | None = None) -> Any:
    for klass in source.mro(cls, within) or [cls]:
        if isinstance(klass, source.External):
            return None
        found = source.method(klass, name)
        if found is not None:
            return found
    return None


# --- control flow, as exceptions ---------------------------------------------------------------------------


class _Raise(Exception):
    def __init__(self, error: ConfigError | Raised) -> None:
        self.error = error


class _Stop(Exception):
    """The code's path can no longer be told."""


class _Return(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


# --- values the reader makes ------------------------------------------------------------------------------


@dataclass(eq=False)
class Instance:
    """An object under construction: its class and the attributes its constructor set so far (unknown if absent)."""

    cls: Any
    attributes: dict[str, Any] = field(default_factory=dict)
    forgotten: bool = False  # code not read may have set any attribute: those not set since are unknown

    def forget(self) -> None:
        self.attributes.clear()
        self.forgotten = True


@dataclass(frozen=True)
class _Callable:
    """Something the source defines that can be called: a function, a class."""

    target: Any  # Definition or Live


@dataclass(frozen=True)
class _Bound:
    """A method of ``instance`` found in its class's order (``self.check(...)``, ``super().__init__``)."""

    function: Definition
    instance: Instance
    owner: Any  # the class whose body defines it


@dataclass(frozen=True)
class _Opaque:
    """``super().__init__`` of a class not read: once called, any attribute of the instance may be set."""

    instance: Instance


@dataclass(frozen=True)
class _Super:
    instance: Instance
    after: Any  # the class in whose method ``super()`` was called


@dataclass(frozen=True)
class _Exception:
    """An exception constructed (not yet raised)."""

    classes: tuple[str, ...]
    args: tuple[Any, ...]


_PURE_BUILTINS = {
    getattr(builtins, name)
    for name in [
        "abs",
        "all",
        "any",
        "bool",
        "chr",
        "dict",
        "divmod",
        "enumerate",
        "float",
        "format",
        "frozenset",
        "int",
        "isinstance",
        "issubclass",
        "len",
        "list",
        "max",
        "min",
        "ord",
        "range",
        "repr",
        "reversed",
        "round",
        "set",
        "sorted",
        "str",
        "sum",
        "tuple",
        "zip",
        "type",
        "callable",
        "hasattr",
    ]
}
_PURE_METHODS = {
    str: set(
        [
            "capitalize",
            "casefold",
            "count",
            "endswith",
            "find",
            "format",
            "index",
            "isalnum",
            "isalpha",
            "isdigit",
            "isidentifier",
            "islower",
            "isnumeric",
            "isspace",
            "istitle",
            "isupper",
            "join",
            "lower",
            "lstrip",
            "partition",
            "removeprefix",
            "removesuffix",
            "replace",
            "rfind",
            "rindex",
            "rpartition",
            "rsplit",
            "rstrip",
            "split",
            "splitlines",
            "startswith",
            "strip",
            "swapcase",
            "title",
            "upper",
            "zfill",
        ]
    ),
    dict: {"get", "keys", "items", "values", "copy"},
    DictConfig: {"get", "keys", "items", "values"},
    list: {"count", "index", "copy"},
    ListConfig: {"count", "index"},
    tuple: {"count", "index"},
    int: {"bit_length", "is_integer"},
    float: {"is_integer"},
}
_PURE_FUNCTIONS = {
    *(v for v in vars(math).values() if callable(v)),
    *(getattr(operator, n) for n in dir(operator) if not n.startswith("_") and callable(getattr(operator, n))),
    *(getattr(inspect, n) for n in dir(inspect) if n.startswith("is") and callable(getattr(inspect, n))),
    # They read the file system, never write: the answer the run's own check gets a second later (a data path).
    os.path.isfile,
    os.path.isdir,
    os.path.exists,
    OmegaConf.to_container,
    OmegaConf.is_missing,
    OmegaConf.is_config,
    OmegaConf.is_list,
    OmegaConf.is_dict,
}
_PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.BitOr: operator.or_,
    ast.BitAnd: operator.and_,
    ast.BitXor: operator.xor,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


def _class_table(value: Any) -> bool:
    """A dict of known keys to classes the source defines (the GAN's spellings): read entry by entry."""
    return (
        isinstance(value, dict)
        and all(_known(k) for k in value)
        and all(isinstance(v, _Callable) and isinstance(v.target, Definition) for v in value.values())
    )


def _known(value: Any) -> bool:
    """A value the reader may compute with: plain data (config values included), all of it known."""
    if value is UNKNOWN:
        return False
    if isinstance(value, DictConfig | ListConfig):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return len(value) <= MAX_SIZE and all(_known(v) for v in value)
    if isinstance(value, dict):
        return len(value) <= MAX_SIZE and all(_known(k) and _known(v) for k, v in value.items())
    if isinstance(value, str | bytes):
        return len(value) <= 100 * MAX_SIZE
    return isinstance(value, (*_PLAIN, types.UnionType)) or inspect.isclass(value) or inspect.ismodule(value)


def _immutable(value: Any) -> bool:
    if isinstance(value, tuple | frozenset):
        return all(_immutable(v) for v in value)
    return isinstance(value, type(None) | bool | int | float | complex | str | bytes | range) or (
        inspect.isclass(value) or inspect.ismodule(value) or isinstance(value, _Callable | Module)
    )


def _usable(value: Any) -> Any:
    """A real object the reading may hold: plain data, a module, something to call (never called unless pure)."""
    return value if (_known(value) or callable(value) or inspect.ismodule(value)) else UNKNOWN


def _is_plain_data(value: Any) -> bool:
    return isinstance(value, (*_PLAIN, DictConfig, ListConfig))


# --- the reader ------------------------------------------------------------------------------------------


class _Reader:
    """Reads one constructor: the target's own package's code and multiloss's, no other (a library's internals cost
    a parse each and hold no check of the config's values)."""

    def __init__(self, target: Any) -> None:
        self.packages = source.own_packages(target) if isinstance(target, Definition) else frozenset({"multiloss"})
        own = isinstance(target, Definition) and target.module.name.partition(".")[0] == "multiloss"
        self.max_depth = MAX_DEPTH if own else LIBRARY_DEPTH
        self.steps = 0
        self.stops = 0  # calls whose reading stopped before their end (what they did after is not known)
        self.globals: dict[tuple[int, str], Any] = {}

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Stop

    # -- calls --

    def call(self, callee: Any, args: list[Any], kwargs: dict[str, Any], depth: int) -> Any:
        target = source.resolve(callee.target) if isinstance(callee, _Callable) else None
        if isinstance(target, Live):
            return self.call_live(target.value, args, kwargs)
        exception = None
        if isinstance(target, Definition) and target.is_class and self.reads(target):
            exception = _exception_classes(target, self.packages)
            if exception:  # an exception built, at any depth
                return _Exception(exception, tuple(args)) if all(_known(a) for a in args) and not kwargs else UNKNOWN
        if depth > self.max_depth:
            self.stops += 1
            return UNKNOWN
        if isinstance(callee, _Bound):
            return self.run_function(callee.function, [callee.instance, *args], kwargs, depth, owner=callee.owner)
        if not isinstance(target, Definition) or not self.reads(target):
            self.stops += 1
            return UNKNOWN
        if not target.is_class:
            return self.run_function(target, args, kwargs, depth, owner=None)
        if exception is None:  # its order cannot be told
            self.stops += 1
            return UNKNOWN
        instance = Instance(target)
        self.initialize(instance, target, args, kwargs, depth)
        return instance

    def initialize(self, instance: Instance, start: Any, args: list[Any], kwargs: dict[str, Any], depth: int) -> None:
        """Read the first ``__init__`` in the order of ``instance``'s class from ``start`` on."""
        order = source.mro(instance.cls, self.packages) if isinstance(instance.cls, Definition) else None
        if order is None:
            self.stops += 1
            return
        for klass in order[order.index(start) :] if start in order else []:
            if inspect.isclass(klass):
                return  # a class of a live module (object, Generic): nothing its __init__ checks is read here
            if isinstance(klass, source.External):
                instance.forget()  # its __init__, not read, may set any attribute
                self.stops += 1
                return
            init = source.method(klass, "__init__")
            if init is None:
                continue
            if not isinstance(init, Definition) or not self.reads(init):
                self.stops += 1
                return
            self.run_function(init, [instance, *args], kwargs, depth, owner=klass)
            return

    def class_attribute(self, cls: _Callable, name: Any, default: Any) -> Any:
        """``getattr(cls, name, default)`` of a class the source defines: the literal its order's bodies set it to."""
        target = cls.target
        if not (isinstance(target, Definition) and target.is_class and isinstance(name, str)):
            return UNKNOWN
        bound = source.class_attribute(target, name)  # every class of its order read: an unread one may set it
        if bound is NOT_BOUND and source.mro(target) is not None:
            return default
        return self.value_of(bound)

    def value_of(self, found: Any) -> Any:
        """The value the reading works with for a name the source binds (`multiloss.config.source.lookup`)."""
        found = source.resolve(found)
        if isinstance(found, Live):
            return _usable(found.value)
        if isinstance(found, Definition):
            return _Callable(found)
        if isinstance(found, Value):
            return self.module_value(found.module, found.expr)
        if isinstance(found, Module):
            return found
        return UNKNOWN

    def reads(self, definition: Definition) -> bool:
        return definition.module.name.partition(".")[0] in self.packages

    def call_live(self, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """A call of a real function (only ever of a pure one, or of `require`, or to build an exception)."""
        if fn is require:
            ok, *rest = _bind_require(args, kwargs)
            if _known(ok) and not bool(ok) and all(_known(v) for v in rest):
                raise _Raise(ConfigError(*rest))
            return None
        if fn is get_object:  # Hydra's lookup of a dotted path: where the source says it points
            found = source.locate(args[0])[0] if len(args) == 1 and isinstance(args[0], str) and not kwargs else None
            if isinstance(found, Definition):
                return _Callable(found)
            return found.value if isinstance(found, Live) else UNKNOWN
        if fn is isinstance and len(args) == 2 and _is_plain_data(args[0]) and not kwargs:
            classes = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(c, _Callable) for c in classes):
                return _plain_isinstance(args[0], classes)
        if fn is getattr and args and isinstance(args[0], _Callable) and len(args) in (2, 3):
            return self.class_attribute(args[0], args[1], args[2] if len(args) == 3 else UNKNOWN)
        if inspect.isclass(fn) and issubclass(fn, BaseException):
            if not all(_known(a) for a in args) or not all(_known(v) for v in kwargs.values()):
                return UNKNOWN
            if fn is ConfigError or issubclass(fn, ConfigError):
                try:
                    return fn(*args, **kwargs)
                except Exception:
                    return UNKNOWN
            names = tuple(f"{c.__module__}.{c.__qualname__}" for c in fn.__mro__)
            return _Exception(names, tuple(args)) if not kwargs else UNKNOWN
        pure = fn in _PURE_BUILTINS or fn in _PURE_FUNCTIONS
        if not pure or not all(_known(a) for a in args) or not all(_known(v) for v in kwargs.values()):
            return UNKNOWN
        whole = fn in (list, tuple, set, frozenset, sorted, sum, min, max, all, any)
        if whole and args and isinstance(args[0], range) and len(args[0]) > MAX_SIZE:
            return UNKNOWN
        try:
            result = fn(*args, **kwargs)
        except Exception:
            return UNKNOWN
        if isinstance(result, Iterator) or inspect.isgenerator(result):  # zip, enumerate, reversed, map
            result = list(_take(result))
        return result if _known(result) else UNKNOWN

    def run_function(self, fn: Definition, args: list[Any], kwargs: dict[str, Any], depth: int, owner: Any) -> Any:
        node = fn.node
        env = None if isinstance(node, ast.AsyncFunctionDef) or _is_generator(node) else self.bind(fn, args, kwargs)
        if env is None:
            self.stops += 1
            return UNKNOWN
        frame = _Frame(self, fn.module, env, owner, depth)
        try:
            frame.block(node.body)
        except _Return as returned:
            return returned.value
        except (_Stop, _Break, _Continue):
            self.stops += 1
            return UNKNOWN
        return None

    def bind(self, fn: Definition, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        params = source.function_of(fn)
        if params is None:
            return None
        env: dict[str, Any] = {}
        positional = list(args)
        remaining = dict(kwargs)
        kind = inspect.Parameter
        for p in params.parameters:
            if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD) and positional:
                env[p.name] = positional.pop(0)
            elif p.kind is kind.VAR_POSITIONAL:
                env[p.name] = tuple(positional) if all(_known(a) for a in positional) else UNKNOWN
                positional = []
            elif p.kind is kind.VAR_KEYWORD:
                env[p.name] = remaining
                remaining = {}
            elif p.name in remaining and p.kind is not kind.POSITIONAL_ONLY:
                env[p.name] = remaining.pop(p.name)
            elif p.has_default:
                env[p.name] = self.module_value(fn.module, p.default)
            else:
                return None  # a missing argument: Python's own TypeError, not read here
        if positional or remaining:
            return None  # too many arguments: the same
        return env

    def module_value(self, module: Module, expr: ast.expr) -> Any:
        """An expression of ``module``'s top level (a default, a constant), read once."""
        key = (id(expr), module.name)
        if key not in self.globals:
            self.globals[key] = UNKNOWN  # while being read: a reference back to itself is unknown
            frame = _Frame(self, module, {}, None, MAX_DEPTH)
            try:
                self.globals[key] = frame.expr(expr)
            except (_Stop, _Raise, _Return, _Break, _Continue):
                self.globals[key] = UNKNOWN
        return self.globals[key]


def _bind_require(args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    names = ["ok", "key", "value", "accepted", "problem"]
    values = dict(zip(names, args)) | kwargs
    return [values.get("ok", UNKNOWN), *(values.get(n) for n in names[1:4]), values.get("problem")]


def _plain_isinstance(value: Any, classes: tuple[Any, ...]) -> Any:
    """``isinstance(value, classes)`` for a plain config value and classes some of which the source defines: such a
    class holds no plain value when its whole order is known and has no abstract base (which could register one)."""
    for cls in classes:
        if isinstance(cls, _Callable):
            order = source.mro(cls.target) if isinstance(cls.target, Definition) and cls.target.is_class else None
            if order is None or any(_may_claim_plain_values(c) for c in order):
                return UNKNOWN
        elif inspect.isclass(cls) or isinstance(cls, types.UnionType):
            if isinstance(value, cls):
                return True
        else:
            return UNKNOWN
    return False


def _may_claim_plain_values(cls: Any) -> bool:
    """A class whose instance check may take a dict or a number for one of its own: an ABC, a Protocol, a class with a
    metaclass of its own."""
    if inspect.isclass(cls):
        return cls not in (object,) and type(cls) is not type and cls.__module__ != "typing"
    return any(k.arg == "metaclass" for k in cls.node.keywords)


def _take(iterator: Iterator[Any]) -> Iterator[Any]:
    for i, item in enumerate(iterator):
        if i >= MAX_SIZE:
            raise _Stop
        yield item


def _is_generator(node: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.Yield | ast.YieldFrom)
        for n in ast.walk(node)
        if not isinstance(n, ast.FunctionDef | ast.Lambda | ast.AsyncFunctionDef) or n is node
    )


def _exception_classes(cls: Definition, within: frozenset[str]) -> tuple[str, ...] | None:
    """The qualified names of ``cls``'s order if it is an exception class, () if it is not one, None if unknown."""
    order = source.mro(cls, within)
    if order is None:
        return None
    # A class with a base not read is taken for no exception: raising it then stops the reading (`_Frame.raise_`),
    # never reports it.
    order = [c for c in order if not isinstance(c, source.External)]
    names = tuple(f"{c.__module__}.{c.__qualname__}" if inspect.isclass(c) else c.qualname for c in order)
    return names if "builtins.BaseException" in names else ()


# --- one function's frame ------------------------------------------------------------------------------------


class _Frame:
    def __init__(self, reader: _Reader, module: Module, env: dict[str, Any], owner: Any, depth: int) -> None:
        self.reader, self.module, self.env, self.owner, self.depth = reader, module, env, owner, depth

    # -- statements --

    def block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self.statement(stmt)

    def statement(self, stmt: ast.stmt) -> None:
        self.reader.tick()
        if isinstance(stmt, ast.Expr):
            if not isinstance(stmt.value, ast.Constant):
                self.expr(stmt.value)
        elif isinstance(stmt, ast.Assign):
            value = self.expr(stmt.value)
            for target in stmt.targets:
                self.assign(target, value)
        elif isinstance(stmt, ast.AnnAssign):
            if stmt.value is not None:
                self.assign(stmt.target, self.expr(stmt.value))
        elif isinstance(stmt, ast.AugAssign):
            current = self.expr(_as_load(stmt.target))
            self.assign(stmt.target, self.binary(stmt.op, current, self.expr(stmt.value)))
        elif isinstance(stmt, ast.If):
            test = self.truth(self.expr(stmt.test))
            if test is None:
                self.unknown_branch([stmt.body, stmt.orelse])
            else:
                self.block(stmt.body if test else stmt.orelse)
        elif isinstance(stmt, ast.For):
            self.loop(stmt)
        elif isinstance(stmt, ast.While):
            if self.truth(self.expr(stmt.test)) is False:
                self.block(stmt.orelse)
            else:
                raise _Stop
        elif isinstance(stmt, ast.Raise):
            self.raise_(stmt)
        elif isinstance(stmt, ast.Return):
            raise _Return(self.expr(stmt.value) if stmt.value is not None else None)
        elif isinstance(stmt, ast.Pass):
            pass
        elif isinstance(stmt, ast.Break):
            raise _Break
        elif isinstance(stmt, ast.Continue):
            raise _Continue
        elif isinstance(stmt, ast.Import | ast.ImportFrom):
            self.import_(stmt)
        elif isinstance(stmt, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            self.env[stmt.name] = UNKNOWN
        elif isinstance(stmt, ast.Delete):
            for target in stmt.targets:
                self.havoc(target)
        elif isinstance(stmt, ast.Assert):
            if self.truth(self.expr(stmt.test)) is not True:
                raise _Stop
        else:  # try, with, match, global, nonlocal: a path not followed here
            raise _Stop

    def unknown_branch(self, blocks: list[list[ast.stmt]]) -> None:
        """Blocks that may or may not run: what they may set becomes unknown; a way out of the function stops."""
        for block in blocks:
            for node in (n for stmt in block for n in ast.walk(stmt)):
                if isinstance(node, ast.Return | ast.Break | ast.Continue | ast.Yield | ast.Global | ast.Nonlocal):
                    raise _Stop
        for block in blocks:
            for stmt in block:
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
                        self.env[node.id] = UNKNOWN
                    elif isinstance(node, ast.Attribute | ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
                        self.havoc(node)
                    elif isinstance(node, ast.Call):
                        self.havoc_call(node)
                    elif isinstance(node, ast.Import | ast.ImportFrom):
                        for alias in node.names:
                            self.env[(alias.asname or alias.name).partition(".")[0]] = UNKNOWN

    def loop(self, stmt: ast.For) -> None:
        iterable = self.expr(stmt.iter)
        items = None
        if _known(iterable) and not isinstance(iterable, str | bytes):
            try:
                items = list(_take(iter(iterable)))
            except (TypeError, _Stop):
                items = None
        if items is None:
            self.unknown_branch([stmt.body, stmt.orelse, [ast.Assign(targets=[stmt.target], value=ast.Constant(0))]])
            return
        for item in items:
            self.assign(stmt.target, item)
            try:
                self.block(stmt.body)
            except _Break:
                return
            except _Continue:
                continue
        self.block(stmt.orelse)

    def raise_(self, stmt: ast.Raise) -> None:
        if stmt.exc is None:
            raise _Stop  # a re-raise: only inside an except block, which is not followed
        error = self.expr(stmt.exc)
        if isinstance(error, ConfigError):
            raise _Raise(error)
        if isinstance(error, _Exception):
            message = str(error.args[0]) if len(error.args) == 1 else str(error.args) if error.args else ""
            raise _Raise(Raised(error.classes, message))
        raise _Stop  # it raises something not told here: the function ends, with an error of its own

    def import_(self, stmt: ast.Import | ast.ImportFrom) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                name = alias.asname or alias.name.partition(".")[0]
                self.env[name] = source.module_ref(alias.name if alias.asname else name)
            return
        base = source._absolute(self.module, stmt)
        for alias in stmt.names:
            if alias.name == "*":
                raise _Stop
            owner = source.module_ref(base)
            self.env[alias.asname or alias.name] = source.resolve(source.attribute_of(owner, alias.name, base))

    # -- assignments and what calls may change --

    def assign(self, target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            items = None
            if _known(value) and not isinstance(value, str | bytes | DictConfig):
                try:
                    items = list(_take(iter(value)))
                except (TypeError, _Stop):
                    items = None
            if items is None or len(items) != len(target.elts) or any(isinstance(e, ast.Starred) for e in target.elts):
                for element in target.elts:
                    self.havoc(element.value if isinstance(element, ast.Starred) else element)
                return
            for element, item in zip(target.elts, items):
                self.assign(element, item)
        elif isinstance(target, ast.Attribute):
            owner = self.expr(target.value)
            if isinstance(owner, Instance):
                owner.attributes[target.attr] = value
            else:
                self.havoc(target.value)
        else:
            self.havoc(target)

    def havoc(self, target: ast.expr) -> None:
        """Whatever ``target`` names may have changed: unknown from now on."""
        while isinstance(target, ast.Attribute | ast.Subscript | ast.Starred):
            if isinstance(target, ast.Attribute):
                owner = self.expr_quiet(target.value)
                if isinstance(owner, Instance):
                    owner.attributes[target.attr] = UNKNOWN
                    return
            target = target.value
        if isinstance(target, ast.Name):
            value = self.env.get(target.id)
            if isinstance(value, Instance):
                value.forget()
            else:
                self.env[target.id] = UNKNOWN
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self.havoc(element)

    def havoc_call(self, call: ast.Call, followed: bool = False) -> None:
        """A call may change the mutable things it is given, and the object it is a method of: those become unknown
        (an object under construction keeps what a call ``followed`` to its end set on it)."""
        given = [*call.args, *(k.value for k in call.keywords)]
        if isinstance(call.func, ast.Attribute):
            given.append(call.func.value)
        for arg in given:
            if not isinstance(arg, ast.Name | ast.Attribute | ast.Subscript | ast.Starred):
                continue
            value = self.expr_quiet(arg.value if isinstance(arg, ast.Starred) else arg)
            if _immutable(value) or (followed and isinstance(value, Instance)):
                continue
            self.havoc(arg)

    # -- expressions --

    def expr_quiet(self, expr: ast.expr) -> Any:
        try:
            return self.expr(expr)
        except (_Raise, _Stop):
            return UNKNOWN

    def truth(self, value: Any) -> bool | None:
        if value is UNKNOWN or isinstance(value, Instance | _Callable | _Bound | _Super | _Exception | Live):
            return None
        if isinstance(value, Definition | Module | Value):
            return True
        try:
            return bool(value) if _known(value) else None
        except Exception:
            return None

    def expr(self, expr: ast.expr) -> Any:
        self.reader.tick()
        method = getattr(self, f"_{type(expr).__name__}", None)
        return method(expr) if method is not None else UNKNOWN

    def _Constant(self, expr: ast.Constant) -> Any:
        return expr.value

    def _Name(self, expr: ast.Name) -> Any:
        if expr.id in self.env:
            return self.env[expr.id]
        return self.global_(expr.id)

    def global_(self, name: str) -> Any:
        package = source._package_of(self.module, ast.Name(id=name))
        if package not in self.reader.packages and not source._is_light(package):
            return UNKNOWN  # a name from a package not read: nothing of it is followed, so it is not looked up
        return self.reader.value_of(source.lookup(self.module, name))

    def _Attribute(self, expr: ast.Attribute) -> Any:
        owner = self.expr(expr.value)
        name = expr.attr
        if isinstance(owner, Instance):
            if name in owner.attributes:
                return owner.attributes[name]
            if owner.forgotten:
                return UNKNOWN
            within = self.reader.packages
            found = _find_method(owner.cls, name, within) if isinstance(owner.cls, Definition) else None
            if isinstance(found, Definition) and not _is_property(found):
                klass = _defining_class(owner.cls, name, within)
                return _Bound(found, owner, klass) if klass is not None else UNKNOWN
            if not isinstance(found, Definition) and isinstance(owner.cls, Definition) and owner.cls.is_class:
                # A class attribute the instance's constructor did not set (a declared flag: ``needs_penalty``).
                return self.reader.value_of(source.class_attribute(owner.cls, name))
            return UNKNOWN
        if isinstance(owner, _Super):
            return self.super_attribute(owner, name)
        if isinstance(owner, Module):
            return self.reader.value_of(source.attribute_of(owner, name, owner.name))
        if isinstance(owner, _Callable) and isinstance(owner.target, Definition) and owner.target.is_class:
            return self.reader.value_of(source.class_attribute(owner.target, name))
        if owner is UNKNOWN or isinstance(owner, _Callable | _Bound | _Exception | Live):
            return UNKNOWN
        if inspect.ismodule(owner):
            return _usable(getattr(owner, name, UNKNOWN))
        if inspect.isclass(owner) and name == "__name__":
            return owner.__name__
        if _is_plain_data(owner) and name in _PURE_METHODS.get(type(owner), ()):
            return _PureMethod(owner, name)
        return UNKNOWN

    def super_attribute(self, sup: _Super, name: str) -> Any:
        order = source.mro(sup.instance.cls, self.reader.packages) if isinstance(sup.instance.cls, Definition) else None
        if order is None or sup.after not in order:
            return UNKNOWN
        for klass in order[order.index(sup.after) + 1 :]:
            if inspect.isclass(klass) or isinstance(klass, source.External):
                return _Opaque(sup.instance) if name == "__init__" else UNKNOWN
            found = source.method(klass, name)
            if found is None:
                continue
            return _Bound(found, sup.instance, klass) if isinstance(found, Definition) else UNKNOWN
        return UNKNOWN

    def _Call(self, expr: ast.Call) -> Any:
        if isinstance(expr.func, ast.Name) and expr.func.id == "super" and not expr.args and "super" not in self.env:
            instance = self.env.get(next(iter(self.env), ""), UNKNOWN)
            return _Super(instance, self.owner) if isinstance(instance, Instance) and self.owner else UNKNOWN
        callee = self.expr(expr.func)
        args: list[Any] = []
        for arg in expr.args:
            if isinstance(arg, ast.Starred):
                spread = self.expr(arg.value)
                if not _known(spread) or isinstance(spread, str | bytes):
                    self.havoc_call(expr)
                    return UNKNOWN
                args.extend(spread)
            else:
                args.append(self.expr(arg))
        kwargs: dict[str, Any] = {}
        for keyword in expr.keywords:
            value = self.expr(keyword.value)
            if keyword.arg is None:
                if not isinstance(value, dict | DictConfig):
                    self.havoc_call(expr)
                    return UNKNOWN
                kwargs.update(value)
            else:
                kwargs[keyword.arg] = value
        if isinstance(callee, _PureMethod):
            return callee(args, kwargs)
        if isinstance(callee, _Opaque):
            callee.instance.forget()
            return None
        if isinstance(callee, _Bound) and callee.function.node.name == "__init__":
            stops = self.reader.stops
            self.reader.initialize(callee.instance, callee.owner, args, kwargs, self.depth)
            self.havoc_call(expr, followed=self.reader.stops == stops)
            return None
        if isinstance(callee, _Callable | _Bound):
            stops = self.reader.stops
            result = self.reader.call(callee, args, kwargs, self.depth + 1)
            self.havoc_call(expr, followed=self.reader.stops == stops)
            return result
        if callable(callee) and not isinstance(callee, _Super | Instance):
            result = self.reader.call_live(callee, args, kwargs)
            if callee not in _PURE_BUILTINS and callee not in _PURE_FUNCTIONS:
                self.havoc_call(expr)
            return result
        self.havoc_call(expr)
        return UNKNOWN

    def _BoolOp(self, expr: ast.BoolOp) -> Any:
        is_and = isinstance(expr.op, ast.And)
        value: Any = UNKNOWN
        for operand in expr.values:
            value = self.expr(operand)
            truth = self.truth(value)
            if truth is None:
                return UNKNOWN
            if truth is not is_and:  # `and` stops at a falsy operand, `or` at a truthy one
                return value
        return value

    def _UnaryOp(self, expr: ast.UnaryOp) -> Any:
        operand = self.expr(expr.operand)
        if isinstance(expr.op, ast.Not):
            truth = self.truth(operand)
            return UNKNOWN if truth is None else not truth
        if not _known(operand):
            return UNKNOWN
        op = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}[type(expr.op)]
        try:
            return op(operand)
        except Exception:
            return UNKNOWN

    def binary(self, op: ast.operator, left: Any, right: Any) -> Any:
        if not (_known(left) and _known(right)) or type(op) not in _BINARY:
            return UNKNOWN
        if isinstance(op, ast.Mult) and any(isinstance(v, str | bytes | list | tuple) for v in (left, right)):
            counts = [v for v in (left, right) if isinstance(v, int)]
            if counts and counts[0] > MAX_SIZE:
                return UNKNOWN
        if isinstance(op, ast.Pow | ast.LShift) and isinstance(right, int) and abs(right) > 4096:
            return UNKNOWN
        try:
            result = _BINARY[type(op)](left, right)
        except Exception:
            return UNKNOWN
        return result if _known(result) else UNKNOWN

    def _BinOp(self, expr: ast.BinOp) -> Any:
        return self.binary(expr.op, self.expr(expr.left), self.expr(expr.right))

    def _Compare(self, expr: ast.Compare) -> Any:
        left = self.expr(expr.left)
        for op, comparator in zip(expr.ops, expr.comparators):
            right = self.expr(comparator)
            if (
                isinstance(op, ast.Is | ast.IsNot)
                and (left is None or right is None)
                and (_is_plain_data(left) or _is_plain_data(right))
            ):
                pass  # `x is None` on plain values
            elif isinstance(op, ast.In | ast.NotIn) and _known(left) and _class_table(right):
                pass  # a spelling in a table of classes: its keys are known
            elif not (_known(left) and _known(right)):
                return UNKNOWN
            try:
                if not _COMPARE[type(op)](left, right):
                    return False
            except Exception:
                return UNKNOWN
            left = right
        return True

    def _IfExp(self, expr: ast.IfExp) -> Any:
        test = self.truth(self.expr(expr.test))
        if test is None:
            return UNKNOWN
        return self.expr(expr.body if test else expr.orelse)

    def _JoinedStr(self, expr: ast.JoinedStr) -> Any:
        parts = []
        for value in expr.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
                continue
            item = self.expr(value.value)  # a FormattedValue
            if not _known(item):
                return UNKNOWN
            conversion = {115: str, 114: repr, 97: ascii}.get(value.conversion)
            spec = self.expr(value.format_spec) if value.format_spec is not None else ""
            if not isinstance(spec, str):
                return UNKNOWN
            try:
                parts.append(format(conversion(item) if conversion else item, spec))
            except Exception:
                return UNKNOWN
        return "".join(parts)

    def _FormattedValue(self, expr: ast.FormattedValue) -> Any:
        return self._JoinedStr(ast.JoinedStr(values=[expr]))

    def _Tuple(self, expr: ast.Tuple) -> Any:
        return self.sequence(expr.elts, tuple)

    def _List(self, expr: ast.List) -> Any:
        return self.sequence(expr.elts, list)

    def _Set(self, expr: ast.Set) -> Any:
        return self.sequence(expr.elts, set)

    def sequence(self, elements: list[ast.expr], kind: type) -> Any:
        items: list[Any] = []
        for element in elements:
            if isinstance(element, ast.Starred):
                spread = self.expr(element.value)
                if not _known(spread):
                    return UNKNOWN
                items.extend(spread)
            else:
                items.append(self.expr(element))
        if not all(_known(i) for i in items):
            return UNKNOWN
        try:
            return kind(items)
        except TypeError:
            return UNKNOWN

    def _Dict(self, expr: ast.Dict) -> Any:
        result: dict[Any, Any] = {}
        for key, value in zip(expr.keys, expr.values):
            if key is None:
                spread = self.expr(value)
                if not isinstance(spread, dict | DictConfig):
                    return UNKNOWN
                result.update(spread)
            else:
                result[self.expr(key)] = self.expr(value)
        if _known(result) or _class_table(result):
            return result
        return UNKNOWN

    def _Subscript(self, expr: ast.Subscript) -> Any:
        container = self.expr(expr.value)
        index = self.expr(expr.slice)
        if _class_table(container) and _known(index):
            # A table of the source's own classes (the GAN's spellings): the entry itself, known or not.
            return container.get(index, UNKNOWN)
        if not (_known(container) and _known(index)) or inspect.isclass(container):
            return UNKNOWN
        try:
            result = container[index]
        except Exception:
            return UNKNOWN
        return result if _known(result) else UNKNOWN

    def _Slice(self, expr: ast.Slice) -> Any:
        parts = [self.expr(p) if p is not None else None for p in (expr.lower, expr.upper, expr.step)]
        return slice(*parts) if all(p is None or _known(p) for p in parts) else UNKNOWN

    def _NamedExpr(self, expr: ast.NamedExpr) -> Any:
        value = self.expr(expr.value)
        self.assign(expr.target, value)
        return value

    def comprehension(self, generators: list[ast.comprehension], element: Callable[[], Any]) -> list[Any] | None:
        saved = dict(self.env)
        results: list[Any] = []

        def walk(index: int) -> bool:
            if index == len(generators):
                results.append(element())
                return len(results) <= MAX_SIZE
            generator = generators[index]
            iterable = self.expr(generator.iter)
            if not _known(iterable) or (isinstance(iterable, str | bytes) and len(iterable) > MAX_SIZE):
                return False
            try:
                items = list(_take(iter(iterable)))
            except (TypeError, _Stop):
                return False
            for item in items:
                self.assign(generator.target, item)
                tests = [self.truth(self.expr(test)) for test in generator.ifs]
                if any(t is None for t in tests):
                    return False
                if all(tests) and not walk(index + 1):
                    return False
            return True

        try:
            ok = walk(0)
        finally:
            self.env = saved
        return results if ok and all(_known(r) for r in results) else None

    def _ListComp(self, expr: ast.ListComp) -> Any:
        found = self.comprehension(expr.generators, lambda: self.expr(expr.elt))
        return UNKNOWN if found is None else found

    _GeneratorExp = _ListComp  # read whole: the built-ins that take one (all, any, sum) give the same

    def _SetComp(self, expr: ast.SetComp) -> Any:
        found = self.comprehension(expr.generators, lambda: self.expr(expr.elt))
        return UNKNOWN if found is None else set(found)

    def _DictComp(self, expr: ast.DictComp) -> Any:
        found = self.comprehension(expr.generators, lambda: (self.expr(expr.key), self.expr(expr.value)))
        return UNKNOWN if found is None else dict(found)


@dataclass(frozen=True)
class _PureMethod:
    owner: Any
    name: str

    def __call__(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        args = [list(a) if _class_table(a) else a for a in args]  # its keys (``", ".join(LOSSES)``)
        if not all(_known(a) for a in args) or not all(_known(v) for v in kwargs.values()):
            return UNKNOWN
        try:
            result = getattr(self.owner, self.name)(*args, **kwargs)
        except Exception:
            return UNKNOWN
        if isinstance(result, Iterator) or type(result).__name__ in ("dict_keys", "dict_values", "dict_items"):
            result = list(result)
        return result if _known(result) else UNKNOWN


def _as_load(target: ast.expr) -> ast.expr:
    copy = ast.parse(ast.unparse(target), mode="eval").body
    return copy


def _is_property(fn: Definition) -> bool:
    return any(
        ast.unparse(d).rsplit(".", 1)[-1] in ("property", "cached_property", "setter") for d in fn.node.decorator_list
    )


def _defining_class(cls: Definition, name: str, within: frozenset[str] | None = None) -> Any:
    for klass in source.mro(cls, within) or []:
        if isinstance(klass, source.External):
            return None
        if source.method(klass, name) is not None:
            return klass
    return None


def config_arguments(node: DictConfig, convert: str | None = None, recursive: bool | None = None) -> dict[str, Any]:
    """The keyword arguments Hydra's ``instantiate(node)`` passes its target: each key's value resolved, a nested
    ``_target_`` node built (unknown here) unless ``_recursive_`` is false, containers converted by ``_convert_``."""
    convert = str(node.get("_convert_", "none") if convert is None else convert)
    recursive = bool(node.get("_recursive_", True) if recursive is None else recursive)
    arguments: dict[str, Any] = {}
    for key in node:
        key = str(key)
        if key.startswith("_"):
            continue
        try:
            child = node._get_node(key)
            if isinstance(child, DictConfig | ListConfig):
                if recursive and _holds_target(child):
                    arguments[key] = UNKNOWN
                elif convert in ("all", "object", "partial"):
                    arguments[key] = OmegaConf.to_container(child, resolve=True)
                else:
                    arguments[key] = child
            else:
                arguments[key] = node[key]
        except Exception:  # an interpolation that does not resolve: the real build says so
            arguments[key] = UNKNOWN
    return arguments


def _holds_target(node: Any) -> bool:
    if isinstance(node, DictConfig):
        return "_target_" in node or any(_holds_target(node._get_node(k)) for k in node)
    if isinstance(node, ListConfig):
        return any(_holds_target(node._get_node(i)) for i in range(len(node)))
    return False


__all__ = ["NOT_BOUND", "UNKNOWN", "Raised", "config_arguments", "construct", "method_rejection", "rejection"]
