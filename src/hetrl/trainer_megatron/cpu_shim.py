"""CPU test shim: lets megatron-core run on a machine without CUDA (tests, CPU development).

megatron-core hard-wires CUDA in a few places that have nothing to do with its numerics:
buffers are allocated on ``torch.cuda.current_device()`` (the global memory buffer of the local
attention, the DDP grad buffers, RoPE frequencies) or on ``device='cuda'`` (the optimizers'
found-inf / loss-scale scalars, gradient clipping, dist_checkpointing's exchange tensors); the
RNG tracker of ``tensor_parallel/random.py`` forks and restores the CUDA generator; checkpointing
calls ``torch.cuda.synchronize()``; the mixed-precision and distributed optimizers classify
parameters by ``param.type()`` against ``'torch.cuda.FloatTensor'`` and friends.

On a machine where ``torch.cuda.is_available()`` is False, :func:`apply_cpu_shim_if_needed`
redirects exactly those device requests to the CPU, which then plays CUDA device 0:

* ``torch.cuda.current_device()`` returns 0 and ``torch.cuda.synchronize()`` returns at once;
* a torch-function mode rewrites every CUDA device argument (``device='cuda'``, ``device=0``,
  ``tensor.to('cuda')``, ``tensor.cuda()``) to the CPU and drops ``pin_memory`` requests
  (pinning is a CUDA-host notion); ``tensor.type()`` called from megatron code reports the CUDA
  type name of the dtype (``torch.cuda.BFloat16Tensor`` for a CPU bf16 tensor), so megatron's
  dtype classification sees what it would see on a GPU; calls from anywhere else are untouched;
* the CUDA generator megatron's RNG tracker saves, seeds and restores is the CPU default
  generator (``torch.cuda.get_rng_state``/``manual_seed``/``default_generators``), and the
  tracker's deferred state restore (``torch.cuda._lazy_call``, which without CUDA would queue
  the call forever) runs immediately, so forked RNG streams really fork the CPU stream that CPU
  dropout draws from.

Nothing of megatron's logic is replaced: every function still runs its own code, only the
device it is served by changes. With CUDA present the shim does nothing at all. Entry points
call :func:`apply_cpu_shim_if_needed` once, before building megatron objects; nothing outside
this module touches its internals. Entry points must have a ``__main__`` guard, since
dist_checkpointing's async writer starts processes.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_shim_if_needed"]

_STATE = {"mode": None}


def _is_cuda_device(device) -> bool:
    """True for any spelling of a CUDA device: 'cuda', 'cuda:1', torch.device('cuda'), or an
    int (a bare device index means a CUDA device in torch)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _called_from_megatron() -> bool:
    """Whether the frame calling the intercepted torch function belongs to megatron."""
    caller = sys._getframe(2)  # 0: this function, 1: __torch_function__, 2: the caller
    return caller.f_globals.get("__name__", "").startswith("megatron.")


class _CudaOnCpuMode(TorchFunctionMode):
    """Serve CUDA device requests with the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and _called_from_megatron():
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _cpu_rng_state(device="cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_manual_seed(seed) -> None:
    torch.default_generator.manual_seed(int(seed))


def _run_now(callable_, traceback=None) -> None:
    callable_()


def apply_cpu_shim_if_needed() -> bool:
    """Redirect megatron-core's CUDA device requests to the CPU when CUDA is absent.

    Idempotent. Returns True when the shim is active (applied now or before), False when CUDA
    is available and nothing was changed.
    """
    if torch.cuda.is_available():
        return False
    if _STATE["mode"] is not None:
        return True
    import megatron.core.tensor_parallel.random as mcore_random

    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = _cpu_rng_state
    torch.cuda.manual_seed = torch.cuda.random.manual_seed = _cpu_manual_seed
    torch.cuda.default_generators = (torch.default_generator,)
    mcore_random._lazy_call = _run_now
    mode = _CudaOnCpuMode()
    mode.__enter__()
    _STATE["mode"] = mode
    return True
