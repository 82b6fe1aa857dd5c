"""Runs megatron-core's real schedule, DDP, finalize_model_grads and optimizer on the CPU (0.15.3, 0.16.0 and
0.16.1 checked): to try the Megatron adapter (and a training loop) on a machine without a GPU, over Gloo.

    from lossguard_capture.megatron_cpu import cuda_on_cpu, import_megatron_core
    import_megatron_core()              # before anything imports megatron (megatron-core 0.15.x needs it)
    with cuda_on_cpu():                 # around model building and the training loop
        ...

With pipeline parallelism also set ``config.batch_p2p_comm = False`` (the batched p2p path,
``torch.distributed.batch_isend_irecv``, needs NCCL); the 1F1B schedule's send/recv then run over Gloo.

Importing megatron-core 0.15.x on a machine without a GPU but with a CUDA toolkit (``/usr/local/cuda``)
fails: ``import megatron.core`` reaches ``inference/unified_memory.py``, which builds a CUDA
unified-memory allocator with ``torch.utils.cpp_extension.load_inline`` at import (lines 64-83 of 0.15.3;
0.16 builds it only when asked), and torch, finding no GPU to take the architecture from, raises an
``IndexError`` in ``_get_cuda_arch_flags`` that 0.15 does not catch (it catches ``RuntimeError``,
``ImportError``, ``OSError`` and warns "Failed to create unified memory mempool").  :func:`no_cuda_build`
(and :func:`import_megatron_core`, which imports ``megatron.core`` inside it) make torch's CUDA builds
fail the way it does without a toolkit, ``OSError: CUDA_HOME environment variable is not set``, before
anything is compiled: 0.15 then warns and goes on without the allocator (inference only; nothing of the
training path uses it).  Without importing this module first, ``TORCH_EXTENSIONS_DIR=/dev/null/x`` in the
environment has the same effect (torch cannot create the build folder: an ``OSError``), for every JIT
extension of the process.

Megatron-core allocates a few tensors on the GPU by name.  Without a GPU (torch built with CUDA, no
driver: ``RuntimeError: Found no NVIDIA driver``) these are the places that fail, in the order a
training step reaches them (megatron-core 0.16.1's lines, identical in 0.16.0; 0.15.3's in brackets where they
differ):

* ``distributed/param_and_grad_buffer.py:803-808`` [722-727] — DDP's gradient buffer,
  ``torch.zeros(numel, device=torch.cuda.current_device())`` (the first failure: building the DDP
  wrapper);
* ``optimizer/optimizer.py:907`` [903] — ``FP32Optimizer``'s loss scale ``torch.tensor([1.0], device='cuda')``;
* ``pipeline_parallel/schedules.py:596`` and ``:2138`` [573, 2114] — ``forward_backward_no_pipelining``'s and
  ``forward_backward_pipelining_without_interleaving``'s
  ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``;
* ``optimizer/clip_grads.py:103`` and ``utils.py:1207`` [1029] — the gradient norm's
  ``dummy_overflow_buf`` and ``local_multi_tensor_l2_norm``'s result (``optimizer.step()``).
* with multi-token prediction (``mtp_num_layers``): ``transformer/multi_token_prediction.py:337`` [225] — the
  MTP loss tracker's ``torch.zeros(num_layers, device=torch.cuda.current_device())`` (logging only), and at
  CP > 1 ``:176`` [149] — ``roll_tensor``'s receive buffers for the boundary exchange between CP ranks, and at
  TP > 1 ``tensor_parallel/mappings.py:91`` — ``_gather_along_last_dim``'s output (the MTP layer's
  all-gather of its tensor-parallel hidden states);
* ``pipeline_parallel/p2p_communication.py:242, 398`` — ``torch.cuda.synchronize()`` around the exchange of
  tensor shapes between pipeline stages with ``config.variable_seq_lengths`` (packed streams of any length,
  as slime trains): a no-op inside the block;
* ``optimizer/clip_grads.py:167`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` when
  clipping: the tests use ``clip_grad=0`` (no clipping; the norm is still computed and returned).

:func:`cuda_on_cpu` puts exactly those tensors on the CPU: ``torch.cuda.current_device()`` returns 0 and
a ``TorchFunctionMode`` rewrites a ``device=`` argument naming CUDA (``"cuda"``, ``"cuda:N"``, an int,
a CUDA ``torch.device``) to ``"cpu"``; every site it rewrote is logged in :data:`HITS` (file:line).
Nothing else changes: the arithmetic, the process groups (Gloo), the all-reduces and every line of
Megatron's code run as they are.  With a GPU none of this is needed.
"""
import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

HITS: set[str] = set()


def _is_cuda(d: Any) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            f = sys._getframe(1)
            name = f.f_code.co_filename
            name = name.split("site-packages/")[-1]
            HITS.add(f"{name}:{f.f_lineno}")
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu(enabled: bool = True) -> Iterator[None]:
    """Within the block, tensors Megatron asks for on the GPU are made on the CPU (module docstring)."""
    if not enabled or torch.cuda.is_available():
        yield
        return
    saved, saved_sync = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        with _CudaOnCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved, saved_sync


@contextlib.contextmanager
def no_cuda_build() -> Iterator[None]:
    """Within the block, on a machine without a GPU, torch's JIT builds of a CUDA extension
    (``torch.utils.cpp_extension.load_inline(..., with_cuda=True)``) raise ``OSError`` (CUDA_HOME is
    not set) before compiling anything; with a GPU it does nothing.  Import megatron-core 0.15.x inside it
    (module docstring): ``with no_cuda_build(): import megatron.core``."""
    if torch.cuda.is_available():
        yield
        return
    import torch.utils.cpp_extension as cpp_extension
    saved = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = None      # read by _join_cuda_home when the build's link flags are made
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = saved


def import_megatron_core() -> ModuleType:
    """``import megatron.core`` inside :func:`no_cuda_build` (call it before anything imports megatron); the
    module.  ImportError when megatron-core is not installed."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    with no_cuda_build():
        return importlib.import_module("megatron.core")
