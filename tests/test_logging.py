"""hasten.logging.get_logger: main-process-only by default, rank on every record, ordered output on request."""

import logging
import os

import pytest

from hasten.logging import get_logger
from hasten.state import PartialState


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def captured():
    logger = logging.getLogger("hasten-test-logging")
    handler = ListHandler()
    logger.addHandler(handler)
    old_level = logger.level
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_needs_the_state_first(captured):
    logger = get_logger("hasten-test-logging", log_level="INFO")
    with pytest.raises(RuntimeError, match="PartialState"):
        logger.info("too early")


def test_records_carry_rank_and_the_callers_location(captured):
    PartialState()
    logger = get_logger("hasten-test-logging", log_level="INFO")
    logger.info("hello %s", "world")
    logger.log(logging.WARNING, "direct", main_process_only=False)
    logger.warning_once("only once")
    logger.warning_once("only once")
    logger.debug("below the level")
    messages = [r.getMessage() for r in captured.records]
    assert messages == ["hello world", "direct", "only once"]  # no [RANK i] prefix with one process
    for record in captured.records:
        assert record.rank == 0
        assert record.funcName == "test_records_carry_rank_and_the_callers_location"
        assert record.filename == os.path.basename(__file__)


def test_level_from_hasten_log_level(captured, monkeypatch):
    PartialState()
    monkeypatch.setenv("HASTEN_LOG_LEVEL", "debug")
    root_level = logging.getLogger().level
    try:
        logger = get_logger("hasten-test-logging")
        assert logger.logger.level == logging.DEBUG
        logger.debug("now visible")
        assert [r.getMessage() for r in captured.records] == ["now visible"]
        assert get_logger("hasten-test-logging", log_level="ERROR").logger.level == logging.ERROR  # argument wins
    finally:
        logging.getLogger().setLevel(root_level)


def _log_lines(path):
    with open(path) as f:
        return f.read().splitlines()


def _file_logger(path):
    logger = logging.getLogger("hasten-test-ranks")
    handler = logging.FileHandler(path)  # append mode: every rank adds to the same file
    handler.setFormatter(logging.Formatter("%(rank)s|%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return get_logger("hasten-test-ranks", log_level="INFO")


@pytest.mark.world_size(2)
def test_main_process_only_logs_once_and_every_rank_when_asked(tmp_path):
    state = PartialState()
    logger = _file_logger(tmp_path / "log.txt")
    logger.info("once")
    logger.info("everyone", main_process_only=False)
    state.wait_for_everyone()
    if state.is_main_process:
        lines = _log_lines(tmp_path / "log.txt")
        assert lines.count("0|[RANK 0] once") == 1 and len([line for line in lines if "once" in line]) == 1
        assert sorted(line for line in lines if "everyone" in line) == ["0|[RANK 0] everyone", "1|[RANK 1] everyone"]


@pytest.mark.world_size(3)
def test_in_order_prints_in_rank_order(tmp_path):
    import time

    state = PartialState()
    logger = _file_logger(tmp_path / "log.txt")
    # Adversarial skew, not synchronisation: lower ranks arrive later, so only the ordering in the logger
    # can make the lines come out 0, 1, 2.
    time.sleep(0.05 * (state.num_processes - 1 - state.process_index))
    logger.info("step done", main_process_only=False, in_order=True)
    logger.info("main only", in_order=True)  # in_order means nothing without main_process_only=False
    state.wait_for_everyone()
    if state.is_main_process:
        assert _log_lines(tmp_path / "log.txt") == ["0|[RANK 0] step done", "1|[RANK 1] step done",
                                                    "2|[RANK 2] step done", "0|[RANK 0] main only"]
