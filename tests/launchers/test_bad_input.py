"""Bad launch input exits 2 with one clear line before anything starts: --num_processes, hostile
configuration files, out-of-range numbers, a collective timeout the timers cannot hold."""

import pytest

from hasten.commands.main import main as hasten_main


@pytest.mark.parametrize("value", ["-1", "0", "-3"])
def test_num_processes_below_one_exits_2_with_one_clear_line(tmp_path, capsys, value):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert hasten_main(["launch", "--cpu", "--num_processes", value, str(script)]) == 2
    err = capsys.readouterr().err
    assert f"num_processes={value} must be at least 1" in err and "must not run" not in err


# ------------------------------------------------------- issue 28: bounded config and CLI input
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


@pytest.mark.parametrize("text,expected", [
    (LAUGHS, "aliases expand to more than"),
    ("num_processes: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 32 levels"),
    ("distributed_type: &a [*a]\n", "alias refers to the value that contains it"),
], ids=["billion-laughs", "deep", "recursive"])
def test_a_hostile_config_file_exits_2_with_one_line(tmp_path, capsys, text, expected):
    from hasten.config.io import load_config_file
    from hasten.exceptions import ConfigurationError

    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(ConfigurationError, match=expected):
        load_config_file(config)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert hasten_main(["launch", "--config_file", str(config), str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("args,expected", [
    (["--collective_timeout", "inf"], "--collective_timeout=inf must be a number of seconds above 0"),
    (["--collective_timeout", "1e300"], "--collective_timeout=1e+300 must be a number of seconds above 0"),
    (["--collective_timeout", "nan"], "--collective_timeout=nan must be"),
    (["--monitor_interval", "inf"], "--monitor_interval=inf must be"),
    (["--monitor_interval", "0"], "--monitor_interval=0.0 must be"),
    (["--max_restarts", "10000000000"], "--max_restarts=10000000000 must be a number at least 0"),
    (["--num_processes", "100000000000"], "num_processes=100000000000 is more than any run can start"),
])
def test_out_of_range_launch_numbers_exit_2_before_anything_starts(tmp_path, capsys, args, expected):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert hasten_main(["launch", "--cpu", *args, str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


def test_a_worker_refuses_a_collective_timeout_its_timers_cannot_hold():
    from hasten.config.env import collective_timeout

    for raw in ("inf", "1e300", "nan"):
        with pytest.raises(ValueError, match="must be a number of seconds above 0 and at most 30 days"):
            collective_timeout({"HASTEN_COLLECTIVE_TIMEOUT": raw})
    assert collective_timeout({"HASTEN_COLLECTIVE_TIMEOUT": "2.5"}).total_seconds() == 2.5
