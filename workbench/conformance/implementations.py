"""Implementations of the cache's ops, by name: ours, our references, the installed peers, and yours.

An op is a contract (:mod:`workbench.conformance.ops`): the arguments an implementation may ask for, by parameter
name, and what it must give back. An implementation is any callable plus what it claims to support (layouts,
formats, block sizes, head dims, GQA group sizes, the byte alignment its loads need); the conformance suite
(:mod:`workbench.conformance.suite`) runs it on every case it claims and lists the others as unsupported, never as
failures.

    @register("decode", "mine", layouts=("nhd",), formats=("fp16", "bf16"))
    def mine(q, k_cache, v_cache, block_table, seq_lens, sm_scale, out):
        ...  # write out [B, Hq, D] (or return it)

Registering a name again replaces a user's implementation (a notebook cell run twice) but never ours, a
reference's or a peer's unless ``replace=True``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from workbench.conformance.ops import OPS, Op
from workbench.conformance.problems import row_alignment
from workbench.conformance.suite_formats import SUITE_FORMATS
from workbench.core.layout import Layout

ORIGINS = ("ours", "reference", "peer", "example", "user")


@dataclass(frozen=True)
class Impl:
    """A registered implementation and what it claims (None: any). ``row_align``: the byte alignment every K/V row
    (one token's values of one kv head) must start at, as a kernel's vector loads need (FlashInfer: 16); the suite's
    padded block strides break it (``workbench.conformance.problems.row_alignment``)."""

    op: str
    name: str
    fn: Callable
    origin: str = "user"
    layouts: tuple[str, ...] = ("nhd", "hnd", "vllm")
    formats: tuple[str, ...] = ("fp16", "bf16", "fp32")
    block_sizes: tuple[int, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    groups: tuple[int, ...] | None = None  # query heads per kv head
    row_align: int = 1
    description: str = ""
    takes: frozenset = field(default=frozenset(), compare=False)  # the op's arguments its signature names
    takes_all: bool = field(default=False, compare=False)  # it has **kwargs

    def supports(self, layout: str, kv_format: str, block_size: int, head_dim: int, group: int | None = None) -> bool:
        return (layout in self.layouts and kv_format in self.formats
                and (self.block_sizes is None or block_size in self.block_sizes)
                and (self.head_dims is None or head_dim in self.head_dims)
                and (group is None or self.groups is None or group in self.groups))

    def unsupported(self, case) -> str:
        """Why ``case`` (a :class:`~workbench.conformance.problems.Case`) is outside what this implementation
        claims ("" when it claims it): every reason, "; "-joined."""
        if self.op == "copy":  # its cases take no claims: every pool is bytes
            return ""
        why = [f"{name} {value} not in {','.join(map(str, claimed))}"
               for name, value, claimed in (("layout", case.layout, self.layouts),
                                            ("format", case.kv_format, self.formats),
                                            ("block size", case.block_size, self.block_sizes),
                                            ("head dim", case.head_dim, self.head_dims),
                                            ("group", case.group, self.groups))
               if claimed is not None and value not in claimed]
        if self.row_align > 1:
            got = row_alignment(case)
            if got < self.row_align:
                why.append(f"rows aligned to {got} bytes, needs {self.row_align}")
        return "; ".join(why)

    def __call__(self, inputs: dict):
        """Call the implementation with the inputs its signature asks for."""
        args = OPS[self.op].arguments if self.takes_all else self.takes
        return self.fn(**{k: v for k, v in inputs.items() if k in args})

    def claims(self) -> str:
        sizes = "any" if self.block_sizes is None else ",".join(map(str, self.block_sizes))
        dims = "any" if self.head_dims is None else ",".join(map(str, self.head_dims))
        extra = "" if self.groups is None else f"; groups {','.join(map(str, self.groups))}"
        extra += f"; rows {self.row_align}-byte aligned" if self.row_align > 1 else ""
        return (f"layouts {','.join(self.layouts)}; formats {','.join(self.formats)}; block sizes {sizes}; "
                f"head dims {dims}{extra}")


_REGISTRY: dict[tuple[str, str], Impl] = {}
ABSENT: dict[str, str] = {}  # peer name -> why it is not registered here (filled by the built-ins' loader)
_LOADERS: list = []  # run before every lookup and registration (each guards itself to run once)


def add_loader(fn) -> None:
    """Have ``fn()`` run before the first lookup: how the built-ins (``builtin.load``) register lazily without this
    module importing them."""
    if fn not in _LOADERS:
        _LOADERS.append(fn)


def _load() -> None:
    for fn in _LOADERS:
        fn()


def registered() -> dict[tuple[str, str], Impl]:
    """``{(op, name): Impl}`` of every registered implementation (a copy; the built-ins loaded first)."""
    _load()
    return dict(_REGISTRY)


def _signature(op: Op, fn: Callable, name: str) -> tuple[frozenset, bool]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise ValueError(f"implementation {name!r}: fn must be a Python callable with a signature, "
                         f"got {fn!r}") from None
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                     and p.default is p.empty and p.name not in op.arguments)
    if unknown:
        raise ValueError(f"implementation {name!r} of op {op.name!r} requires arguments {unknown} the op does not "
                         f"provide; it provides {sorted(op.arguments)}")
    if any(p.kind is p.VAR_POSITIONAL for p in params) or any(
            p.kind is p.POSITIONAL_ONLY for p in params):
        raise ValueError(f"implementation {name!r}: arguments are passed by name; drop positional-only and *args")
    missing = [a for a in op.required if a not in named and not takes_all]
    if missing:
        raise ValueError(f"implementation {name!r} of op {op.name!r} must accept {missing} "
                         f"({'; '.join(op.arguments[a] for a in missing)})")
    return frozenset(named & set(op.arguments)), takes_all


def _names(kind: str, values, check) -> tuple:
    if isinstance(values, str | int):
        values = (values,)
    try:
        values = tuple(values)
    except TypeError:
        raise ValueError(f"{kind} must be a list, got {values!r}") from None
    if not values:
        raise ValueError(f"{kind} must name at least one value")
    for v in values:
        check(v)
    return values


def _check_format(f) -> None:
    if f not in SUITE_FORMATS:
        raise ValueError(f"formats: {f!r} is not one of the suite's formats {list(SUITE_FORMATS)}")


def _check_size(kind: str):
    def check(v) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{kind} must be positive ints, got {v!r}")
    return check


def make_impl(op: str, name: str, fn: Callable, *, origin: str = "user",
              layouts: Iterable[str] = ("nhd", "hnd", "vllm"), formats: Iterable[str] = ("fp16", "bf16", "fp32"),
              block_sizes: Iterable[int] | None = None, head_dims: Iterable[int] | None = None,
              groups: Iterable[int] | None = None, row_align: int = 1, description: str = "") -> Impl:
    """A checked :class:`Impl` (not registered): ValueError naming the argument that is wrong."""
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name must be a non-empty identifier-like string (letters, digits, _ and -), got {name!r}")
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    takes, takes_all = _signature(OPS[op], fn, name)
    lay = _names("layouts", layouts, lambda v: Layout.parse(v))
    fmts = _names("formats", formats, _check_format) if op != "copy" else ("any",)
    sizes = None if block_sizes is None else _names("block_sizes", block_sizes, _check_size("block_sizes"))
    dims = None if head_dims is None else _names("head_dims", head_dims, _check_size("head_dims"))
    grps = None if groups is None else _names("groups", groups, _check_size("groups"))
    if isinstance(row_align, bool) or not isinstance(row_align, int) or row_align < 1 or row_align & (row_align - 1):
        raise ValueError(f"row_align must be a power of two >= 1 (bytes), got {row_align!r}")
    return Impl(op, name, fn, origin, tuple(Layout.parse(v).value for v in lay), fmts, sizes, dims, grps, row_align,
                description or (inspect.getdoc(fn) or "").split("\n")[0], takes, takes_all)


def register(op: str, name: str | None = None, fn: Callable | None = None, *, replace: bool = False, **claims):
    """Register ``fn`` as implementation ``name`` of ``op``: ``register("decode", "mine", fn, ...)``, or as a
    decorator (``@register("decode", "mine", layouts=("nhd",))``; the name defaults to the function's).

    ``claims``: ``layouts``, ``formats``, ``block_sizes``, ``head_dims``, ``groups`` (None: any), ``row_align``
    (bytes, default 1), ``origin``, ``description``.
    Returns the :class:`Impl` (the decorator returns ``fn`` unchanged).
    """
    _load()  # first: a user's "ours" must meet ours, not be replaced by it on the first lookup

    def add(f: Callable):
        impl = make_impl(op, getattr(f, "__name__", "") if name is None else name, f, **claims)
        old = _REGISTRY.get((op, impl.name))
        if old is not None and old.origin != "user" and not replace:
            raise ValueError(f"name {impl.name!r} is taken by the {old.origin} implementation of {op!r}; "
                             f"pick another name or pass replace=True")
        _REGISTRY[(op, impl.name)] = impl
        return impl

    if fn is not None:
        return add(fn)
    return lambda f: (add(f), f)[1]


def unregister(op: str, name: str, *, force: bool = False) -> None:
    """Remove a user's implementation (ours, the references and the peers only with ``force=True``)."""
    if (op, name) not in _REGISTRY:
        raise ValueError(f"no implementation {name!r} of op {op!r}; registered: {names(op)}")
    if _REGISTRY[(op, name)].origin != "user" and not force:
        raise ValueError(f"{name!r} is the {_REGISTRY[(op, name)].origin} implementation of {op!r}; "
                         f"pass force=True to remove it")
    del _REGISTRY[(op, name)]


def get(name: str | Impl, op: str = "decode") -> Impl:
    """The implementation ``name`` of ``op`` (an :class:`Impl` passes through)."""
    _load()
    if isinstance(name, Impl):
        return name
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")
    if (op, name) not in _REGISTRY:
        raise ValueError(f"no implementation {name!r} of op {op!r}; registered: {names(op)}"
                         + (f"; absent peers: {sorted(ABSENT)}" if name in ABSENT else ""))
    return _REGISTRY[(op, name)]


def names(op: str | None = None) -> list[str]:
    _load()
    return sorted(n for o, n in _REGISTRY if op is None or o == op)


def available(op: str | None = None, origin: str | None = None) -> list[Impl]:
    """Registered implementations (of ``op``, of ``origin``), ours first."""
    _load()
    rank = {o: i for i, o in enumerate(ORIGINS)}
    return sorted((i for (o, _), i in _REGISTRY.items() if (op is None or o == op)
                   and (origin is None or i.origin == origin)), key=lambda i: (i.op, rank[i.origin], i.name))
