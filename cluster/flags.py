"""Command-line flags generated from config dataclasses: add a knob by adding a field.

A field ``max_num_seqs: int = 256`` becomes ``--max-num-seqs N`` (or a historic name given in
``renames``): its type from the annotation (``X | None``: type X, None allowed; a bool becomes
``--name/--no-name``), its default from the dataclass, its help, choices and metavar from the field's
``metadata`` (``field(default=256, metadata={"help": "..."})``). A field without a default is a
required flag. Fields that make no sense as flags are excluded by the caller, with the reason; a
field that is not a scalar (a nested config) must be excluded, or building the parser fails, as it
does when two dataclasses of one parser have a field of the same key (argparse's conflict).

:func:`build` turns the parsed flags back into the dataclass; :func:`to_argv` turns values back into
flags (``pdctl``'s launcher). :func:`source_knobs` reads a dataclass's fields from its module's source
(``ast``) for callers that must not import that module (``pdctl`` does not load torch).

The *key* of a field is its flag without the dashes: the field's name, or its rename.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of a field that has none
SCALARS = (bool, int, float, str)
_METAVARS = {int: "N", float: "X"}  # a str flag's is its key in capitals (argparse's)


@dataclass(frozen=True)
class Knob:
    """One field of a config dataclass, as a flag sees it."""

    name: str
    type: type | None  # bool, int, float or str; None: not a scalar (a nested config), never a flag
    optional: bool = False  # None is a valid value (``X | None``)
    default: Any = REQUIRED
    help: str = ""
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None


def knobs(cls: type) -> list[Knob]:
    """The fields of dataclass ``cls`` (annotations resolved; one that cannot be, as a non-scalar)."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        typ, optional = _scalar(hints.get(f.name))
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED)
        choices = f.metadata.get("choices")
        out.append(Knob(f.name, typ, optional, default, f.metadata.get("help", ""),
                        tuple(choices) if choices is not None else None, f.metadata.get("metavar")))
    return out


def source_knobs(module: str, class_name: str) -> list[Knob]:
    """The fields of dataclass ``class_name`` read from ``module``'s source, without importing it.

    Defaults and metadata values must be literals to be read (a metadata value that is not, such as
    ``choices`` computed from a constant, is left out); annotations must be scalars or ``X | None``.
    """
    spec = importlib.util.find_spec(module)  # imports the parent packages, not the module
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {module}")
    tree = ast.parse(Path(spec.origin).read_text(), spec.origin)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise ImportError(f"{module} has no class {class_name}")
    out = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name, (typ, optional) = node.target.id, _ast_scalar(node.annotation)
        default, meta = REQUIRED, {}
        if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "field":
            kw = {k.arg: k.value for k in node.value.keywords}
            if "default" in kw:
                default = _literal(kw["default"], f"{module}.{class_name}.{name}")
            metadata = kw.get("metadata")
            if isinstance(metadata, ast.Dict):
                for k, v in zip(metadata.keys, metadata.values):
                    if k is None:  # a ``**mapping`` inside the dict literal
                        continue
                    try:
                        meta[ast.literal_eval(k)] = ast.literal_eval(v)
                    except ValueError:  # computed (``choices=("auto", *DTYPES)``): the runtime class has it
                        pass
        elif node.value is not None:
            default = _literal(node.value, f"{module}.{class_name}.{name}")
        choices = meta.get("choices")
        out.append(Knob(name, typ, optional, default, meta.get("help", ""),
                        tuple(choices) if choices is not None else None, meta.get("metavar")))
    return out


