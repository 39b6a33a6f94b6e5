"""`scalerl export RUN_DIR [--step N] OUT`: a run's policy in Hugging Face format
(components/trainer/export.py: config.json, model.safetensors, generation config and the
tokenizer, loadable by transformers and vLLM).
"""

from __future__ import annotations

import argparse
import sys

from components.trainer.export import ExportError, export_policy, resolve_checkpoint

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or one checkpoint directory)")
    parser.add_argument("out", metavar="OUT", help="directory to write config.json, model.safetensors and the tokenizer to")
    parser.add_argument("--step", type=int, default=None, help="export the checkpoint of this step (default: the newest)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def main(args: argparse.Namespace) -> int:
    try:
        checkpoint = resolve_checkpoint(args.run_dir, args.step)
        out = export_policy(checkpoint, args.out, overwrite=args.force)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} -> {out}")
    return 0
