"""Moving values off the device and across ranks.

The host read-back of small device tensors, the first non-finite event, the process group's
facts (no-ops in one process), and sharded parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "FirstNonFinite",
    "HostCopy",
    "HostSlot",
    "Reduced",
    "ShardPlan",
    "agree",
    "all_gather_stacked",
    "all_reduce_sum_",
    "combine_partials",
    "gather_objects",
    "group_device",
    "is_distributed",
    "rank",
    "to_group_device",
    "to_local",
    "world_size",
]


class HostSlot(NamedTuple):
    """Host memory for one shape of posted value: a tensor and a numpy array over its bytes."""

    tensor: torch.Tensor  # what the device copies into
    array: np.ndarray  # what the host reads


T = TypeVar("T")


class HostCopy:
    """A small device tensor copied to pinned host memory without blocking, read on a later call.

    Args:
        shape: the shape of the host buffer made at once (:meth:`reserve` adds others).
        device: the device the posted values live on; on CUDA the host memory is pinned and the
            copy is awaited with an event.
        dtype: the dtype of the host buffer and of the values posted.
    """

    def __init__(
        self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
    ) -> None:
        self._cuda = device.type == "cuda"
        self._dtype = dtype
        self._event = torch.cuda.Event() if self._cuda else None  # type: ignore[no-untyped-call]
        self._meta: Any = None
        self._allocate(shape)
        self.pending = False

    def _allocate(self, shape: tuple[int, ...]) -> None:
        """Make a host buffer of ``shape``, the torch and numpy views over it, and its slot."""
        if self._cuda:
            self._host = torch.zeros(shape, dtype=self._dtype, pin_memory=True)
            self._view = self._host.numpy()
        else:  # host memory both ways: numpy's buffer, seen by torch (no Tensor.numpy call)
            dtype = np.dtype(str(self._dtype).removeprefix("torch."))
            self._view = np.zeros(shape, dtype=dtype)
            self._host = torch.from_numpy(self._view)
        self._slot = HostSlot(tensor=self._host, array=self._view)
        self._slots = {tuple(self._host.shape): self._slot}

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the host buffer."""
        return tuple(self._host.shape)

    def reserve(self, shape: tuple[int, ...]) -> HostSlot:
        """Return the host views for values of ``shape``, made once.

        A caller reserves its shapes ahead, so that :meth:`post` never allocates. If the buffer
        must grow, a value posted and not yet read stays in the old buffer until it is read.

        Args:
            shape: the shape of the values to be posted.

        Returns:
            The slot whose tensor the device copies into and whose array the host reads.
        """
        if shape in self._slots:
            return self._slots[shape]
        count = math.prod(shape)
        if count > self._host.numel():
            unread = self._slot  # a pending value stays in the old buffer until read
            self._allocate((count,))
            self._slot = unread
        host = self._host.view(-1)[:count].view(shape)
        array = self._view.reshape(-1)[:count].reshape(shape)
        self._slots[shape] = HostSlot(tensor=host, array=array)
        return self._slots[shape]

    def post(self, value: torch.Tensor, meta: Any = None) -> None:  # noqa: ANN401 (the caller's record, handed back with the value)
        """Start copying ``value`` to the host.

        Args:
            value: the device tensor to copy.
            meta: the caller's record, which comes back with the value from :meth:`read`.
        """
        slot = self._slots.get(tuple(value.shape)) or self.reserve(tuple(value.shape))
        self._slot = slot
        slot.tensor.copy_(value, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._meta = meta
        self.pending = True

    def read(self, wait: bool) -> tuple[np.ndarray, Any] | None:
        """Return the posted value and its ``meta`` once copied.

        Args:
            wait: block until the copy is done, rather than return ``None`` while it is not.

        Returns:
            The posted value (a numpy view, valid until the next post) and its ``meta``, or
            ``None`` if nothing is posted or the copy is not done.
        """
        if not self.pending:
            return None
        if self._event is not None:
            if wait:
                self._event.synchronize()
            elif not self._event.query():  # type: ignore[no-untyped-call]
                return None
        meta = self._meta
        self._meta = None
        self.pending = False
        return self._slot.array, meta

    def clear(self, fill: float = 0) -> None:
        """Drop a pending value and fill the host buffer.

        Args:
            fill: the value the host buffer is filled with.
        """
        self._meta = None
        self.pending = False
        self._view.fill(fill)


_ROW_SPACE = 1 << 24
"""A :class:`FirstNonFinite` mark packs a step and a row into one integer,
``step * _ROW_SPACE + row`` (``-1``: none yet), so one device write records both."""


def _code(got: tuple[np.ndarray, Any] | None) -> int:
    """Return the mark a :class:`FirstNonFinite` read back (``-1``: none, or nothing read)."""
    if got is None:
        return -1
    value, _ = got
    return int(value[0])


class FirstNonFinite:
    """The step and row (a module, in execution order) of the first NaN / Inf.

    Kept on ``device`` and polled without waiting (on CUDA at most one step late).

    Args:
        device: the device the mark is kept on (that of the tensors checked).

    Example:
        >>> watch = FirstNonFinite(torch.device("cpu"))
        >>> watch.mark(torch.tensor(False), step=3, row=0)
        >>> watch.mark(torch.tensor(True), step=4, row=2)
        >>> watch.mark(torch.tensor(True), step=4, row=5)
        >>> watch.poll()
        (4, 2)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.code = torch.full((1,), -1, dtype=torch.int64, device=device)
        self._host_copy = HostCopy((1,), device, torch.int64)
        self._host_copy.clear(-1)
        self.taken = False
        """Whether :meth:`take` has returned the mark."""

    def mark(self, bad: torch.Tensor, step: int, row: int | torch.Tensor) -> None:
        """Record ``(step, row)`` if ``bad`` is the first non-finite event.

        Args:
            bad: a 0-d bool tensor, true where a NaN / Inf was found.
            step: the step recorded.
            row: the row recorded (a module, in execution order): an int < 2**24, or a 0-d
                device tensor.
        """
        hit = bad & (self.code < 0)
        if isinstance(row, int):
            self.code.masked_fill_(hit, step * _ROW_SPACE + row)
        else:  # a Python scalar added to a device tensor is a kernel argument, no copy
            torch.where(hit, row + step * _ROW_SPACE, self.code, out=self.code)

    def poll(self) -> tuple[int, int] | None:
        """Poll the first mark without waiting.

        Returns:
            The ``(step, row)`` of the first mark that has reached the host, or ``None``.
        """
        host_copy = self._host_copy
        code = _code(host_copy.read(wait=False))
        if code < 0 and not host_copy.pending:
            # Nothing has arrived and no copy is on its way: start one (on the CPU it is read
            # at once; on CUDA at a later poll).
            host_copy.post(self.code)
            code = -1 if self.device.type == "cuda" else _code(host_copy.read(wait=False))
        return divmod(code, _ROW_SPACE) if code >= 0 else None

    def take(self) -> tuple[int, int] | None:
        """Poll the first mark without waiting, and return it once only.

        Returns:
            The ``(step, row)`` of the first mark the first time it has reached the host; then,
            and before it, ``None``.

        Example:
            >>> watch = FirstNonFinite(torch.device("cpu"))
            >>> watch.mark(torch.tensor(True), step=4, row=2)
            >>> watch.take(), watch.take(), watch.taken
            ((4, 2), None, True)
        """
        if self.taken:
            return None
        found = self.poll()
        self.taken = found is not None
        return found

    def reset(self) -> None:
        """Forget any mark (a new run)."""
        self.code.fill_(-1)
        self._host_copy.clear(-1)


def is_distributed() -> bool:
    """Return whether a default process group is up.

    Returns:
        ``True`` once one is (Lightning's DDP creates one in ``setup``).
    """
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Return this process's rank in the default group.

    Returns:
        The rank, ``0`` without a group.
    """
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Return the number of processes in the default group.

    Returns:
        The world size, ``1`` without a group.
    """
    return dist.get_world_size() if is_distributed() else 1


def group_device() -> torch.device:
    """Return the device of the default group's collectives.

    Returns:
        The current CUDA device under NCCL, else the CPU.
    """
    if is_distributed() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_group_device(tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``tensor`` to the collectives' device.

    Args:
        tensor: the tensor to copy.

    Returns:
        ``tensor`` detached, as a new float32 tensor on :func:`group_device` (non-blocking).
    """
    device = group_device()
    return tensor.detach().to(device=device, dtype=torch.float32, non_blocking=True, copy=True)


def agree(flags: Sequence[bool]) -> list[int]:
    """Count how many ranks raise each flag.

    One small ``all_reduce`` read on the host (a host sync).

    Args:
        flags: this rank's flags, in the same order on every rank.

    Returns:
        For each flag, how many ranks raise it.
    """
    counts = torch.tensor([float(f) for f in flags], dtype=torch.float32, device=group_device())
    if is_distributed() and dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return [int(c) for c in counts.tolist()]


def gather_objects(obj: T) -> list[T]:
    """Gather every rank's ``obj``, by rank: a one-off ``all_gather_object``.

    Args:
        obj: this rank's object (picklable).

    Returns:
        Each rank's object, by rank (``[obj]`` in one process).
    """
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()  # filled with each rank's
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place (one collective).

    Args:
        tensor: the tensor summed in place.

    Returns:
        ``tensor``.
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_stacked(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Gather every rank's ``tensor`` into one stacked tensor (one collective).

    Args:
        tensor: this rank's tensor, of the same shape on every rank.
        group: the process group gathered over (``None``: the default group).

    Returns:
        A ``[world_size, *tensor.shape]`` tensor: every rank's ``tensor``, by rank.
    """
    if not is_distributed():
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


_DTENSOR: tuple[type, ...] = ()
try:  # public since torch 2.4; without it no parameter is a DTensor
    from torch.distributed.tensor import DTensor

    _DTENSOR = (DTensor,)
except ImportError:  # pragma: no cover - older torch
    pass


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """Return this rank's shard of a ``DTensor`` (a view, no copy, no collective).

    Args:
        tensor: a ``DTensor`` or a plain tensor.

    Returns:
        The local shard of a ``DTensor``, else ``tensor`` itself.
    """
    return tensor.to_local() if isinstance(tensor, _DTENSOR) else tensor  # type: ignore[attr-defined]


def combine_partials(gathered: torch.Tensor, num_sums: int) -> torch.Tensor:
    """Combine shard-local partials into whole values.

    Args:
        gathered: ``[shards, rows, columns]`` partials.
        num_sums: how many leading columns are summed; the others are maxed.

    Returns:
        A ``[rows, columns]`` tensor.
    """
    return torch.cat([gathered[..., :num_sums].sum(0), gathered[..., num_sums:].amax(0)], dim=-1)


class Reduced(NamedTuple):
    """What :meth:`ShardPlan.reduce` made whole: each tensor it was given, in order."""

    norms: list[torch.Tensor]
    sums: list[torch.Tensor]
    maxima: list[torch.Tensor]


@dataclass(frozen=True)
class ShardPlan:
    """The process group sharding every tracked parameter (FSDP2 ``DTensor``).

    Shard-local partials are made exact by one collective over it.

    Args:
        group: the process group.
        ranks: the group's global ranks.
    """

    group: dist.ProcessGroup | None = field(compare=False)
    ranks: tuple[int, ...]

    @classmethod
    def from_params(cls, params: Sequence[torch.Tensor]) -> ShardPlan | None:
        """Return the plan of ``params``.

        Args:
            params: the tracked parameters.

        Returns:
            Their plan, or ``None`` if none is a ``DTensor``.

        Raises:
            ValueError: the parameters are not sharded by FSDP2 over one process group (some are
                plain tensors, they use different groups, or their placements are not supported).
        """
        sharded = [isinstance(p, _DTENSOR) for p in params]
        if not any(sharded):
            return None
        if not all(sharded):
            i = sharded.index(False)
            raise ValueError(
                "ShardPlan.from_params(params): every parameter must be a DTensor when one is "
                f"(apply fully_shard to the root module too); parameter {i} of shape "
                f"{tuple(params[i].shape)} is a plain tensor"
            )
        plans = {_plan_of(p) for p in params}
        if len(plans) > 1:
            raise ValueError(
                "ShardPlan.from_params(params): the parameters are sharded over different process "
                f"groups (ranks {sorted(p.ranks for p in plans)}); supported: one fully_shard mesh "
                "for the whole model"
            )
        return plans.pop()

    def reduce(
        self,
        *,
        norms: Sequence[torch.Tensor] = (),
        sums: Sequence[torch.Tensor] = (),
        maxima: Sequence[torch.Tensor] = (),
    ) -> Reduced:
        """Make shard-local per-parameter values whole, in one collective.

        Args:
            norms: shard-local per-parameter L2 norms.
            sums: shard-local per-parameter sums.
            maxima: shard-local per-parameter maxima.

        Returns:
            Each tensor given, made whole, in order.
        """
        columns = [n.float().square() for n in norms] + [s.float() for s in sums]
        num_sums = len(columns)
        columns += [m.float() for m in maxima]
        packed = torch.stack(columns, dim=1)
        if len(self.ranks) > 1:
            packed = combine_partials(all_gather_stacked(packed, self.group), num_sums)
        out = list(packed.unbind(1))
        k = len(norms)
        return Reduced(
            norms=[n.sqrt() for n in out[:k]], sums=out[k:num_sums], maxima=out[num_sums:]
        )

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the shard group.

        Args:
            tensor: the shard-local tensor.

        Returns:
            The sum, a new tensor (``tensor`` itself where the group has one rank).
        """
        if len(self.ranks) == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out


def _plan_of(param: torch.Tensor) -> ShardPlan:
    """Return the plan of one ``DTensor`` parameter, or raise ``ValueError`` (not FSDP2 / HSDP)."""
    placements = tuple(param.placements)  # type: ignore[attr-defined]
    mesh = param.device_mesh  # type: ignore[attr-defined]
    shard_dims = [d for d, p in enumerate(placements) if p.is_shard()]
    others = [p for p in placements if not (p.is_shard() or p.is_replicate())]
    if len(shard_dims) != 1 or others:
        raise ValueError(
            f"ShardPlan.from_params(params): a parameter of shape {tuple(param.shape)} has "
            f"placements {placements} on mesh {mesh}; supported: Shard along one mesh dimension "
            "(FSDP2 fully_shard), Replicate along the others (HSDP)"
        )
    group = mesh.get_group(shard_dims[0])
    return ShardPlan(group=group, ranks=tuple(dist.get_process_group_ranks(group)))
