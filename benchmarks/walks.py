"""The walk of one logged value through the library's files, recorded, not drawn by hand.

Fits of a small MLP with ``GradFlowCallback()`` at its defaults follow two values:

- **a gradient norm**: the gradients of layer ``net.0`` at a logging step, from where the
  library reads them to where ``grad_flow/grad_norm_step/net.0`` (that logging step's value) and
  ``grad_flow/grad_norm/net.0`` (the epoch's) are handed to the event file's writer;
- **a** ``diverging`` **alarm**: the training loss from the step at which it jumps (multiplied
  by 50 from step ``JUMP``, so that the walk does not depend on the run's floating-point path),
  from where the library reads it to the ``diverging`` warning.

How a value is followed, with ``sys.setprofile`` and a ``TorchDispatchMode``, the library
unchanged:

- **Marked.** The value starts as marked objects: the layer's ``.grad`` tensors, or the loss
  tensor Lightning hands the batch-end hooks.
- **Carried by torch.** An ATen op run under a frame of the library carries the mark from what
  it reads to what it makes or writes. Marks are kept byte by byte in each storage (a numpy
  array over a marked storage is marked where it overlaps): concatenation, indexing and
  elementwise ops carry them element by element, the ``_foreach`` ops tensor by tensor, any
  other op marks all it makes. An op that writes unmarked data into a marked tensor makes
  nothing new; an overwrite (``copy_``, ``fill_``, ``zero_``, ``out=``) with it unmarks.
- **Carried by Python.** A function of the library whose arguments or locals held a marked
  object, or whose result holds one, marks its result and the result's fields; one that hands
  a marked object back as it came is a reader of it. A number a function of the library is
  called with, equal to an element of a marked array its caller holds, is the value read out.
- **Handed on.** The walk ends where the value leaves the library: the first call into
  torch, Lightning or TensorBoard whose arguments carry the value's tag (its summary or
  record), or the ``diverging`` warning shown.
- **Traced back.** From that end, every op and return that made what a later one read is on the
  path, back to the mark. A function is on the value's path when it was on the stack at one of
  them. The walk lists the files of the library its calls entered, in order (a call within one
  file enters none), and the first frame past them, where the value is handed on.

A *return* is the walk entering, by a call from another file, a file it entered before; each
is listed with the call that made it. After each walk, the measure this script gave before it
followed one value: every call into the library from the mark to the end::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/walks.py --save

It also draws the objects ``GradFlowCallback()`` holds during a fit. ``--save`` writes both to
``benchmarks/results/walks.md`` and into ``docs/architecture.md``, between the marks that
name them.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

import lightning_hooks

PACKAGE = Path(lightning_hooks.__file__).resolve().parent
HERE = str(Path(__file__).resolve())
LIBRARIES = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities")
LIBRARIES += ("tensorboard",)
LOGGING_STEP = 4  # log_every_n_steps=5: steps 0 and 4 of the walk's epoch are logging steps
LAYER = "net.0"
JUMP = 12  # the step from which the loss is multiplied: *diverging* is warned soon after
GRAD_NORM = f"grad_flow/grad_norm/{LAYER}"
SAVED = Path(__file__).resolve().parent / "results" / "walks.md"
"""The recording as ``docs/architecture.md`` quotes it (``--save``)."""
PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
MARK = "<!-- recorded by benchmarks/walks.py: "
END = "<!-- end of the recording -->"
SKIPPED = (type(None), bool, int, str, bytes, type)  # never a value's carrier
WRITE_ONLY = ("copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_")
"""Ops that overwrite their target without reading it (``out=`` overloads too)."""
Key = tuple[str, int]  # ("storage", its address) or ("object", its id)
Region = "np.ndarray | None"  # bytes of a storage, from its start (None: all, or an object)
Marks = dict[Key, Any]  # what holds the value: each object or storage, with its region


@dataclasses.dataclass
class Call:
    """One call the profile saw."""

    serial: int
    file: str  # the library's path, or the package's name outside it
    function: str
    ours: bool
    caller: Call | None
    line: int  # the caller's line that made the call
    frame: FrameType | None
    inputs: Marks = dataclasses.field(default_factory=dict)

    def where(self) -> str:
        """``file:function``."""
        return f"{self.file}:{self.function}"


@dataclasses.dataclass
class Step:
    """One step of the value: an op or a return that made ``outputs`` from ``inputs``."""

    serial: int
    stack: tuple[Call, ...]  # the calls on the stack, outermost first
    inputs: Marks  # the marked objects, or bytes of storages, it read
    what: str


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The address and size of ``tensor``'s storage (``None``: it has no plain one)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def _span(shape: Sequence[int], strides: Sequence[int], offset: int, item: int) -> Region:
    """The bytes a strided view covers, from its storage's start (``None``: too many to list)."""
    count = 1
    for size in shape:
        count *= size
    if count > 1 << 20:
        return None
    offsets = np.array([offset], dtype=np.int64)
    for size, stride in zip(shape, strides, strict=True):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    return np.unique((offsets[:, None] + np.arange(item, dtype=np.int64)).reshape(-1))


