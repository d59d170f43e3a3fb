"""`grpokit train | config`: a thin layer over the library."""

from __future__ import annotations

import argparse
import os
import sys

from grpokit.config import ConfigError, describe, load_config


def _train(args) -> int:
    config = load_config(args.config, args.overrides)
    from grpokit import distributed  # heavy imports (torch, transformers) only when training
    from grpokit.trainer import train

    result = train(config, progress=not args.no_progress)
    main = distributed.is_main()
    distributed.finish()
    if not main:
        return 0
    history = result.eval_history
    if history:
        first, last = history[0], history[-1]
        for key in (k for k in first if k.startswith("eval/rewards/") or k == "eval/reward"):
            print(f"held-out greedy {key}: {first[key]:.3f} at step {first['step']} -> "
                  f"{last[key]:.3f} at step {last['step']}")
    print(f"run directory: {result.run_dir}  (metrics.jsonl, config.yaml, final/)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpokit", description="GRPO training for language models")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("train", help="train a model with GRPO")
    p.add_argument("--config", help="YAML config file; the overrides that follow win over it")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="e.g. train.max_steps=50")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_train)

    p = commands.add_parser("config", help="print every config field with its default and meaning")
    p.set_defaults(run=lambda args: print(describe()) or 0)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, FileExistsError) as e:
        if os.environ.get("RANK", "0") == "0":  # every process of a launch fails alike; say it once
            print(f"grpokit: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
