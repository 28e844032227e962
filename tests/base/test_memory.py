"""find_executable_batch_size, release_memory, clear_device_cache."""

import weakref

import pytest
import torch

from hasten.utils.memory import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)

IMPOSSIBLE_BYTES = 2**60  # beyond any address space: malloc refuses at once, nothing is touched


def allocate_or_fail(batch_size, limit=40):
    """A real CPU allocation that fails above ``limit`` (DefaultCPUAllocator: can't allocate memory)."""
    return torch.empty(IMPOSSIBLE_BYTES if batch_size > limit else batch_size, dtype=torch.uint8)


def test_a_real_cpu_allocation_failure_shrinks_the_batch_to_40_or_less():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        return allocate_or_fail(batch_size).numel() * scale

    result = train(2)
    assert tried[-1] <= 40 and result == tried[-1] * 2
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36]  # x0.9 each time, as in Accelerate
    assert tried[:-1] == sorted(tried[:-1], reverse=True) and all(b > 40 for b in tried[:-1])
    tried.clear()
    train(1)
    assert tried == [36]  # the size that worked is remembered


def test_cuda_style_oom_and_reduce_fn_kept_with_decorator_arguments():
    sizes, reductions = [], []

    def halve(batch_size):
        reductions.append(batch_size)
        return batch_size // 2

    @find_executable_batch_size(starting_batch_size=100, reduce_batch_size_fn=halve)
    def step(batch_size):
        sizes.append(batch_size)
        if batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return batch_size

    assert step() == 25
    assert sizes == [100, 50, 25] and reductions == [100, 50]  # Accelerate would ignore `halve` here


def test_reduce_fn_without_arguments_works_as_in_accelerate():
    state = {"size": 64}

    def shrink():
        state["size"] -= 16
        return state["size"]

    def run(batch_size):
        if batch_size > 40:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")  # not memory pressure
        return batch_size

    with pytest.raises(RuntimeError, match="CUDA error"):
        find_executable_batch_size(run, starting_batch_size=64, reduce_batch_size_fn=shrink)()

    def run_oom(batch_size):
        if batch_size > 40:
            raise RuntimeError("HIP out of memory. Tried to allocate 2 GiB")
        return batch_size

    assert find_executable_batch_size(run_oom, starting_batch_size=64, reduce_batch_size_fn=shrink)() == 32


def test_memory_of_the_failed_attempt_is_freed_before_the_retry():
    refs = []

    @find_executable_batch_size(starting_batch_size=8)
    def run(batch_size):
        if refs:
            assert refs[-1]() is None, "the failed attempt's tensor is still alive during the retry"
        activations = torch.zeros(1024, 1024)  # held by this frame, hence by the traceback
        refs.append(weakref.ref(activations))
        if batch_size > 4:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert run() == 4 and len(refs) == 5  # 8, 7, 6, 5 failed; 4 fits


def test_zero_and_user_errors():
    @find_executable_batch_size(starting_batch_size=3)
    def never_fits(batch_size):
        return allocate_or_fail(batch_size, limit=0)

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        never_fits()

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match=r"Call it without: `train\(model=.model.\)`"):
        train(8, "model")
    assert train("model") == 8 and train(model="m") == 8

    @find_executable_batch_size
    def bare(batch_size):
        return batch_size

    assert bare() == 128

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        broken()


@pytest.mark.parametrize("bad, error", [(lambda: 16, ValueError), (lambda: 4.5, TypeError)])
def test_a_reduce_fn_that_does_not_shrink_is_rejected(bad, error):
    @find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=bad)
    def run(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(error, match="reduce_batch_size_fn returned"):
        run()


def test_should_reduce_batch_size_table():
    assert should_reduce_batch_size(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert should_reduce_batch_size(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may ..."))
    assert should_reduce_batch_size(MemoryError())
    assert not should_reduce_batch_size(RuntimeError("shape mismatch"))
    assert not should_reduce_batch_size(ValueError("CUDA out of memory."))
    with pytest.raises(RuntimeError) as info:
        torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8)
    assert should_reduce_batch_size(info.value)


def test_release_memory_and_clear_device_cache():
    model = torch.nn.Linear(2, 2)
    ref = weakref.ref(model)
    model, other = release_memory(model, [1])
    assert model is None and other is None and ref() is None
    clear_device_cache()
    clear_device_cache(garbage_collection=True)
    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        clear_device_cache()
        assert not torch.cuda.is_initialized()  # no CUDA context created on a GPU this process never used
