"""The command line: help, version, demo."""

from dropless.cli.main import main
from harness import run_python


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
    proc = run_python(["-m", "dropless", "--help"], timeout=120)
    assert proc.returncode == 0
    for cmd in ("train", "generate", "convert", "bench", "demo"):
        assert cmd in proc.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_help_imports_neither_torch_nor_the_commands():
    """`dropless --help`, `dropless bench --help` and a command's own --help parse
    arguments only: no torch, no transformers, no benchmark module (each costs seconds)."""
    code = (
        "import sys\n"
        "from dropless.cli.main import build_parser\n"
        "for argv in (['--help'], ['bench', '--help'], ['train', '--help'], ['plan', '--help'],\n"
        "             ['convert', '--help'], ['generate', '--help'], ['demo', '--help']):\n"
        "    try:\n"
        "        build_parser().parse_args(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ['torch', 'numpy', 'transformers', 'dropless.bench.layer', 'dropless.bench.e2e',\n"
        "         'dropless.train.config.load', 'dropless.nn']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    proc = run_python(["-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_a_subcommand_gets_its_arguments_when_named():
    from dropless.cli.main import build_parser

    args = build_parser().parse_args(["bench", "jax", "--history", "h.jsonl"])
    assert args.command == "bench" and args.bench == "jax" and args.history == "h.jsonl"
    args = build_parser().parse_args(["demo", "--tokens", "8"])
    assert args.tokens == 8 and args._module == "dropless.cli.demo"
