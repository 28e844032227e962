"""DDP communication hooks by name: what ``DistributedDataParallelKwargs.register_comm_hook`` installs.

Ground floor: it needs only torch's ``ddp_comm_hooks`` (imported on first use), so the kwargs handler
installs its own hook without reaching up into ``strategies``.
"""

from __future__ import annotations

from typing import Any

from hasten.exceptions import ConfigurationError

#: The hook names of ``DDPCommunicationHookType`` that take a PowerSGD state.
_POWER_SGD = ("power_sgd", "batched_power_sgd")


def install_comm_hook(model: Any, hook: str, wrapper: str = "no", state_option: dict[str, Any] | None = None) -> None:
    """Install the hook named ``hook`` (``no``, ``fp16``, ``bf16``, ``power_sgd``, ``batched_power_sgd``) on a
    DDP ``model``, optionally wrapped by ``wrapper`` (``fp16``/``bf16``).

    Raises:
        ConfigurationError: a wrapper without a hook to wrap.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "no":
        if wrapper != "no":
            raise ConfigurationError(f"DistributedDataParallelKwargs(comm_wrapper={wrapper!r}) needs a "
                                     "comm_hook (power_sgd or batched_power_sgd) to wrap.")
        return
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
             "power_sgd": powerSGD_hook.powerSGD_hook, "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook}
    function: Any = hooks[hook]
    if hook == "bf16" and model.device_type != "cuda":
        function = bf16_compress_hook_any_backend  # torch's own hook refuses anything but CUDA + NCCL
    state: Any = None
    if hook in _POWER_SGD:
        state = powerSGD_hook.PowerSGDState(process_group=None, **(state_option or {}))
    if wrapper == "fp16":
        function = default_hooks.fp16_compress_wrapper(function)
    elif wrapper == "bf16":
        function = default_hooks.bf16_compress_wrapper(function)
    _annotate_hook()
    model.register_comm_hook(state, function)


def bf16_compress_hook_any_backend(process_group: Any, bucket: Any) -> Any:
    """All-reduce gradients in bfloat16 (halving traffic) on any backend, gloo included."""
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: Any) -> Any:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def _annotate_hook() -> None:
    # DDP inspects a hook's annotations and wants the real classes, not this module's postponed strings.
    import torch
    import torch.distributed as dist

    bf16_compress_hook_any_backend.__annotations__ = {
        "process_group": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


__all__ = ["bf16_compress_hook_any_backend", "install_comm_hook"]
