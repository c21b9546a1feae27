"""``pipecast schedule`` run in-process through ``engine.cli.main``."""
from __future__ import annotations

import json

import pytest

from engine.cli import main
from engine.plan import build_plan
from engine.plan.plotting import Bar, plot_timeline
from engine.plan.simulate import simulate


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_prints_grid_and_bubble(capsys):
    assert main(["schedule", "--pp", "4", "--vp", "2", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    plan = build_plan("interleaved", 4, 8, 2)
    for rank in range(4):
        assert " ".join(plan.action_labels(rank)) in out  # the full per-rank action grid
    sim = simulate(plan, 1.0, 2.0)
    assert f"makespan {sim.makespan:g}, overall bubble {100 * sim.bubble_overall:.1f}%" in out
    assert out.count("bubble ") >= 5  # one per rank and the total
    assert "peak in-flight activations 11" in out  # rank 0: W=10, +1


def test_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    code = main(["schedule", "--pp", "2", "--vp", "2", "--microbatches", "5", "--group-size", "3",
                 "--forward-time", "1", "--backward-time", "2", "--transfer-time", "0.5", "--json", str(out_json),
                 "--plot", str(out_png)])
    assert code == 0
    data = json.loads(out_json.read_text())
    plan = build_plan("interleaved", 2, 5, 2, 3)
    sim = simulate(plan, 1.0, 2.0, 0.5)
    assert data["group_size"] == 3 and data["makespan"] == sim.makespan
    assert [r["actions"] for r in data["ranks"]] == [plan.action_labels(r) for r in range(2)]
    assert data["ranks"][1]["start"] == sim.start[1]
    assert data["ranks"][0]["warmup"] == 5
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out_png.stat().st_size > 10_000
    assert str(out_png) in capsys.readouterr().out


def test_default_schedules(capsys):
    assert main(["schedule", "--pp", "1", "--microbatches", "3"]) == 0
    assert "schedule no_pipelining" in capsys.readouterr().out
    assert main(["schedule", "--pp", "3", "--microbatches", "3", "--forward-only"]) == 0
    out = capsys.readouterr().out
    assert "schedule 1f1b" in out and "(forward-only)" in out and "B0.0" not in out
    assert main(["schedule", "--pp", "2", "--vp", "1", "--schedule", "interleaved", "-m", "4"]) == 0
    assert "schedule interleaved" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--pp", "0"], "argument --pp: 0 must be >= 1"),
    (["--microbatches", "two"], "argument --microbatches/-m: 'two' is not an integer"),
    (["--forward-time", "-1"], "argument --forward-time: -1.0 must be a finite number >= 0"),
    (["--pp", "4", "--vp", "2", "--microbatches", "7"], "num_microbatches=7"),
    (["--pp", "4", "--vp", "2", "--microbatches", "8", "--group-size", "3"], "microbatch_group_size_per_vp_stage=3"),
    (["--pp", "4", "--group-size", "4"], "--group-size 4 only applies to interleaved"),
    (["--pp", "1", "--vp", "2"], "pp_size=1"),
    (["--unknown"], "unrecognized arguments: --unknown"),
])
def test_bad_values_exit_2_with_a_clear_message(argv, message, capsys):
    assert _exit_code(["schedule", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plot_timeline_generic_spans(tmp_path):
    """Measured timelines (the profiler) use the same chart: arbitrary kinds, tuples or Spans, bubbles by rank."""
    rows = [Bar(0, 0.0, 1.0, "a", "F"), (1, 0.5, 2.0, "b", "B"), Bar(1, 2.0, 2.5, "", "comm")]
    path = plot_timeline(rows, tmp_path / "t.png", "measured", bubbles={0: 0.6, 1: 0.0}, time_unit="ms")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no spans"):
        plot_timeline([], tmp_path / "x.png", "empty")
    with pytest.raises(ValueError, match="end >= start"):
        plot_timeline([Bar(0, 2.0, 1.0, "x", "F")], tmp_path / "x.png", "bad")


@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
def test_a_chart_shows_a_legend_entry_only_for_what_it_draws(schedule, tmp_path):
    """Issue 36: ``--plot`` of a split schedule without ``--weight-time`` drew zero-length W bars and a legend entry
    for them, with nothing of that colour in the chart.  No W pixel without W work; with ``--weight-time 1`` the W
    bars and their legend entry are there."""
    import matplotlib.image
    from engine.plan.plotting import KIND_COLOURS

    def pixels(path, kind):
        image = matplotlib.image.imread(path)[..., :3]
        rgb = [int(KIND_COLOURS[kind][i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return int((abs(image - rgb).max(axis=-1) < 0.02).sum())
    for weight, drawn in (("0", False), ("1", True)):
        path = tmp_path / f"{schedule}_{weight}.png"
        assert main(["schedule", "--schedule", schedule, "--pp", "2", "--microbatches", "4", "--weight-time",
                     weight, "--plot", str(path)]) == 0
        assert pixels(path, "F") > 0 and (pixels(path, "W") > 0) == drawn, (schedule, weight)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv,message", [
    (["--pp", "1000000", "--microbatches", "1"], "--pp 1000000 is more than 16384 pipeline ranks"),
    (["--pp", "99999999999999999999"], "--pp 99999999999999999999 is more than 16384"),
    (["--pp", "2", "--vp", "99999999999999999999"], "forwards per step is more than 1048576 (2**20)"),
    (["--pp", "2", "--microbatches", "100000000"], "--microbatches 100000000 = 200000000 forwards per step"),
    (["--pp", "4", "--vp", "100000"], "--vp 100000 x --microbatches 8 = 3200000 forwards"),
    (["--pp", "64", "--microbatches", "2048", "--plot", "x.png"], "is more than 65536 (2**16) bars"),
])
def test_sizes_above_the_limits_exit_2_before_any_work(argv, message, capsys):
    assert _exit_code(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


@pytest.mark.parametrize("option,name", [("--plot", "x.png"), ("--json", "x.json")])
def test_unwritable_output_paths_exit_2_before_any_work(option, name, tmp_path, capsys):
    missing = tmp_path / "no" / "such" / name
    assert _exit_code(["schedule", "--pp", "2", option, str(missing)]) == 2
    captured = capsys.readouterr()
    assert f"{option} {missing}: folder {missing.parent} does not exist" in captured.err
    assert captured.out == ""  # checked before the grid is printed
    assert _exit_code(["schedule", "--pp", "2", option, str(tmp_path)]) == 2
    assert f"{option} {tmp_path}: is a folder" in capsys.readouterr().err


def test_large_plans_print_a_summary_unless_grid_is_given(capsys):
    assert main(["schedule", "--pp", "4", "--microbatches", "200"]) == 0  # 400 actions per rank
    out = capsys.readouterr().out
    assert "action grid and per-rank lines omitted: 4 ranks x 400 actions" in out and "add --grid" in out
    assert "B199.0" not in out and "most bubble:  rank " in out and "overall bubble" in out
    assert main(["schedule", "--pp", "4", "--microbatches", "200", "--grid"]) == 0
    out = capsys.readouterr().out
    plan = build_plan("1f1b", 4, 200)
    rows = [line.split(": ", 1)[1].split() for line in out.splitlines() if line.startswith("rank ") and "(warmup" in line]
    assert rows == [plan.action_labels(rank) for rank in range(4)]
    assert "omitted" not in out and out.count("bubble ") >= 5


def _one_error_line(err: str) -> str:
    """The ``error:`` line of argparse's exit, asserting it is all of ``err`` (one line, no usage block, no
    traceback)."""
    lines = err.splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    return lines[0]


@pytest.mark.parametrize("name,message", [
    ("chart.txt", "'.txt' is not an image format matplotlib writes; end the name in one of"),
    ("chart", "the name has no file suffix"),
])
def test_plot_to_a_suffix_matplotlib_cannot_write_exits_2_before_any_work(name, message, tmp_path, capsys):
    assert _exit_code(["schedule", "--pp", "2", "--plot", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert f"--plot {tmp_path / name}: {message}" in line and ".png" in line, line
    assert captured.out == "" and not (tmp_path / name).exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cells,message", [
    ("0F99999999999999999999,0B99999999999999999999", "0F99999999999999999999 is microbatch 99999999999999999999, "
                                                      "but stage 0 forwards no microbatch 0"),
    ("0F0,0B0,0F99999999999999999999,0B99999999999999999999", "stage 0 forwards no microbatch 1"),
    ("0B0", "no cell forwards stage 0"),
])
def test_csv_with_a_microbatch_number_too_large_for_an_int_exits_2(cells, message, tmp_path, capsys):
    """A microbatch number past int64 (one cell) used to size the plan: OverflowError. Numbers must run 0..M-1."""
    path = tmp_path / "s.csv"
    path.write_text(cells + "\n")
    assert _exit_code(["schedule", "--from-csv", str(path)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--from-csv {path}: " in line and message in line, line


@pytest.mark.parametrize("option,name", [("--json", "p.json"), ("--csv", "p.csv"), ("--plot", "p.png")])
def test_a_full_disk_while_writing_an_output_is_one_error_line(option, name, tmp_path, monkeypatch, capsys):
    """The write itself fails (ENOSPC from the file system, after the folder checks passed): exit 2 naming the
    option, the path and the operating system's reason; no partial file is left."""
    import builtins
    import errno
    import io
    import os
    real_open = builtins.open

    class Full(io.RawIOBase):  # a file on a full disk: opening works, every write fails
        def __init__(self, path):
            self.path = path
            real_open(path, "wb").close()

        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_open(file, mode="r", *args, **kwargs):
        if str(file) == str(tmp_path / name) and "w" in mode:
            raw = Full(file)
            return io.TextIOWrapper(io.BufferedWriter(raw)) if "b" not in mode else io.BufferedWriter(raw)
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)
    assert _exit_code(["schedule", "--pp", "2", option, str(tmp_path / name)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{option} {tmp_path / name}: cannot be written: No space left on device; free space" in line, line
    assert not (tmp_path / name).exists()


def test_cost_aware_builds_the_plan_for_the_given_costs(tmp_path, capsys):
    from engine.plan.pass_costs import PassCosts
    out_json = tmp_path / "plan.json"
    argv = ["schedule", "--schedule", "zb", "--pp", "4", "-m", "8", "--max-in-flight", "8", "--forward-time", "1",
            "--backward-time", "1.2", "--weight-time", "0.5", "--transfer-time", "0.05", "--weight-memory", "0.4",
            "--json", str(out_json)]
    assert main(argv + ["--cost-aware"]) == 0
    out = capsys.readouterr().out
    costs = PassCosts(1.0, 1.2, 0.5, 0.05, 0.4)
    plan = build_plan("zb", 4, 8, max_in_flight=8, costs=costs)
    assert [r["actions"] for r in json.loads(out_json.read_text())["ranks"]] == [plan.action_labels(r)
                                                                                 for r in range(4)]
    assert "the plan is built for these costs (weight_memory 0.4)" in out
    cost_aware = simulate(plan, **costs.simulation()).makespan
    assert main(argv) == 0  # the same limits without --cost-aware: the list scheduler's plan, slower here
    assert json.loads(out_json.read_text())["makespan"] > cost_aware


@pytest.mark.parametrize("argv,message", [
    (["--schedule", "zb_h1", "--cost-aware"], "--cost-aware only applies to zbv / zb"),
    (["--schedule", "1f1b", "--max-pending-w", "3"], "--max-pending-w 3 only applies to zbv / zb"),
    (["--schedule", "zbv", "--pp", "2", "--max-in-flight", "1", "--cost-aware"], "no order fits max_in_flight"),
    (["--schedule", "zb", "--weight-memory", "-1"], "--weight-memory: -1.0 must be a finite number >= 0"),
])
def test_cost_aware_options_are_checked(argv, message, capsys):
    assert _exit_code(["schedule", *argv]) == 2
    assert message in capsys.readouterr().err
