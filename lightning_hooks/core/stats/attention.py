"""Computation and capture of the logits of sdpa, ``nn.MultiheadAttention`` and eager attention."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional

from lightning_hooks import internals
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.hooks.suspended import SuspendableMode
from lightning_hooks.core.ops.tensors import is_training_forward

__all__ = [
    "LOGIT_BUDGET",
    "AttentionCapture",
    "HeadEntropy",
    "MhaCall",
    "attention_free",
    "attention_head_entropy",
    "logit_chunks",
    "looks_like_attention",
    "mha_logit_chunks",
    "sdpa_logit_chunks",
]

Record = Callable[[str, torch.Tensor], None]
"""Gets an attention module's name and a chunk of its logits (:func:`logit_chunks`)."""
LOGIT_BUDGET = 1 << 24
"""Elements of the largest chunk of attention logits made at once (64 MiB in float32)."""
_SOFTMAX = (functional.softmax, torch.softmax, torch.Tensor.softmax)
_SOFTMAX_LAYERS = (nn.Softmax, nn.Softmax2d)  # the ``torch.nn`` layers that call one of them


def sdpa_logit_chunks(  # noqa: PLR0913 (the arguments of torch's scaled_dot_product_attention)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    budget: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the float32 logits ``[..., L, S]`` that the softmax of sdpa sees.

    sdpa is ``scaled_dot_product_attention``; its arguments act as they do there.

    They come in chunks of query rows (see :func:`logit_chunks`).

    Args:
        query: sdpa's ``query``.
        key: sdpa's ``key``.
        value: sdpa's ``value``; it plays no part.
        attn_mask: sdpa's ``attn_mask``.
        dropout_p: sdpa's ``dropout_p``; it plays no part.
        is_causal: sdpa's ``is_causal``.
        scale: sdpa's ``scale`` (``None``: one over the root of the head size).
        enable_gqa: sdpa's ``enable_gqa``: key heads shared by groups of query heads.
        budget: the most elements per chunk (default :data:`LOGIT_BUDGET`).

    Yields:
        The logits of consecutive chunks of query rows.
    """
    q = query.float()
    k = key.float()
    if enable_gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    length = q.shape[-2]
    keys = k.shape[-2]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])  # type: ignore[no-untyped-call]
    per_row = math.prod(lead) * keys
    key_t = k.transpose(-2, -1)
    for start, stop in _row_chunks(length, per_row, budget):
        with torch.autocast(q.device.type, enabled=False):  # float32 under mixed precision too
            logits = torch.matmul(q[..., start:stop, :], key_t).mul_(factor)  # in place
        if is_causal:
            keep = torch.ones(stop - start, keys, dtype=torch.bool, device=logits.device)
            logits.masked_fill_(~keep.tril_(start), -torch.inf)
        if attn_mask is not None:
            mask = _query_rows(attn_mask, start, stop, length)
            if mask.dtype == torch.bool:
                logits = torch.where(mask, logits, -torch.inf)  # the mask may broadcast it
            else:
                logits = logits + mask.float()
        yield logits


def logit_chunks(logits: torch.Tensor, budget: int | None = None) -> Iterator[torch.Tensor]:
    """Yield views of ``logits [..., L, S]``, of ``budget`` elements or a row.

    Args:
        logits: the logits.
        budget: the most elements per view (default :data:`LOGIT_BUDGET`); a row at least.

    Yields:
        Views of consecutive chunks of query rows.
    """
    if logits.dim() < 2:
        yield logits
        return
    per_row = logits[..., :1, :].numel()
    for start, stop in _row_chunks(logits.shape[-2], per_row, budget):
        yield logits[..., start:stop, :]


def _row_chunks(length: int, per_row: int, budget: int | None) -> list[tuple[int, int]]:
    """Return ``[start, stop)`` of query rows, ``per_row`` elements each, within ``budget``."""
    rows = max(1, (LOGIT_BUDGET if budget is None else budget) // max(per_row, 1))
    return [(i, min(i + rows, length)) for i in range(0, max(length, 1), rows)]


def _query_rows(mask: torch.Tensor, start: int, stop: int, length: int) -> torch.Tensor:
    """Return ``mask``'s query rows ``[start, stop)``, or ``mask`` if it broadcasts over queries."""
    return mask[..., start:stop, :] if mask.dim() >= 2 and mask.shape[-2] == length != 1 else mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return a boolean mask (``True``: excluded) as ``-inf``; a float mask as it is added."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, -torch.inf)
    return mask.to(dtype)


_MHA_FORWARD = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
"""The first parameters of ``nn.MultiheadAttention.forward``, in order."""


class MhaCall(NamedTuple):
    """The arguments of one ``nn.MultiheadAttention`` call that its logits depend on."""

    query: torch.Tensor
    key: torch.Tensor
    key_padding_mask: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> MhaCall:
        """Return the call's arguments, from the arguments as ``forward`` gets them.

        Args:
            args: the positional arguments of the call.
            kwargs: the keyword arguments of the call.

        Returns:
            The arguments the logits depend on, by position or keyword.
        """
        named = {**dict(zip(_MHA_FORWARD, args, strict=False)), **kwargs}
        return cls(
            query=named["query"],
            key=named["key"],
            key_padding_mask=named.get("key_padding_mask"),
            attn_mask=named.get("attn_mask"),
        )


def mha_logit_chunks(
    mha: nn.MultiheadAttention, call: MhaCall, *, budget: int | None = None
) -> Iterator[torch.Tensor]:
    """Yield the pre-softmax logits ``[N, H, L, S']`` that ``mha``'s softmax sees in ``call``.

    Masks, ``bias_k`` and ``add_zero_attn`` are included.

    Args:
        mha: the attention module, whose projections and options are read.
        call: the arguments of its call.
        budget: the most elements per chunk (default :data:`LOGIT_BUDGET`).

    Yields:
        The logits a chunk of query rows at a time.
    """
    query = call.query
    key = call.key
    key_padding_mask = call.key_padding_mask
    attn_mask = call.attn_mask
    if query.dim() == 2:  # unbatched: [L, E]
        query = query.unsqueeze(1)
        key = key.unsqueeze(1)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    elif mha.batch_first:
        query = query.transpose(0, 1)
        key = key.transpose(0, 1)
    projected = _mha_projections(mha, query, key)
    q = projected.query
    key_t = projected.key_t
    n = query.shape[1]
    heads = mha.num_heads
    pad = (0, projected.extra_keys)
    if attn_mask is not None:
        mask = _additive(attn_mask, q.dtype)
        attn_mask = functional.pad(mask if mask.dim() == 3 else mask.unsqueeze(0), pad)
    padding = None
    if key_padding_mask is not None:
        mask = _additive(key_padding_mask, q.dtype)  # [N, S]
        mask = mask.view(n, 1, 1, -1).expand(n, heads, 1, -1).reshape(n * heads, 1, -1)
        padding = functional.pad(mask, pad)
    length = q.shape[1]
    for start, stop in _row_chunks(length, n * heads * key_t.shape[-1], budget):
        logits = torch.bmm(q[:, start:stop], key_t) / math.sqrt(q.shape[-1])
        if attn_mask is not None:
            logits = logits + _query_rows(attn_mask, start, stop, length)
        if padding is not None:
            logits = logits + padding
        yield logits.view(n, heads, *logits.shape[1:])


class _Projections(NamedTuple):
    """The projected queries and keys of an ``nn.MultiheadAttention`` call, split by head."""

    query: torch.Tensor  # [N*H, L, d]
    key_t: torch.Tensor  # the keys transposed, [N*H, d, S']
    extra_keys: int  # the keys of bias_k and add_zero_attn at the end of S'


def _mha_projections(
    mha: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor
) -> _Projections:
    """Return the projections of seq-first ``[L, N, E]`` inputs.

    The keys of ``bias_k`` and ``add_zero_attn`` are included.
    """
    e = mha.embed_dim
    heads = mha.num_heads
    # torch's own test of one packed projection (its private _qkv_same_embed_dim)
    if mha.kdim == e and mha.vdim == e:
        w_q = mha.in_proj_weight[:e]
        w_k = mha.in_proj_weight[e : 2 * e]
    else:
        w_q = mha.q_proj_weight
        w_k = mha.k_proj_weight
    bias = mha.in_proj_bias
    q = functional.linear(query, w_q, None if bias is None else bias[:e])  # [L, N, E]
    k = functional.linear(key, w_k, None if bias is None else bias[e : 2 * e])  # [S, N, E]
    n = q.shape[1]
    extra = []
    if mha.bias_k is not None:
        extra.append(mha.bias_k.to(k.dtype).expand(1, n, e))
    if mha.add_zero_attn:
        extra.append(k.new_zeros(1, n, e))
    k = torch.cat([k, *extra]) if extra else k
    q = q.reshape(q.shape[0], n * heads, -1).transpose(0, 1)  # [N*H, L, d]
    key_t = k.reshape(k.shape[0], n * heads, -1).permute(1, 2, 0)  # [N*H, d, S']
    return _Projections(query=q, key_t=key_t, extra_keys=len(extra))


class HeadEntropy(NamedTuple):
    """The attention entropy of logits ``[..., H, L, S]``.

    It holds sums, which pool exactly over calls and ranks.
    """

    peak: torch.Tensor  # the largest logit
    total: torch.Tensor  # [H] the sum of each head's row entropies (nats)
    rows: torch.Tensor  # [H] the rows in each head's sum (float32)


def attention_head_entropy(logits: torch.Tensor) -> HeadEntropy:
    """Return the :class:`HeadEntropy` of ``logits``; rows of only ``-inf`` are left out. No sync.

    Args:
        logits: the pre-softmax logits ``[..., H, L, S]``.

    Returns:
        The largest logit, and each head's sum of row entropies with its row count.
    """
    logits = logits.float()
    if logits.dim() < 3:  # one head
        logits = logits.unsqueeze(0) if logits.dim() == 2 else logits.view(1, 1, -1)
    row_max = logits.amax(-1)  # [..., H, L]
    live = row_max > -torch.inf
    entropy = torch.special.entr(torch.softmax(logits, -1)).sum(-1)  # entr(0) = 0: masked keys
    heads = entropy.shape[-2]
    total = torch.where(live, entropy, 0.0).movedim(-2, 0).reshape(heads, -1).sum(1)
    count = live.movedim(-2, 0).reshape(heads, -1).sum(1, dtype=torch.float32)
    return HeadEntropy(peak=row_max.amax(), total=total, rows=count)


def looks_like_attention(module: nn.Module) -> bool:
    """Return whether ``module``'s class is named as attention (``GPT2Attention``).

    ``nn.MultiheadAttention`` does not count.

    Args:
        module: the module.

    Returns:
        Whether its class name says attention.
    """
    name = type(module).__name__.lower()
    return not isinstance(module, nn.MultiheadAttention) and ("attention" in name or "attn" in name)


def _softmax_logits(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Return the input of a softmax over the last dimension of a 4-D float tensor, or ``None``."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    last = isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() and dim in (-1, 3)
    return x if last else None


class _Running(NamedTuple):
    """A module whose forward is running, on :class:`AttentionCapture`'s stack."""

    name: str
    module: nn.Module
    caller_live: bool  # whether its caller's own forward was running when it was called


def attention_free(registry: HookRegistry) -> set[int]:
    """Return the ids of the modules of ``registry``'s model that call no attention, whole.

    These are ``torch.nn``'s plain leaf layers (:meth:`~.registry.HookRegistry.plain_layers`) but
    the softmax ones, and each ``nn.Sequential`` (whose forward only calls its children, in order)
    of such modules with no forward hook but ours. Such a module runs outside the capture as one
    call: the layers of a stack of them cost two hooks, not two each.

    Args:
        registry: the registry of the model, which tells plain layers and foreign hooks.

    Returns:
        The ids of those modules.
    """
    free: set[int] = set()
    plain = registry.plain_layers()

    def visit(module: nn.Module) -> bool:
        children = [visit(child) for child in module.children()]  # every one is visited
        if type(module) is nn.Sequential:
            whole = bool(children) and all(children) and registry.only_our_hooks(module)
        else:
            whole = plain(module) and not isinstance(module, _SOFTMAX_LAYERS)
        if whole:
            free.add(id(module))
        return whole

    visit(registry.model)
    return free


class AttentionCapture(SuspendableMode):
    """Captures the attention calls of a model's modules in the training forwards of logging steps.

    A ``TorchFunctionMode``, entered by the outermost module of such a forward: it hands each
    sdpa call's logits (and each 4-D softmax's input, in a module that
    :func:`looks_like_attention`) to ``record(name, logits)``, ``name`` the innermost running
    module not in ``skip``. Not seen: compiled forwards and fused kernels called directly.

    Args:
        record: called with each module's name and a chunk of its logits.
        skip: the names of modules whose calls are not recorded.
    """

    def __init__(self, record: Record, skip: Iterable[str] = ()) -> None:
        super().__init__()
        self._record = record
        self._skip = set(skip)
        self._stack: list[_Running] = []
        self._live = False  # whether the innermost module's own forward is running
        self._callers: list[bool] = []  # between a call's first and last pre-hook: the caller's
        self.seen: set[str] = set()  # the modules whose attention was recorded
        self.guarded_look: Callable[..., None] = (
            self.look
        )  # under the registry's guard once attached

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:  # noqa: ANN401 (torch's __torch_function__ protocol)
        """Pass an attention call to :meth:`look`, then run it unchanged.

        Only this library's part runs under the registry's guard: an error of the call itself
        reaches its caller as it is.

        Args:
            func: the torch function called.
            types: the types of the call's tensor arguments.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.

        Returns:
            What ``func`` returns.
        """
        kwargs = kwargs or {}
        self.guarded_look(func, args, kwargs)
        return func(*args, **kwargs)

    def look(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record the logits of an sdpa call, or of a softmax of an attention module.

        Args:
            func: the torch function called.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.
        """
        if internals.is_compiling():  # a compiled region inside a forward of a logging step
            return
        if func is functional.scaled_dot_product_attention:
            self.see(lambda: sdpa_logit_chunks(*args, **kwargs))
        elif func in _SOFTMAX:
            logits = _softmax_logits(args, kwargs)
            if logits is not None:
                self.see(lambda: logit_chunks(logits), softmax=True)

    def attach(self, registry: HookRegistry) -> AttentionCapture:
        """Hook every module of ``registry``'s model but ``torch.nn``'s plain layers.

        First and last hooks, so that other hooks' calls do not count as the module's.

        Args:
            registry: the registry the hooks go on; its guard wraps :meth:`look`.

        Returns:
            ``self``.
        """
        self.guarded_look = registry.guarded(self.look, "attention capture")
        plain = registry.plain_layers()
        free = attention_free(registry)
        within: set[int] = set()  # inside a module run outside as a whole: no hook needed
        for name, module in registry.model.named_modules():
            if id(module) in within or not registry.hookable(module):
                continue  # torch.jit: runs no Python hook
            if id(module) in free:
                self._run_outside(registry, module)
                within.update(id(m) for m in module.modules() if m is not module)
                continue
            if plain(module):  # a softmax layer: the attention of the module calling it
                continue
            # Gated: installed for logging steps only (see HookRegistry), in this order.
            registry.forward_pre_hook(module, self._push(name), gated=True)
            registry.gated_hook(module, self._enter, pre=True, prepend=True)
            registry.gated_hook(module, self._pause, pre=False, prepend=True, always_call=True)
            registry.gated_hook(module, self._pop, pre=False, always_call=True)
        return self

    def _run_outside(self, registry: HookRegistry, module: nn.Module) -> None:
        """Run ``module``'s logging-step calls outside the mode.

        A layer that calls no attention then costs no Python call of the mode per op, nor the hooks
        on it a pop and push of the mode each (first and last hooks: the other hooks on it run
        outside too).
        """
        registry.gated_hook(module, self.suspend, pre=True, prepend=True)
        registry.gated_hook(module, self.resume, pre=False, always_call=True)

    def _enter(self, *_: object) -> None:
        """Keep a called module's caller's state for :meth:`_push` and pause it."""
        # Compiled (a region's own hooks): the mode sees nothing there, and Dynamo must not
        # read the stack, which may hold the region's ``torch.compile`` wrapper.
        if not internals.is_compiling() and self._stack:
            self._callers.append(self._live)
            self._live = False

    def _pause(self, *_: object) -> None:
        """Mark the innermost module's own forward as not running (its forward hooks run)."""
        if not internals.is_compiling():
            self._live = False

    def _push(self, name: str) -> Callable[[nn.Module, Any], None]:
        """Return the pre-hook that puts module ``name`` on the stack.

        The outermost module enters the mode.
        """

        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if internals.is_compiling():
                return
            if self._stack:
                caller = self._callers.pop()
            elif not is_training_forward(module):
                return
            else:
                caller = False
                self.__enter__()  # type: ignore[no-untyped-call]
            self._stack.append(_Running(name=name, module=module, caller_live=caller))
            self._live = True

        return hook

    def _pop(self, module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        """End ``module``'s call, as a forward hook called always.

        Raises:
            Exception: whatever failed in this library's own check; ``module`` is left first, so
                that the outermost module takes the mode off the stack whatever the guard does.
        """
        try:
            compiling = internals.is_compiling()
        except Exception:
            self._leave(module)
            raise
        if not compiling:
            self._leave(module)

    def _leave(self, module: nn.Module) -> None:
        """Close ``module``'s call: the outermost one exits the mode."""
        if self._stack and self._stack[-1].module is module:
            # a module called from a hook: still in the hook
            self._live = self._stack.pop().caller_live
            if not self._stack:
                self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def unseen(self, model: nn.Module) -> list[str]:
        """Return the modules that look like attention with no call seen.

        A call seen in the module, a submodule or an enclosing module counts, and so does being in
        ``skip``.

        Args:
            model: the model whose modules are looked through.

        Returns:
            The names of those modules (the model is named by its class).
        """
        seen = (*self.seen, *self._skip)

        def related(name: str) -> bool:
            near = (s == name or s.startswith(f"{name}.") or name.startswith(f"{s}.") for s in seen)
            return any(near) if name else bool(seen)

        return [
            name or type(module).__name__
            for name, module in model.named_modules()
            if looks_like_attention(module) and not related(name)
        ]

    def see(self, chunks: Callable[[], Iterable[torch.Tensor]], softmax: bool = False) -> None:
        """Record one attention call's logits, chunk by chunk, for the innermost running module.

        Args:
            chunks: makes the logits' chunks, called only when the call is recorded.
            softmax: the call is a softmax, recorded only in a module that looks like attention.
        """
        if not (self._stack and self._live):
            return
        running = self._stack[-1]
        name = running.name
        if name in self._skip or (softmax and not looks_like_attention(running.module)):
            return
        with torch.no_grad():
            for chunk in chunks():
                self._record(name, chunk)
        self.seen.add(name)
