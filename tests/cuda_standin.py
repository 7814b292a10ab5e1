"""CPU tensors that say they are on CUDA, for tracing odb's CUDA branches on a machine without a GPU.

torch's fake tensors can claim ``device="cuda"`` in a CPU build of torch 2.13, but carry no values:
odb's one-time checks (the LM head's logits against the model's), the per-group path's sample
bounds and the loss all read values, and they raise there. So this layer keeps real values on the
CPU and reports CUDA: ``with on_cuda():`` every tensor made or moved to ``cuda`` is a
:class:`CudaTensor` (a wrapper subclass around a CPU tensor), so ``tensor.is_cuda`` is True and
every device test in odb and transformers takes its CUDA branch, while the arithmetic runs on the
CPU. An op that mixes a CUDA tensor with a CPU tensor of one or more dimensions raises as CUDA does
("Expected all tensors to be on the same device"), except where torch allows it (indices of
``index`` / ``index_put``, the source of a copy).

It needs the CPU build of torch (a CUDA build initializes the CUDA driver for a "cuda" tensor). What
it cannot do (a CPU build of torch has no CUDA device guard): autograd through these tensors
(backward aborts the process), so traces run forward under ``torch.no_grad()``; CUDA streams,
events, memory statistics and NCCL stay out of reach (``torch.cuda.is_available()`` stays False).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)

# ops whose tensor arguments may lie on the CPU beside CUDA ones, as on a real GPU
_MIXED_OK = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._index_put_impl_.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default,
             torch.ops.aten.lift_fresh.default}


def flash_checks(q, k, v, cu_q, cu_k, where: str, max_q: int, max_k: int, softcap: float = 0.0,
                 dropout: float = 0.0) -> None:
    """What a Flash Attention varlen forward checks of its inputs before it runs (flash-attn's and
    torch's copy of ``csrc/flash_attn/flash_api.cpp``, ``mha_varlen_fwd``), raising as it does."""

    def need(condition: bool, message: str) -> None:
        if not condition:
            raise RuntimeError(f"{where}: {message}")

    if q.is_cuda:  # (the kernel tests on plain CPU tensors run in fp32, to compare to 1e-5)
        need(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    need(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        need(cu.dtype == torch.int32, f"{name} must have dtype int32")
        need(cu.is_contiguous(), f"{name} must be contiguous")
    for tensor in (q, k, v, cu_q, cu_k):  # (CUDA itself where the call runs on CudaTensor: kernel tests run on CPU)
        need(tensor.device == q.device, "Input tensor must be on CUDA device")
    need(all(type(m) is int for m in (max_q, max_k)), f"max_seqlen must be a Python int, got {max_q!r}, {max_k!r}")
    longest = max((b - a for a, b in zip(_unwrap(cu_q).tolist(), _unwrap(cu_q).tolist()[1:])), default=0)
    need(max_q >= longest and max_k >= longest,  # the kernel's grid covers max_seqlen rows: the rest left unwritten
         f"max_seqlen {max_q}, {max_k} below the longest sample's {longest} tokens")
    need(not (softcap > 0 and dropout > 0), "Softcapping does not support dropout for now")
    for tensor in (q, k, v):
        need(tensor.dim() == 3 and tensor.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    total, heads, dim = q.shape
    need(dim <= 256, "FlashAttention forward only supports head dimension at most 256")
    need(heads % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    need(k.shape[0] == v.shape[0] == int(_unwrap(cu_k)[-1]) and total == int(_unwrap(cu_q)[-1]),
         "total tokens must match cu_seqlens")
    need(tuple(k.shape[2:]) == (dim,) and tuple(v.shape[1:]) == (k.shape[1], dim),
         f"key/value must have shape (total_k, num_heads_k, {dim}): got {tuple(k.shape)}, {tuple(v.shape)}")


def flash_reference(q, k, v, cu, scale: float | None, left: int, right: int, softcap: float = 0.0) -> torch.Tensor:
    """What a Flash Attention varlen forward returns, ``[T, H, D]`` in q's dtype: per sample, key j
    visible to query i when ``(left < 0 or j >= i - left) and (right < 0 or j <= i + right)``; query
    head h reads K/V head ``h // (H / H_kv)``; scores ``scale * q.k`` (default ``1/sqrt(D)``), then
    ``softcap * tanh(scores / softcap)`` where softcap > 0; fp32 softmax."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    out = []
    for start, end in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        i = torch.arange(end - start)
        allowed = ((left < 0) | (i[None, :] >= i[:, None] - left)) & ((right < 0) | (i[None, :] <= i[:, None] + right))
        qs = q[start:end].float().transpose(0, 1)
        ks, vs = (t[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        scores = scale * qs @ ks.transpose(1, 2)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append((probs @ vs).transpose(0, 1))
    return torch.cat(out).to(q.dtype) if out else q.new_zeros(q.shape)


class CudaTensor(torch.Tensor):
    """A CPU tensor (``inner``) that reports ``cuda:0``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> CudaTensor:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   device=CUDA, requires_grad=False)
        made.inner = inner
        return made

    def __repr__(self) -> str:
        return f"CudaTensor({self.inner!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Python indexing and conversions take a CUDA device guard in C++: do them on the CPU values
        if func is torch.Tensor.__getitem__:
            return _wrap(args[0].inner[_unwrap(args[1])])
        if func is torch.Tensor.__setitem__:
            args[0].inner[_unwrap(args[1])] = _unwrap(args[2])
            return None
        if func is torch.Tensor.tolist:
            return func(args[0].inner)
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        with torch._C.DisableTorchFunctionSubclass():
            try:
                return func(*args, **kwargs)
            except RuntimeError as error:  # a binding that takes a CUDA device guard (nonzero, ...)
                if "not linked with support for cuda" not in str(error):
                    raise
        _check_devices(func, args, kwargs)
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_devices(func, args, kwargs)
        if func is torch.ops.aten._flash_attention_forward.default:
            return _wrap(_aten_flash_forward(*args, **kwargs))
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point():  # CUDA has integer histc
            return _wrap(func(_unwrap(args[0]).float(), *_unwrap(args[1:]), **_unwrap(kwargs)).to(args[0].dtype))
        custom = _maybe_get_opdef(func)
        if custom is not None:  # a Python custom op (torch's varlen_attn): its own body, on these tensors
            with _DeviceArguments():  # (function modes are off inside dispatch: its factories need one)
                return custom._init_fn(*args, **kwargs)
        device = kwargs.get("device")
        to_cpu = func is torch.ops.aten._to_copy.default and device is not None and torch.device(device).type == "cpu"
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*_unwrap(args), **_unwrap(kwargs))
        return out if to_cpu else _wrap(out)


def _aten_flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                        seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """torch's ``aten::_flash_attention_forward`` (what ``varlen_attn`` calls) on the CPU values:
    its checks, then :func:`flash_reference`; returns its five outputs."""
    flash_checks(query, key, value, cum_seq_q, cum_seq_k, "aten::_flash_attention_forward", max_q, max_k)
    kernel_calls.append({"kernel": "aten::_flash_attention_forward", "q": tuple(query.shape), "v": tuple(value.shape),
                         "dtype": query.dtype, "window": (window_size_left, window_size_right), "causal": is_causal,
                         "scale": scale, "softcap": 0.0, "dropout": dropout_p})
    if dropout_p or seqused_k is not None or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the CUDA stand-in computes no dropout, seqused_k, alibi or paged K/V")
    left = -1 if window_size_left is None else window_size_left
    right = 0 if is_causal else (-1 if window_size_right is None else window_size_right)
    q, k, v, cu = _unwrap((query, key, value, cum_seq_q))
    out = flash_reference(q, k, v, cu, scale, left, right)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)  # (not computed: forward only)
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), torch.empty(0)


kernel_calls: list[dict] = []
"""Every kernel call the stand-ins saw (torch's aten flash forward, :func:`standin`'s), in order."""


def standin(release) -> Callable:
    """A stand-in for one kernel ``release`` (tests/fixtures/kernel_signatures.Release): a function
    with its released header, which binds a call as the release would, checks the inputs as its
    kernel does (:func:`flash_checks`), records the call in :data:`kernel_calls` and returns what
    the release computes (:func:`flash_reference`; dropout recorded, not applied) in its return form."""
    name = release.header.split("(", 1)[0].removeprefix("def ").strip()
    namespace = {"_run": lambda bound: _run_release(release, bound)}
    exec(release.header + "\n    return _run(dict(locals()))", namespace)
    return namespace[name]


def _run_release(release, bound: dict):
    if release.kernel == "torch":
        q, k, v, cu_q, cu_k = (bound[n] for n in ("query", "key", "value", "cu_seq_q", "cu_seq_k"))
        max_q, max_k, scale, softcap, dropout = bound["max_q"], bound["max_k"], bound.get("scale"), 0.0, 0.0
        if "window_size" in bound:
            left, right = bound["window_size"]
            causal = tuple(bound["window_size"]) == (-1, 0)
        else:
            causal = bound["is_causal"]
            left, right = -1, (0 if causal else -1)
        if q.shape[1] != k.shape[1] and not bound.get("enable_gqa"):  # 2.12+ raises; 2.10/2.11 unverified: refused
            raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={q.shape[1]} "
                             f"and Hkv={k.shape[1]}. Try setting enable_gqa=True for GQA.")
    else:
        q, k, v, cu_q, cu_k = (bound[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
        max_q, max_k = bound["max_seqlen_q"], bound["max_seqlen_k"]
        scale, causal = bound["softmax_scale"], bound["causal"]
        left, right = bound.get("window_size", (-1, -1))
        right = 0 if causal else right
        softcap, dropout = bound.get("softcap", 0.0), bound.get("dropout_p", 0.0)
        if "seqused_q" in bound and not (bound["seqused_q"] is None and bound["seqused_k"] is None):
            raise NotImplementedError("the stand-in computes no seqused_q / seqused_k")
    flash_checks(q, k, v, cu_q, cu_k, release.kernel + " " + release.version, max_q, max_k, softcap or 0.0, dropout)
    kernel_calls.append({"kernel": f"{release.kernel} {release.version}", "q": tuple(q.shape), "v": tuple(v.shape),
                         "dtype": q.dtype, "window": (left, right), "causal": causal, "scale": scale,
                         "softcap": softcap, "dropout": dropout})
    values = _unwrap((q, k, v, cu_q))
    out = flash_reference(*values, scale, left, right, softcap)
    out = CudaTensor(out) if isinstance(q, CudaTensor) else out
    return (out, torch.zeros(q.shape[1], q.shape[0])) if release.returns == "(out, lse)" else out


liger_calls: list[dict] = []
"""Every call of :func:`liger_standin`'s loss: its settings and the hidden states' shape."""


def liger_standin(init_header: str) -> type:
    """``LigerFusedLinearCrossEntropyLoss`` with one release's ``__init__`` header: binds odb's
    settings as the release would, records each call in :data:`liger_calls` and computes the fused
    loss's documented result, ``cross_entropy(softcap(_input @ lin_weight.T + bias))`` (fp32 logits)."""
    namespace = {"_keep": lambda bound: bound}
    exec("class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):\n    " + init_header.replace("\n", "\n    ")
         + "\n        super().__init__()\n        self.settings = _keep(dict(locals()))", {**namespace, "torch": torch},
         namespace)
    cls = namespace["LigerFusedLinearCrossEntropyLoss"]

    def forward(self, lin_weight, _input, target, bias=None):
        settings = {k: v for k, v in self.settings.items() if k not in ("self", "__class__")}
        liger_calls.append({"settings": settings, "hidden": tuple(_input.shape), "on_cuda": _input.is_cuda})
        logits = torch.nn.functional.linear(_input, lin_weight, bias).float()
        if settings["softcap"] is not None:
            logits = settings["softcap"] * torch.tanh(logits / settings["softcap"])
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=settings["ignore_index"],
                                                 reduction=settings["reduction"])

    cls.forward = forward
    return cls


def _unwrap(tree):
    return tree_map(lambda t: t.inner if isinstance(t, CudaTensor) else t, tree)


def _wrap(tree):
    return tree_map(lambda t: CudaTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, CudaTensor) else t,
                    tree)


