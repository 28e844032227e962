"""hasten.utils.tqdm: one bar on the main process of each machine."""

import io

import pytest

from hasten.state import PartialState
from hasten.utils.tqdm import tqdm


def test_single_process_shows_the_bar():
    PartialState()
    out = io.StringIO()
    bar = tqdm(range(3), file=out, desc="train")
    assert not bar.disable  # (tqdm sets disable when a bar closes, so look before iterating)
    assert list(bar) == [0, 1, 2]
    assert "train" in out.getvalue()
    assert tqdm(range(2), disable=True, file=out).disable


def test_bool_first_argument_is_refused():
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))


@pytest.mark.world_size(2)
def test_only_local_rank_zero_draws(tmp_path):
    state = PartialState()
    out = io.StringIO()
    bar = tqdm(range(4), file=out, desc="epoch")
    assert bar.disable == (state.local_process_index != 0)
    assert list(bar) == [0, 1, 2, 3]  # every rank iterates
    everywhere = tqdm(range(2), main_process_only=False, file=io.StringIO())
    assert not everywhere.disable
    everywhere.close()
    assert ("epoch" in out.getvalue()) == (state.local_process_index == 0)
