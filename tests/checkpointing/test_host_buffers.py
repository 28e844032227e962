"""The host buffers of asynchronous saves (``hasten.checkpointing.buffers``, issue 24 item 2).

Ground truths: ``torch.save`` of the original state (the staged copy must serialise to the same
bytes), the original's values at staging time (training changes them in place afterwards), and the
buffers' own addresses (a second save of the same state allocates nothing new).
"""

from __future__ import annotations

import io

import numpy as np
import torch

from hasten.checkpointing.buffers import HostBuffers


def _bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _state() -> dict:
    torch.manual_seed(0)
    flat = torch.randn(64)
    return {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 5), "exp_avg_sq": torch.rand(4, 5)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        "views": [flat[:8], flat[8:24].view(4, 4), flat[24:40].view(4, 4).t()],  # one storage, offsets, strides
        "tied": flat[:8],  # another tensor object over the same storage
        "numpy": np.arange(5),
        "meta": "text",
    }


def _pointers(buffers: HostBuffers) -> set[int]:
    return {storage.data_ptr() for _, storage in buffers._used}


def test_a_staged_copy_serialises_to_the_same_bytes_and_keeps_the_values_of_the_call():
    state = _state()
    expected = _bytes(state)
    buffers = HostBuffers()
    buffers.begin()
    staged = buffers.stage(state)
    buffers.end()
    original = {k: v.clone() for k, v in state["state"][0].items()}
    for tensor in state["state"][0].values():  # training goes on in place
        tensor.add_(1.0)
    state["views"][0].mul_(0.0)
    state["param_groups"][0]["lr"] = 0.5
    assert _bytes(staged) == expected
    assert all(torch.equal(staged["state"][0][k], original[k]) for k in original)
    # the views still share one buffer (torch.save writes one storage for them, as for the original)
    pointers = {t.untyped_storage().data_ptr() for t in [*staged["views"], staged["tied"]]}
    assert len(pointers) == 1 and staged["views"][2].stride() == (1, 4)
    assert staged["state"][0]["exp_avg"].untyped_storage().data_ptr() != state["state"][0]["exp_avg"].data_ptr()


def test_buffers_are_reused_by_the_next_save_and_bounded_by_the_last_one():
    state = _state()
    buffers = HostBuffers()
    buffers.begin()
    first = buffers.stage(state)
    buffers.end()
    held = buffers.nbytes
    assert held == sum(s.untyped_storage().nbytes() for s in [*state["state"][0].values(), state["tied"]])
    pointers = _pointers(buffers)
    del first
    for tensor in state["state"][0].values():
        tensor.add_(1.0)
    expected = _bytes(state)
    buffers.begin()  # the previous save is written: its buffers are reused, nothing new is allocated
    second = buffers.stage(state)
    buffers.end()
    assert _pointers(buffers) == pointers and buffers.nbytes == held
    assert _bytes(second) == expected
    buffers.begin()  # a smaller state: the buffers it does not reuse are freed
    buffers.stage({"step": state["state"][0]["step"]})
    buffers.end()
    assert buffers.nbytes == state["state"][0]["step"].untyped_storage().nbytes()
    buffers.release()
    assert buffers.nbytes == 0


def test_tensors_that_do_not_pickle_like_a_plain_copy_are_deep_copied():
    parameter = torch.nn.Parameter(torch.ones(3))
    state = {"parameter": parameter, "grad": torch.ones(2, requires_grad=True)}
    buffers = HostBuffers()
    buffers.begin()
    staged = buffers.stage(state)
    buffers.end()
    assert buffers.nbytes == 0
    assert type(staged["parameter"]) is torch.nn.Parameter and staged["grad"].requires_grad
    assert _bytes(staged) == _bytes(state)


def test_release_forgets_the_location_tag_of_every_buffer_of_one_size():
    # A CUDA source's buffer is tagged with its device for torch.save; several buffers in use can share one size.
    # Every tag must go with its buffer: a stale one would label an unrelated pinned tensor that later gets the
    # same address (CUDA's host allocator reuses blocks) as "cuda:N" in its file.
    buffers = HostBuffers()
    storages = [torch.empty(16, dtype=torch.uint8).untyped_storage() for _ in range(3)]
    buffers._used = [((16, True), s) for s in storages]
    for s in storages:
        buffers._locations[s.data_ptr()] = "cuda:0"
    buffers.release()
    assert not any(s.data_ptr() in buffers._locations for s in storages)


def _saved_locations(tensor: torch.Tensor) -> list[str]:
    """The location tags ``torch.save`` writes for ``tensor``'s storage (read back without moving it)."""
    seen: list[str] = []

    def record(storage, location):
        seen.append(location)
        return storage

    torch.load(io.BytesIO(_bytes(tensor)), map_location=record, weights_only=True)
    return seen


def test_a_location_tag_applies_only_on_the_thread_writing_the_snapshot_while_it_writes():
    # An asynchronous save tags the pinned copy of a CUDA storage "cuda:N" so that its file equals a synchronous
    # save's. The tag must not leak: a torch.save elsewhere (the training thread, a later synchronous save of a
    # tensor that gets the same host address) writes "cpu" for a CPU tensor. Pinned memory needs CUDA, so a CPU
    # storage stands in for the buffer: the tagger only looks at the address.
    import threading

    from hasten.checkpointing import buffers as buffers_module

    buffers_module._register_tagger()
    buffers = HostBuffers()
    tensor = torch.arange(4.0)
    buffers._locations[tensor.untyped_storage().data_ptr()] = "cuda:0"
    assert _saved_locations(tensor) == ["cpu"]  # no snapshot being written: an ordinary file
    inside: list[list[str]] = []
    elsewhere: list[list[str]] = []
    with buffers.tagging():
        inside.append(_saved_locations(tensor))
        other = threading.Thread(target=lambda: elsewhere.append(_saved_locations(tensor)))
        other.start()
        other.join(timeout=30)
    assert inside == [["cuda:0"]] and elsewhere == [["cpu"]]
    assert _saved_locations(tensor) == ["cpu"]  # after the snapshot's writes: nothing left behind