def _check_devices(func, args, kwargs) -> None:
    if func in _MIXED_OK:
        return
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if any(isinstance(t, CudaTensor) for t in tensors):
        cpu = [t for t in tensors if not isinstance(t, CudaTensor) and t.dim() > 0]
        if cpu:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({func}, a CPU tensor of shape {tuple(cpu[0].shape)})")


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class _Factories(TorchDispatchMode):
    """Tensors made or moved to ``cuda`` (factories, ``.to("cuda")``) become :class:`CudaTensor`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")) and not any(isinstance(t, CudaTensor) for t in tree_flatten(args)[0]):
            out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return _wrap(out)
        return func(*args, **kwargs)


class _DeviceArguments(TorchFunctionMode):
    """``module.to("cuda")`` and ``tensor.cuda()`` spell the device outside the dispatcher's view."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0] if isinstance(args[0], CudaTensor) else CudaTensor(args[0].clone())
        # a factory: torch's binding would initialize CUDA first
        if _is_cuda(kwargs.get("device")) and func not in (torch.Tensor.to, torch._C._nn._parse_to):
            return _wrap(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        if func is torch.Tensor.to:  # torch.Tensor.to initializes CUDA for a CUDA device: move by hand
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            if _is_cuda(device):
                tensor = args[0].inner if isinstance(args[0], CudaTensor) else args[0]
                moved = tensor.to(dtype=dtype or tensor.dtype, copy=not isinstance(args[0], CudaTensor))
                return args[0] if moved is tensor and isinstance(args[0], CudaTensor) else CudaTensor(moved)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_cuda(capability: tuple[int, int] = (9, 0)) -> Iterator[torch.device]:
    """Within: tensors made or moved to ``cuda`` are :class:`CudaTensor`; forward only (no autograd);
    ``torch.cuda.get_device_capability`` answers ``capability`` (a Hopper GPU's by default: what
    transformers' grouped experts ask)."""
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # module.to("cuda") swaps in new parameters
    asked = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: capability
    try:
        with torch.no_grad(), _DeviceArguments(), _Factories():
            yield CUDA
    finally:
        torch.cuda.get_device_capability = asked
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
