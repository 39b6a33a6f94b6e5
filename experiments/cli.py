"""`scalerl` command-line entry point.

Each subcommand lives in the module that owns it; that module exposes
`add_arguments(parser)` and `main(args) -> int`. Modules are imported only when their
subcommand runs, so `scalerl fit` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, add_arguments function, main function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "train": ("experiments.train", "add_arguments", "main", "train one run from a gin recipe"),
    "sweep": ("experiments.sweep_cli", "add_arguments", "main", "launch a one-factor-at-a-time sweep (slurm | local | debug)"),
    "status": ("experiments.status", "add_arguments", "main", "table of the runs of a sweep: state, step, compute, pass rate, fit"),
    "fit": ("analysis.cli", "add_fit_arguments", "fit_main", "fit the sigmoid law to logged runs; table + CSV"),
    "compare": ("analysis.cli", "add_compare_arguments", "compare_main",
                "every pair of configurations of every sweep: interval, paired by seed, verdict"),
    "replay": ("analysis.cli", "add_replay_arguments", "replay_main",
               "replay the adaptive-sweep rule on finished sweeps: compute saved, same best?"),
    "figures": ("paper_figures.cli", "add_figures_arguments", "figures_main", "draw every paper figure whose runs exist"),
    "components": ("experiments.components_cli", "add_arguments", "main", "list every registry, its entries and their parameters"),
    "export": ("experiments.export", "add_arguments", "main", "write a run's policy (final or any checkpoint) in Hugging Face format"),
    "plan": ("experiments.plan", "add_arguments", "main", "memory plan of a config per learner and generator GPU, before submission"),
    "eval": ("experiments.evaluate", "add_arguments", "main", "evaluate a model or run on benchmark files: mean@k and pass@k"),
    "reproduce": ("experiments.reproduce", "add_arguments", "main", "run every paper ablation at a scale, draw the figures, write the report"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalerl",
        description="scalerl-zoo: controlled ablations of RL on LLMs (ScaleRL, arXiv 2510.13786)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, add_fn, _main_fn, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            mod = importlib.import_module(module)
            getattr(mod, add_fn)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        parser = build_parser(only="__none__")
        if command is None:
            parser.print_help()
            return 0 if any(a in ("-h", "--help") for a in argv) else 2
        parser.error(f"unknown command {command!r}; choose from: {', '.join(SUBCOMMANDS)}")
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    module, _add_fn, main_fn, _help = SUBCOMMANDS[command]
    rc = getattr(importlib.import_module(module), main_fn)(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
