"""Runs megatron-core 0.16.1's real schedule, DDP, finalize_model_grads and optimizer on the CPU: to try the
Megatron adapter (and a training loop) on a machine without a GPU, over Gloo.

    from lossguard_capture.megatron_cpu import cuda_on_cpu
    with cuda_on_cpu():                 # around model building and the training loop
        ...

With pipeline parallelism also set ``config.batch_p2p_comm = False`` (the batched p2p path,
``torch.distributed.batch_isend_irecv``, needs NCCL); the 1F1B schedule's send/recv then run over Gloo.

Megatron-core allocates a few tensors on the GPU by name.  Without a GPU (torch built with CUDA, no
driver: ``RuntimeError: Found no NVIDIA driver``) these are the places that fail, in the order a
training step reaches them (megatron-core 0.16.1):

* ``distributed/param_and_grad_buffer.py:803-808`` — DDP's gradient buffer,
  ``torch.zeros(numel, device=torch.cuda.current_device())`` (the first failure: building the DDP
  wrapper);
* ``optimizer/optimizer.py:907`` — ``FP32Optimizer``'s loss scale ``torch.tensor([1.0], device='cuda')``;
* ``pipeline_parallel/schedules.py:596`` and ``:2138`` — ``forward_backward_no_pipelining``'s and
  ``forward_backward_pipelining_without_interleaving``'s
  ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``;
* ``optimizer/clip_grads.py:103`` and ``utils.py:1207`` — the gradient norm's
  ``dummy_overflow_buf`` and ``local_multi_tensor_l2_norm``'s result (``optimizer.step()``).
* with multi-token prediction (``mtp_num_layers``): ``transformer/multi_token_prediction.py:337`` — the
  MTP loss tracker's ``torch.zeros(num_layers, device=torch.cuda.current_device())`` (logging only), and at
  CP > 1 ``:176`` — ``roll_tensor``'s receive buffers for the boundary exchange between CP ranks, and at
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
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
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