def key(name: str, renames: Mapping[str, str] | None = None) -> str:
    """A field's key: its flag without the dashes."""
    return (renames or {}).get(name, name)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, fields: Iterable[Knob], *,
              exclude: Iterable[str] = (), renames: Mapping[str, str] | None = None,
              overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Add a flag for every field not in ``exclude``; ``overrides`` replace argparse arguments of a
    field (a ``help`` given there is used as it is, without the default appended)."""
    skip, overrides = set(exclude), overrides or {}
    for k in fields:
        if k.name in skip:
            continue
        if k.type is None:
            raise TypeError(f"field {k.name!r} is not a scalar and cannot be a flag: exclude it")
        kw: dict[str, Any] = {"dest": key(k.name, renames), "help": k.help}
        if k.default is REQUIRED:
            kw["required"] = True
        else:
            kw["default"] = k.default
        if k.type is bool:
            kw["action"] = argparse.BooleanOptionalAction  # appends the default to the help itself
        else:
            kw.update(type=k.type, metavar=k.metavar or (None if k.choices else _METAVARS.get(k.type)))
            if k.choices is not None:
                kw["choices"] = k.choices
            if k.default is not REQUIRED and k.default is not None:
                kw["help"] = f"{k.help} (default: {k.default})" if k.help else f"default: {k.default}"
        kw.update(overrides.get(k.name, {}))
        parser.add_argument("--" + kw["dest"].replace("_", "-"), **kw)


def build(cls: type, parsed: argparse.Namespace | Mapping[str, Any], *, exclude: Iterable[str] = (),
          renames: Mapping[str, str] | None = None, **given: Any) -> Any:
    """``cls`` from parsed flags (by key) and ``given`` fields; fields neither has keep their defaults."""
    values = vars(parsed) if isinstance(parsed, argparse.Namespace) else parsed
    skip = set(exclude) | set(given)
    kwargs = {f.name: values[key(f.name, renames)] for f in dataclasses.fields(cls)
              if f.init and f.name not in skip and key(f.name, renames) in values}
    return cls(**kwargs, **given)


def to_argv(values: Mapping[str, Any]) -> list[str]:
    """Flags that set ``values`` (by key): ``None`` leaves a flag out (its default, None, applies)."""
    argv = []
    for k, v in values.items():
        flag = "--" + k.replace("_", "-")
        if v is None:
            continue
        if isinstance(v, bool):
            argv.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, float):
            argv += [flag, str(int(v)) if v.is_integer() else repr(v)]
        else:
            argv += [flag, str(v)]
    return argv


def type_error(k: Knob, value: Any) -> str | None:
    """What is wrong with ``value`` for field ``k`` by its type (None: nothing), as in a message."""
    if value is None:
        return None if k.optional else f"must not be null (default: {k.default!r})"
    if k.type is None:
        return "is not a scalar"
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[k.type]
    if ok(value) and (k.choices is None or value in k.choices):
        return None
    want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[k.type]
    if k.choices is not None:
        want = f"one of {k.choices}"
    return f"must be {want}{' or null' if k.optional else ''}, got {value!r}"


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except NameError:  # an annotation imported only for type checkers (NodeConfig.engine): resolve the others
        ns = vars(sys.modules[cls.__module__])
        hints = {}
        for f in dataclasses.fields(cls):
            try:
                hints[f.name] = eval(f.type, ns) if isinstance(f.type, str) else f.type  # what get_type_hints does
            except NameError:
                hints[f.name] = None
        return hints


def _scalar(t: Any) -> tuple[type | None, bool]:
    """(the scalar type, whether None is allowed) of an annotation; (None, False) if it is no scalar."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(t)) == 2 and args[0] in SCALARS:
            return args[0], True
        return None, False
    return (t, False) if t in SCALARS else (None, False)


def _ast_scalar(node: ast.expr) -> tuple[type | None, bool]:
    names = {t.__name__: t for t in SCALARS}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        node = ast.parse(node.value, mode="eval").body
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id], False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [node.left, node.right]
        nones = [s for s in sides if isinstance(s, ast.Constant) and s.value is None]
        others = [s for s in sides if s not in nones]
        if len(nones) == 1 and isinstance(others[0], ast.Name) and others[0].id in names:
            return names[others[0].id], True
    if (isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Optional"
            and isinstance(node.slice, ast.Name) and node.slice.id in names):
        return names[node.slice.id], True
    return None, False


def _literal(node: ast.expr, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"{where}: the default must be a literal to be read without importing the module") from None
