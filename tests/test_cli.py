"""The command line: help, version, demo."""

import subprocess
import sys

from dropless.cli.main import main


def test_demo_runs(capsys):
    assert (
        main(
            [
                "demo",
                "--tokens",
                "64",
                "--hidden",
                "32",
                "--ffn",
                "16",
                "--experts",
                "5",
                "--top-k",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "pairs computed: 128 of 128, dropped: 0" in out


def test_python_m_dropless_help():
    proc = subprocess.run(
        [sys.executable, "-m", "dropless", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    for cmd in ("train", "generate", "convert", "bench", "demo"):
        assert cmd in proc.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
