"""`hybrid-cp plan` command line (hybrid_cp.cli.plan.main)."""

import json
import sys

import pytest

from hybrid_cp.cli.plan import main, parse_bytes, parse_count
from topology import Cluster

ARGS = ["--preset", "dgx-h100", "--nodes", "4", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
        "--hidden", "4096", "--layers", "32", "--seq-len", "1M"]  # fmt: skip


def test_table_and_chosen_plan(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "dgx-h100: 4 node(s) x 8 H100" in out and "seq_len=1048576" in out
    assert "ms/layer" in out and "chosen: ulysses=" in out


def test_json_output(capsys):
    assert main([*ARGS, "--json", "--dp", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["chosen"]["ulysses"], data["chosen"]["ring"], data["chosen"]["dp"]) == (8, 4, 1)


def test_model_preset_and_cluster_file(tmp_path, capsys):
    path = Cluster.preset("dgx-a100", nodes=2).save(tmp_path / "c.yaml")
    assert main(["--cluster", str(path), "--model", "llama3-8b", "--seq-len", "128K", "--top", "3"]) == 0
    assert "model llama3-8b" in capsys.readouterr().out


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plans.png"
    assert main([*ARGS, "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000 and f"plot written to {png}" in capsys.readouterr().out


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([*ARGS, "--plot", str(tmp_path / "x.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--heads", "32", "--head-dim", "128", "--seq-len", "1K"], "exactly one of --preset"),
        (["--preset", "dgx-h100", "--seq-len", "1K"], "--heads and --head-dim"),
        (["--preset", "nope", "--heads", "8", "--head-dim", "64", "--seq-len", "1K"], "unknown preset"),
        (
            ["--preset", "dgx-h100", "--heads", "8", "--head-dim", "64", "--seq-len", "1M", "--memory-budget", "1G"],
            "memory",
        ),
    ],
)
def test_errors_exit_2(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_parsers():
    assert parse_count("1M") == 1 << 20 and parse_count("128k") == 131072 and parse_count("4096") == 4096
    assert parse_bytes("70G") == 70e9 and parse_bytes("64GiB") == 64 * 2**30 and parse_bytes("1e3") == 1e3
    with pytest.raises(SystemExit):
        main(["--preset", "dgx-h100", "--heads", "8", "--head-dim", "64", "--seq-len", "lots"])


def test_hybrid_model_prints_the_linear_share(capsys):
    assert (
        main(
            [
                "--preset",
                "dgx-h100",
                "--nodes",
                "4",
                "--model",
                "qwen3-next-80b",
                "--seq-len",
                "128K",
                "--top",
                "2",
                "--dp",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "linear layers (75% of layers): recurrence" in out and "linear_state_fwd" in out
