"""PartialState semantics on 1 and 2 ranks, debug mode, and the reset used by tests."""

import datetime

import pytest
import torch

from hasten import AcceleratorState, DistributedType, GradientState, PartialState
from hasten.exceptions import DistributedOperationError
from hasten.state import reset_state
from hasten.testing import RankFailed, run_on_ranks
from hasten.utils import gather, gather_object


def test_single_process_defaults():
    state = PartialState()
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.distributed_type == DistributedType.NO and not state.use_distributed
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert state.device == torch.device("cpu")
    assert "Num processes: 1" in repr(state)
    calls = []
    state.on_process(lambda: calls.append("p3"), process_index=3)()  # not distributed: runs everywhere
    state.on_main_process(lambda: calls.append("main"))()
    assert calls == ["p3", "main"]
    with state.main_process_first():
        calls.append("body")
    state.wait_for_everyone()


def test_borg_and_reset():
    a = PartialState()
    b = PartialState()
    a.some_flag = 1
    assert b.some_flag == 1 and a.__dict__ is b.__dict__
    PartialState._reset_state()
    with pytest.raises(AttributeError, match="_reset_state"):
        _ = a.num_processes
    assert PartialState().num_processes == 1


def test_accelerator_state_guard_and_sharing():
    with pytest.raises(ValueError, match="Accelerator"):
        AcceleratorState()
    state = AcceleratorState(mixed_precision="no", _from_accelerator=True)
    assert AcceleratorState().mixed_precision == "no"
    assert AcceleratorState().num_processes == 1  # PartialState's fields read through
    with pytest.raises(ValueError, match="cannot be changed"):
        AcceleratorState(mixed_precision="bf16")
    assert state.initialized
    reset_state()
    assert not AcceleratorState._shared_state and not PartialState._shared_state


def test_gradient_state_defaults():
    gs = GradientState()
    assert gs.sync_gradients and gs.num_steps == 1 and not gs.end_of_dataloader and gs.remainder == -1
    assert GradientState().__dict__ is gs.__dict__


@pytest.mark.world_size(2)
def test_two_ranks_process_control(tmp_path):
    state = PartialState()
    rank = state.process_index
    assert state.distributed_type == DistributedType.MULTI_CPU and state.use_distributed
    assert state.backend == "gloo" and state.is_last_process == (rank == 1)
    ran = []
    state.on_main_process(lambda: ran.append("main"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_process(process_index=1)(lambda: ran.append("p1"))()
    state.on_local_process(local_process_index=0)(lambda: ran.append("l0"))()
    assert ran == (["main", "l0"] if rank == 0 else ["last", "p1"])
    # main_process_first: the main process finishes its block before the others start theirs.
    marker = tmp_path / "main_done"
    with state.main_process_first():
        if rank == 0:
            marker.write_text("x")
        else:
            assert marker.exists()


@pytest.mark.world_size(2, env={"HASTEN_DEBUG_MODE": "1"})
def test_debug_mode_shape_mismatch_raises_on_every_rank():
    state = PartialState()
    assert state.debug
    t = torch.zeros(2, 3) if state.process_index == 0 else torch.zeros(4)
    with pytest.raises(DistributedOperationError) as info:
        gather(t)
    message = str(info.value)
    assert "rank 0: collective #1 `gather` with shape (2, 3)" in message
    assert "rank 1: collective #1 `gather` with shape (4,)" in message
    # Matching shapes still work after the error.
    assert gather(torch.ones(1)).tolist() == [1.0, 1.0]


def _skip_collective_body():
    state = PartialState(timeout=datetime.timedelta(seconds=3))
    if state.process_index == 0:
        gather_object(["only rank 0 calls this"])


def test_debug_mode_names_rank_that_skipped_a_collective(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_on_ranks(_skip_collective_body, world_size=2, tmp_dir=tmp_path, pg_timeout=10, timeout=60,
                     env={"HASTEN_DEBUG_MODE": "1"})
    message = str(info.value)
    assert "--- rank 0 ---" in message and "DistributedOperationError" in message
    assert "collective #1 `gather_object` at " in message and "test_state.py" in message
    assert "but rank(s) 1 did not arrive" in message


def test_debug_off_has_no_extra_collectives():
    from hasten.runtime.debug_checks import debug_checks_enabled

    PartialState()
    assert not debug_checks_enabled()


@pytest.mark.world_size(2, env={"HASTEN_DEBUG_MODE": "1"})
def test_hang_doctor_names_both_operations_and_call_sites():
    state = PartialState(timeout=datetime.timedelta(seconds=20))
    gather(torch.ones(2))  # a matching collective first: it shows up in the history
    with pytest.raises(DistributedOperationError) as info:
        if state.process_index == 0:
            gather(torch.ones(3))
        else:
            state.wait_for_everyone()
    message = str(info.value)
    assert "rank 0: collective #2 `gather` with shape (3,) float32 at " in message
    assert "rank 1: collective #2 `wait_for_everyone` with None at " in message
    assert message.count("test_state.py:") >= 3  # both call sites and the shared history point at this test
    assert "previous collectives" in message and "#1 `gather` with shape (2,)" in message