def _elements(tensor: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """The byte offset of each element of ``tensor`` in its storage, in the order of its
    elements, and their size (``None``: too many to list)."""
    if tensor.numel() > 1 << 20 or tensor.layout != torch.strided:
        return None
    item = tensor.element_size()
    offsets = np.array([tensor.storage_offset() * item], dtype=np.int64)
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        steps = np.arange(size, dtype=np.int64) * stride * item
        offsets = (offsets[:, None] + steps).reshape(-1)
    return offsets, item


def _written(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors the op ``func`` overwrites (without reading them), and those it updates."""
    overwritten: list[torch.Tensor] = []
    updated: list[torch.Tensor] = []
    name = func._schema.name.split("::")[-1]
    write_only = name in WRITE_ONLY or func._overloadname.startswith("out")
    for i, spec in enumerate(func._schema.arguments):
        if spec.alias_info is not None and spec.alias_info.is_write:
            given = args[i] if i < len(args) else kwargs.get(spec.name)
            (overwritten if write_only else updated).extend(_flat_tensors(given))
    return overwritten, updated


def _merge(into: Marks, more: Marks) -> None:
    """Add ``more`` to ``into``, each object's regions joined."""
    for key, region in more.items():
        if key not in into:
            into[key] = region
        elif into[key] is None or region is None:
            into[key] = None
        else:
            into[key] = np.union1d(into[key], region)


def _overlap(one: Region, other: Region) -> bool:
    return one is None or other is None or bool(np.isin(one, other).any())


def _fields(value: Any) -> Iterator[Any]:
    """The items, values or fields of a container or a dataclass (the first 64)."""
    if isinstance(value, tuple | list | set | frozenset):
        yield from list(value)[:64]
    elif isinstance(value, dict):
        yield from list(value.values())[:64]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from (getattr(value, f.name, None) for f in dataclasses.fields(value))


SHARED = {id(x) for x in (math.nan, math.inf, -math.inf, np.nan, np.inf, np.pi, math.pi)}


def _shared(value: Any) -> bool:
    """Whether ``value`` may be one object that unrelated code shares: an atom, a constant, a
    container of atoms only (an empty tuple is one object for all)."""
    if isinstance(value, SKIPPED) or id(value) in SHARED:
        return True
    if isinstance(value, tuple | frozenset):
        return all(isinstance(v, SKIPPED) for v in value)
    return False


class _Storage:
    """A storage some of whose bytes hold the value, held so that its address is not reused."""

    def __init__(self, size: int, holder: torch.Tensor) -> None:
        self.size = size
        self.marked = np.zeros(size, dtype=bool)
        self.holder = holder

    def part(self, region: Region) -> Region:
        """The marked bytes of ``region``; an empty array when none is."""
        if region is None:
            return None if self.marked.any() else np.empty(0, dtype=np.int64)
        region = region[(region >= 0) & (region < self.size)]
        return region[self.marked[region]]


class _Ops(TorchDispatchMode):
    """Hands every ATen op to the tracer after running it."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tracer.op(func, args, kwargs, out)
        return out


class Tracer:
    """Follows marked objects through the library's ops and functions, from the start to the
    end that ``is_end`` recognizes in a call's frame.

    Args:
        is_end: whether a call (its frame, and whether the library called it from outside
            it) hands the value on out of the library.
    """

    def __init__(self, is_end: Callable[[FrameType, bool], bool]) -> None:
        self.is_end = is_end
        self.serial = 0
        self.active: dict[int, Call] = {}
        self.storages: dict[int, _Storage] = {}
        self.objects: dict[int, Any] = {}
        self.producers: dict[Key, list[tuple[Step, Region]]] = {}
        self.end: Step | None = None
        self.whole: list[str] = []  # every call into the library's files: the whole step's walk
        self.on = False
        self.errors: list[Exception] = []
        self._busy = False  # inside the tracer: its own calls and ops are not the value's
        self._kinds: dict[str, str] = {}
        self._generators: dict[int, Call] = {}  # a generator's frame: one call, however resumed
        self._ops = _Ops(self)

    # -- marks ------------------------------------------------------------------------------

    def mark(self, value: Any) -> None:
        """Mark ``value`` (a tensor: its bytes in its storage) as the value to follow."""
        self._add(value, None)

    def _add(self, value: Any, step: Step | None, depth: int = 3) -> None:
        """Mark ``value`` and its fields (``depth`` deep) as made by ``step``; a tensor only
        where the value starts (the ops that made the others say which of their bytes hold it)."""
        if _shared(value):
            return
        if isinstance(value, torch.Tensor):
            if step is None:
                self._mark_tensor(value, step)
            return
        self.objects[id(value)] = value  # held: its id is not reused while the walk runs
        if step is not None:
            self.producers.setdefault(("object", id(value)), []).append((step, None))
        if depth > 0:
            for part in _fields(value):
                if not self.marks(part, depth=0):
                    self._add(part, step, depth - 1)

    def _mark_tensor(self, tensor: torch.Tensor, step: Step | None, on: bool = True) -> None:
        where = _storage(tensor)
        if where is None or where[1] == 0:
            return
        storage = self.storages.get(where[0])
        if storage is None:
            if not on:
                return
            storage = _Storage(where[1], tensor)
            self.storages[where[0]] = storage
        item = tensor.element_size()
        stride = [s * item for s in tensor.stride()]
        region = _span(tensor.shape, stride, tensor.storage_offset() * item, item)
        if region is None:
            storage.marked[:] = on
        else:
            storage.marked[region[region < storage.size]] = on
        if on and step is not None:
            self.producers.setdefault(("storage", where[0]), []).append((step, region))

    def marks(self, value: Any, depth: int = 3) -> Marks:
        """The marked objects, or bytes of marked storages, ``value`` is or holds (fields,
        items, values: ``depth`` deep)."""
        found: Marks = {}
        if isinstance(value, SKIPPED):
            return found
        if isinstance(value, torch.Tensor):
            return self._tensor_marks(value)
        if id(value) in self.objects:
            found[("object", id(value))] = None
        if isinstance(value, np.ndarray):
            _merge(found, self._array_marks(value))
            return found
        if depth > 0:
            for part in _fields(value):
                _merge(found, self.marks(part, depth - 1))
        return found

    def _tensor_marks(self, tensor: torch.Tensor) -> Marks:
        where = _storage(tensor)
        storage = None if where is None else self.storages.get(where[0])
        if where is None or storage is None:
            return {}
        item = tensor.element_size()
        stride = [s * item for s in tensor.stride()]
        part = storage.part(_span(tensor.shape, stride, tensor.storage_offset() * item, item))
        return {} if part is not None and not len(part) else {("storage", where[0]): part}

    def _array_marks(self, array: np.ndarray) -> Marks:
        address = array.__array_interface__["data"][0]
        for start, storage in self.storages.items():
            if start <= address < start + storage.size:
                region = _span(array.shape, array.strides, address - start, array.itemsize)
                part = storage.part(region)
                if part is None or len(part):
                    return {("storage", start): part}
        return {}

    def _scalars(self, frame: FrameType, caller: FrameType | None) -> Marks:
        """The numbers among ``frame``'s arguments read out of a marked array or tensor of the
        caller (the same value: the number is the value read to the host)."""
        found: Marks = {}
        if caller is None:
            return found
        numbers = [v for v in frame.f_locals.values() if isinstance(v, float | np.floating)]
        if not numbers:
            return found
        for local in list(caller.f_locals.values()):
            held = local
            if isinstance(local, torch.Tensor) and local.device.type == "cpu":
                held = local.detach().numpy(force=True) if local.numel() <= 4096 else None
            if not isinstance(held, np.ndarray) or held.size > 4096:
                continue
            marks = self._array_marks(held) or self.marks(held, depth=0)
            if marks and any(bool((held == n).any()) for n in numbers):
                _merge(found, marks)
        return found

    # -- the stack --------------------------------------------------------------------------

    def _kind(self, filename: str) -> str:
        kind = self._kinds.get(filename)
        if kind is None:
            path = Path(filename).resolve() if not filename.startswith("<") else Path(filename)
            if filename == HERE:
                kind = "self"
            elif PACKAGE in path.parents:
                kind = path.relative_to(PACKAGE.parent).as_posix()
            else:
                top = next((p for p in path.parts if p in LIBRARIES), None)
                kind = f"({top})" if top is not None else ""
            self._kinds[filename] = kind
        return kind

    def _stack(self, frame: FrameType | None) -> tuple[Call, ...]:
        calls = []
        while frame is not None:
            call = self.active.get(id(frame))
            if call is not None and call.frame is frame:
                calls.append(call)
            frame = frame.f_back
        return tuple(reversed(calls))

    def _step(self, frame: FrameType | None, inputs: Marks, what: str) -> Step:
        self.serial += 1
        return Step(self.serial, self._stack(frame), inputs, what)

    # -- recording --------------------------------------------------------------------------

    def start(self, frame: FrameType) -> None:
        """Start recording inside ``frame`` (the frames already running are entered first)."""
        outer = []
        while frame is not None:
            outer.append(frame)
            frame = frame.f_back
        for running in reversed(outer):
            self._enter(running)
        self.on = True
        self._ops.__enter__()
        sys.setprofile(self._profile)

    def stop(self) -> None:
        """Stop recording."""
        if self.on:
            sys.setprofile(None)
            self._ops.__exit__(None, None, None)
            self.on = False

    def _enter(self, frame: FrameType) -> Call:
        code = frame.f_code
        resumed = self._generators.get(id(frame))
        if resumed is not None and resumed.frame is frame:  # a generator goes on: one call
            self.active[id(frame)] = resumed
            return resumed
        self.serial += 1
        kind = self._kind(code.co_filename)
        caller = self.active.get(id(frame.f_back)) if frame.f_back is not None else None
        ours = kind not in ("", "self") and not kind.startswith("(")
        name = kind if kind and not kind.startswith("(") else code.co_filename
        line = frame.f_back.f_lineno if frame.f_back is not None else 0
        function = getattr(code, "co_qualname", code.co_name)  # Python 3.10: its name
        call = Call(self.serial, name, function, ours, caller, line, frame)
        self.active[id(frame)] = call
        if code.co_flags & inspect.CO_GENERATOR:
            self._generators[id(frame)] = call
        return call

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self._busy:
            return
        self._busy = True
        try:
            self._see(frame, event, arg)
        except Exception as error:  # raised here, it would end the recording unseen
            self.errors.append(error)
        finally:
            self._busy = False

    def _see(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self._called(frame)
        elif event == "return":
            call = self.active.get(id(frame))
            if call is not None and call.ours and self.end is None and not _shared(arg):
                self._returned(call, frame, arg)
            self.active.pop(id(frame), None)

    def _called(self, frame: FrameType) -> None:
        """A call: what of the value its arguments hold; the end, if it is the end."""
        call = self._enter(frame)
        if call.file == HERE or self.end is not None:
            return
        if call.ours:
            self.whole.append(call.file)
        from_ours = call.caller is not None and call.caller.ours
        if call.ours or from_ours:
            call.inputs = self._held(frame)
        if call.ours and from_ours:
            scalars = self._scalars(frame, frame.f_back)
            if scalars:
                read = self._step(frame.f_back, scalars, "a number read out")
                for value in frame.f_locals.values():
                    if isinstance(value, float | np.floating):
                        self._add(value, read)
                _merge(call.inputs, self._held(frame))
        if self.is_end(frame, from_ours and not call.ours):
            self._finish(frame)

    def _returned(self, call: Call, frame: FrameType, result: Any) -> None:
        """A function of the library returned ``result``: it carries the value if the
        function held it."""
        inputs = dict(call.inputs)
        _merge(inputs, self._held(frame))
        _merge(inputs, self.marks(result))
        itself = self.marks(result, depth=0)
        if itself:  # handed back as it came: a reader of the value, on its path too
            step = self._step(frame, inputs, f"return of {call.where()}")
            for key, region in itself.items():
                self.producers.setdefault(key, []).append((step, region))
        elif inputs:
            self._add(result, self._step(frame, inputs, f"return of {call.where()}"))

    def _held(self, frame: FrameType) -> Marks:
        found: Marks = {}
        for value in list(frame.f_locals.values()):
            _merge(found, self.marks(value))
        return found

    def _finish(self, frame: FrameType) -> None:
        inputs: Marks = {}
        for call in self._stack(frame):
            if call.frame is not None and (call.ours or call.frame is frame):
                _merge(inputs, call.inputs)
                _merge(inputs, self._held(call.frame))
        self.end = self._step(frame, inputs, "handed on")

    def op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """An ATen op ran: carry the mark from what it read to what it made or wrote."""
        if not self.on or self._busy or self.end is not None:
            return
        self._busy = True
        try:
            self._op(func, args, kwargs, out)
        except Exception as error:
            self.errors.append(error)
        finally:
            self._busy = False

    def _op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        stack = self._stack(sys._getframe(3))
        if not any(call.ours for call in stack):
            return
        name = func._schema.name.split("::")[-1]
        overwritten, updated = _written(func, args, kwargs)
        targets = {id(t) for t in (*overwritten, *updated)}
        read: Marks = {}
        for tensor in _flat_tensors((args, kwargs)):
            if id(tensor) not in targets:
                _merge(read, self.marks(tensor))
        if not read:  # nothing marked comes in: what is overwritten no longer holds the value
            for tensor in overwritten:
                self._mark_elements(tensor, torch.zeros(tensor.shape, dtype=torch.bool), None)
            return
        for tensor in updated:
            _merge(read, self.marks(tensor))
        self.serial += 1
        step = Step(self.serial, stack, read, f"op {func}")
        sources = {_storage(t) for t in _flat_tensors((args, kwargs))}
        made = [t for t in _flat_tensors(out) if _storage(t) not in sources]
        for tensor in (*made, *overwritten, *updated):
            carried = self._carried(name, args, kwargs, tensor, out)
            if tensor in updated and carried is not None:
                old = self.element_mask(tensor)
                carried = carried if old is None else carried | old
            self._mark_elements(tensor, carried, step)
        if not isinstance(out, torch.Tensor | tuple | list):
            self._add(out, step)  # a number: the value read to the host

    def _carried(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: torch.Tensor,
        out: Any,
    ) -> torch.Tensor | None:
        """Which elements of ``result`` (made or written by the op ``name``) carry the value:
        followed element by element through concatenation, indexing and elementwise ops, and
        through the ``_foreach`` ops tensor by tensor (``None``: all of it)."""
        try:
            if name.startswith("_foreach"):
                return self._foreach(args, result, out)
            moved = self._moved(name, args, kwargs, result)
            if moved is not None:
                return moved
            inputs = [t for t in _flat_tensors((args, kwargs)) if t is not result]
            shapes = [tuple(t.shape) for t in inputs]
            if all(torch.broadcast_shapes(s, result.shape) == result.shape for s in shapes):
                carried = torch.zeros(result.shape, dtype=torch.bool)
                for tensor in inputs:
                    carried |= self._mask_or_zeros(tensor).expand(result.shape)
                return carried
        except (RuntimeError, IndexError, TypeError, ValueError):
            return None
        return None

    def _moved(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: torch.Tensor
    ) -> torch.Tensor | None:
        """The op ``name``, run on which elements carry the value, where it moves elements
        (``None``: it does not, or its indices carry the value)."""
        moved = None
        if name in ("cat", "stack"):
            parts = [self._mask_or_zeros(t) for t in args[0]]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            moved = torch.cat(parts, dim) if name == "cat" else torch.stack(parts, dim)
        elif name == "index" and not self._any_marked(args[1]):
            moved = torch.ops.aten.index.Tensor(self._mask_or_zeros(args[0]), args[1])
        elif name == "index_select" and not self.marks(args[2]):
            moved = torch.index_select(self._mask_or_zeros(args[0]), args[1], args[2])
        elif name in ("index_put_", "index_put") and not self._any_marked(args[1]):
            values = self._mask_or_zeros(args[2])
            blank = torch.zeros(result.shape, dtype=torch.bool)
            moved = torch.ops.aten.index_put.default(blank, args[1], values)
        return moved

    def _foreach(self, args: tuple[Any, ...], result: torch.Tensor, out: Any) -> torch.Tensor:
        """A ``_foreach`` op's ``result``: all of it where the tensors of its place in the
        lists carry the value, none of it elsewhere."""
        lists = [a for a in args if isinstance(a, list | tuple)]
        results = out if isinstance(out, list | tuple) and out else lists[0]
        place = next(i for i, t in enumerate(results) if t is result)
        carried = any(
            self.marks(a[place]) for a in lists if isinstance(a[place], torch.Tensor)
        ) or any(self.marks(a) for a in args if isinstance(a, torch.Tensor))
        return torch.full(result.shape, carried, dtype=torch.bool)

    def _any_marked(self, value: Any) -> bool:
        return any(self.marks(t) for t in _flat_tensors(value))

    def _mask_or_zeros(self, tensor: torch.Tensor) -> torch.Tensor:
        mask = self.element_mask(tensor)
        return torch.zeros(tensor.shape, dtype=torch.bool) if mask is None else mask

    def element_mask(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Which elements of ``tensor`` carry the value (``None``: its storage carries none)."""
        where = _storage(tensor)
        storage = None if where is None else self.storages.get(where[0])
        elements = _elements(tensor)
        if storage is None or elements is None:
            return None
        offsets, item = elements
        inside = offsets[:, None] + np.arange(item, dtype=np.int64)
        inside = np.clip(inside, 0, storage.size - 1)
        marked = storage.marked[inside].any(axis=1).reshape(tuple(tensor.shape))
        return torch.from_numpy(marked.copy())

    def _mark_elements(
        self, tensor: torch.Tensor, carried: torch.Tensor | None, step: Step | None
    ) -> None:
        """Set which elements of ``tensor`` carry the value (``None``: all), made by ``step``."""
        where = _storage(tensor)
        elements = _elements(tensor)
        if where is None or where[1] == 0 or elements is None:
            return
        if carried is not None and not bool(carried.any()) and where[0] not in self.storages:
            return
        storage = self.storages.setdefault(where[0], _Storage(where[1], tensor))
        offsets, item = elements
        flags = np.ones(len(offsets), dtype=bool) if carried is None else carried
        if isinstance(flags, torch.Tensor):
            flags = flags.reshape(-1).numpy()
        inside = (offsets[:, None] + np.arange(item, dtype=np.int64)).reshape(-1)
        keep = inside < storage.size
        storage.marked[inside[keep]] = np.repeat(flags, item)[keep]
        region = (offsets[flags][:, None] + np.arange(item, dtype=np.int64)).reshape(-1)
        if step is not None and len(region):
            self.producers.setdefault(("storage", where[0]), []).append((step, region))

    # -- the path ---------------------------------------------------------------------------

    def path(self) -> list[Call]:
        """The calls on the value's path, in the order they were made."""
        if self.errors:
            raise RuntimeError("the recording failed") from self.errors[0]
        if self.end is None:
            raise RuntimeError("the value never left the library")
        seen = {id(self.end)}
        todo = [self.end]
        calls: dict[int, Call] = {}
        while todo:
            step = todo.pop()
            for call in step.stack:
                calls[call.serial] = call
            for key, region in step.inputs.items():
                for made, where in self.producers.get(key, []):
                    earlier = made.serial < step.serial
                    if earlier and id(made) not in seen and _overlap(where, region):
                        seen.add(id(made))
                        todo.append(made)
        handed = next(
            (c for c in self.end.stack if not c.ours and c.caller is not None and c.caller.ours),
            None,
        )
        on = [s for s, call in calls.items() if call.ours or call is handed]
        return [calls[s] for s in sorted(on)]


@dataclasses.dataclass
class Entry:
    """The walk entering a file: by a call from another file, or from outside the library."""

    file: str
    function: str
    again: str | None  # a return: who called the file back, after the walk had left it


@dataclasses.dataclass
class Walk:
    """A value's walk: the files its calls entered, in order, and the whole recording's."""

    title: str
    entries: list[Entry]
    whole: list[str]

    @property
    def files(self) -> list[str]:
        """The library's files on the walk, each once, in the order the walk first met them."""
        return list(dict.fromkeys(e.file for e in self.entries if not e.file.startswith("/")))

    @property
    def returns(self) -> list[Entry]:
        """The entries into a file the walk had left."""
        return [e for e in self.entries if e.again is not None]


def walk_of(title: str, calls: list[Call], whole: list[str]) -> Walk:
    """The files the calls on a value's path entered, in order: a call within one file enters
    none; a call into a file the walk entered before is a return."""
    entries: list[Entry] = []
    for call in calls:
        caller = call.caller
        if caller is not None and caller.file == call.file:
            continue
        if entries and entries[-1].file == call.file:
            continue
        again = _called_by(call) if any(e.file == call.file for e in entries) else None
        entries.append(Entry(call.file, call.function, again))
    return Walk(title, entries, whole)


def _called_by(call: Call) -> str:
    """Who made ``call``: the library's function and line, and what lies between them."""
    inner = call
    caller = call.caller
    through: list[str] = []
    while caller is not None and not caller.ours:
        through.append(_library(caller.file))
        inner = caller
        caller = caller.caller
    if caller is None:
        return f"{through[0] if through else 'the caller'} calls"
    via = f" (through {through[0]})" if through else ""
    return f"`{_short(caller.file)}:{inner.line}` (`{caller.function}`){via} calls"


class Jumping(pl.LightningModule):
    """An MLP on fixed random data whose loss is multiplied by 50 from step ``JUMP`` on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss * 50.0 if self.trainer.global_step >= JUMP else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1)), 8)


def carries(value: Any, text: str, depth: int = 2) -> bool:
    """Whether ``value`` is, holds or serializes to ``text`` (a tag, a warning's word)."""
    if isinstance(value, str | Warning):
        return text in str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return text.encode() in bytes(value)
    serialize = getattr(value, "SerializeToString", None)
    if callable(serialize) and type(value).__module__.startswith("tensorboard"):
        return text.encode() in serialize()
    parts: list[Any] = []
    if depth > 0 and isinstance(value, dict):
        parts = [*value, *list(value.values())[:64]]
    elif depth > 0 and isinstance(value, tuple | list):
        parts = list(value[:64])
    return any(carries(part, text, depth - 1) for part in parts)


class GradientWalk(pl.Callback):
    """First in the list: marks layer ``LAYER``'s gradients at the logging step, before the
    library reads them; ends where ``tag`` is handed to TensorBoard."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.tracer = Tracer(self._is_end)

    def _is_end(self, frame: FrameType, handed: bool) -> bool:
        if not handed:
            return False
        values = frame.f_locals.values()
        return any(carries(value, self.tag) for value in values)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if trainer.global_step == LOGGING_STEP and not self.tracer.on:
            layer = pl_module.get_submodule(LAYER)
            for param in layer.parameters():
                self.tracer.mark(param.grad)
            self.tracer.start(sys._getframe())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.tracer.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.tracer.stop()  # the profile and the mode off before the error reaches the caller


class DivergingWalk(pl.Callback):
    """First in the list: marks the loss of every batch from step ``JUMP`` on, before the
    library reads it; ends where the ``diverging`` warning is shown."""

    def __init__(self) -> None:
        self.tracer = Tracer(self._is_end)

    @staticmethod
    def _is_end(frame: FrameType, handed: bool) -> bool:
        if frame.f_code.co_name != "_showwarnmsg" or "warnings" not in frame.f_code.co_filename:
            return False
        message = frame.f_locals.get("msg")
        return message is not None and "diverging" in str(getattr(message, "message", ""))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        if trainer.global_step <= JUMP or self.tracer.end is not None:  # after the step
            self.tracer.stop()
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.tracer.mark(loss)
        if not self.tracer.on:
            self.tracer.start(sys._getframe())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.tracer.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.tracer.stop()  # the profile and the mode off before the error reaches the caller


def _unshown(*args: Any, **kwargs: Any) -> None:
    """A warning reached the place where it is shown; the walks print none."""


def fit(*recorders: pl.Callback, batches: int | None = None) -> None:
    """One fit of :class:`Jumping` with ``recorders`` first, then ``GradFlowCallback()``."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", lightning_hooks.TrainingAlarmWarning)  # the walk's end
        warnings.showwarning = _unshown
        trainer = pl.Trainer(
            max_epochs=1,
            limit_train_batches=batches,
            accelerator="cpu",
            logger=TensorBoardLogger(tmp, name="tb"),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=LOGGING_STEP + 1,
            callbacks=[*recorders, lightning_hooks.GradFlowCallback()],
        )
        trainer.fit(Jumping())


class Composition(pl.Callback):
    """After the first batch: the objects ``GradFlowCallback()`` holds, drawn as a tree."""

    def __init__(self) -> None:
        self.tree = ""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.tree:
            callback = next(c for c in trainer.callbacks if type(c).__name__ == "GradFlowCallback")
            self.tree = "\n".join(_tree(callback, depth=4))


def _ours(value: Any) -> bool:
    """Whether ``value`` is an object of a class of the library (not a function, not a type)."""
    module = getattr(type(value), "__module__", "")
    return module.startswith("lightning_hooks.") and not callable(value)


def _held_objects(value: Any) -> list[tuple[str, Any]]:
    """The library's objects ``value`` holds: its attributes first, by name, then the items of
    its lists, tuples and dicts, by place (a run of items of one class: the first, for all)."""
    named = []
    items = []
    for name, attribute in getattr(value, "__dict__", {}).items():
        if _ours(attribute):
            named.append((name, attribute))
        elif isinstance(attribute, list | tuple | dict):
            keyed = attribute.items() if isinstance(attribute, dict) else enumerate(attribute)
            found = [(_key(key), item) for key, item in keyed if _ours(item)]
            if len(found) > 2 and len({type(item) for _, item in found}) == 1:
                items.append((f"{name}[{found[0][0]}..{found[-1][0]}]", found[0][1]))
            else:
                items += [(f"{name}[{key}]", item) for key, item in found]
    return named + items


def _key(key: object) -> str:
    """A key as the tree shows it: a name or a place (any other key, an id, a shape: ``...``)."""
    if isinstance(key, int) and key >= 1 << 20:  # an object's id: another every run
        return "..."
    return repr(key) if isinstance(key, str | int) else "..."


def _tree(root: Any, depth: int = 3) -> list[str]:
    """``root`` and the library's objects it holds, ``depth`` levels down, one line each: the
    attribute, the class and its file. An object is drawn where it is met nearest the root (an
    attribute before an item); elsewhere it is named."""
    where: dict[int, str] = {id(root): type(root).__name__}
    level = [(root, type(root).__name__)]
    for _ in range(depth):
        below = []
        for value, path in level:
            for name, item in _held_objects(value):
                if id(item) not in where:
                    where[id(item)] = f"{path}.{name}"
                    below.append((item, f"{path}.{name}"))
        level = below
    lines: list[str] = []

    def draw(value: Any, label: str, prefix: str, last: bool, path: str, down: int) -> None:
        cls = type(value)
        file = _short(cls.__module__.replace(".", "/") + ".py")
        branch = prefix + ("`-- " if last else "|-- ") if down else ""
        head = f"{branch}{label}{cls.__name__}"
        if where.get(id(value)) != path:
            lines.append(f"{head}  (the same as {where[id(value)]})")
            return
        lines.append(f"{head:<50}  {file}")
        if down == depth:
            return
        held = _held_objects(value)
        inner = prefix + ("    " if last else "|   ") if down else prefix
        for i, (name, item) in enumerate(held):
            draw(item, f"{name}: ", inner, i == len(held) - 1, f"{path}.{name}", down + 1)

    draw(root, "", "", True, type(root).__name__, 0)
    return lines


def record() -> dict[str, str]:
    """The recording, in Markdown, by part: ``composition``, the objects ``GradFlowCallback()``
    holds, and ``walks``, the three walks: the gradient norm to its logging step's write and to
    its epoch's, and the ``diverging`` alarm."""
    found = []
    ends = {"step": "the logging step's write", "epoch": "the epoch's write"}
    for kind, tag in (("step", f"grad_flow/grad_norm_step/{LAYER}"), ("epoch", GRAD_NORM)):
        recorder = GradientWalk(tag)
        fit(recorder, batches=LOGGING_STEP + 2)  # the epoch ends two steps after the logging one
        title = f"`{tag}`: layer `{LAYER}`'s gradients at logging step {LOGGING_STEP}, to "
        tracer = recorder.tracer
        found.append(walk_of(title + ends[kind], tracer.path(), tracer.whole))
    diverging = DivergingWalk()
    composition = Composition()
    fit(diverging, composition)
    title = f"`diverging`: the loss from step {JUMP} on, to the warning"
    tracer = diverging.tracer
    found.append(walk_of(title, tracer.path(), tracer.whole))
    return {
        "composition": f"```text\n{composition.tree}\n```\n",
        "walks": "\n".join(report(walk) for walk in found),
    }


def recorded_part(text: str, part: str) -> str:
    """The part ``part`` of the recording as ``text`` (a page, or the saved file) holds it."""
    start = text.index(f"{MARK}{part} -->\n") + len(f"{MARK}{part} -->\n")
    return text[start : text.index(END, start)]


def _with_part(text: str, part: str, recorded: str) -> str:
    start = text.index(f"{MARK}{part} -->\n") + len(f"{MARK}{part} -->\n")
    return text[:start] + recorded + text[text.index(END, start) :]


def report(walk: Walk) -> str:
    """``walk`` in Markdown: its entries, its returns, then the whole recording's count."""
    handed = [e.file for e in walk.entries if e.file.startswith("/")]
    to = f"; handed on to {_library(handed[0])}" if handed else ""
    returns = f"{len(walk.returns)} return{'' if len(walk.returns) == 1 else 's'}"
    lines = [f"### {walk.title}", "", f"{len(walk.files)} files, {returns} to a file it left{to}:"]
    lines.append("")
    for i, entry in enumerate(walk.entries, 1):
        if entry.file.startswith("/"):
            shown = f"{_library(entry.file)}: `{_tail(entry.file)}`"
        else:
            shown = f"`{_short(entry.file)}`"
        back = " (again)" if entry.again is not None else ""
        lines.append(f"{i}. {shown} `{entry.function}`{back}")
    lines.append("")
    if walk.returns:
        lines += ["The returns:", ""]
        lines += [f"- `{_short(e.file)}`: {e.again} `{e.function}`" for e in walk.returns]
        lines.append("")
    steps = [f for i, f in enumerate(walk.whole) if i == 0 or walk.whole[i - 1] != f]
    distinct = set(steps)
    lines.append(
        "Every call into the library from the mark to the end, the measure this script gave "
        f"before it followed one value: {len(distinct)} files, "
        f"{len(steps) - len(distinct)} returns."
    )
    return "\n".join(lines) + "\n"


def _short(file: str) -> str:
    return file.removeprefix("lightning_hooks/")


def _library(path: str) -> str:
    return next((p for p in Path(path).parts if p in LIBRARIES), Path(path).stem)


def _tail(path: str) -> str:
    parts = Path(path).parts
    top = next(i for i, p in enumerate(parts) if p in LIBRARIES)
    return "/".join(parts[top:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", action="store_true", help=f"write {SAVED} and the page")
    save = parser.parse_args().save
    torch.set_num_threads(1)
    parts = record()
    print("\n".join(parts.values()), end="")
    if save:
        saved = "".join(f"{MARK}{part} -->\n{text}{END}\n" for part, text in parts.items())
        SAVED.write_text(saved)
        page = PAGE.read_text()
        for part, text in parts.items():
            page = _with_part(page, part, text)
        PAGE.write_text(page)


if __name__ == "__main__":
    main()
