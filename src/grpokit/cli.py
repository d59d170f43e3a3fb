"""`grpokit train | eval | doctor | report | serve | config`: a thin layer over the library."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from grpokit.config.loading import describe, load_config
from grpokit.config.variants import reset_unused
from grpokit.runtime.errors import ConfigError, RunStopped, StartupError


def _stopped(stop: RunStopped, config) -> int:
    """What a run that stopped says, once, and its exit status."""
    from grpokit.runtime import distributed

    if stop.checkpoint is not None:  # a signal, after a step: every process stopped after the same one, and saved it
        main = distributed.is_main()
        distributed.finish()
        if main:
            print(f"grpokit: {stop}\nresume with: grpokit train --config {stop.checkpoint.parent.parent / 'config.yaml'}",
                  file=sys.stderr)
    elif stop.signum is not None:  # a signal while a step was stuck in the user's code
        if distributed.is_main():
            print(f"grpokit: stopped: {stop}\n{_resume_hint(config)}", file=sys.stderr)
    elif stop.in_users_code or os.environ.get("RANK", "0") == "0":
        # The user's code fails on the process that called it; the rest on every process alike.
        print(f"grpokit: the run stopped: {stop}", file=sys.stderr)
        if not stop.says_what_to_do:
            print(_resume_hint(config), file=sys.stderr)
    return 1 if stop.signum is None else 128 + stop.signum  # 143 SIGTERM, 130 Ctrl-C


def _train(args) -> int:
    config = load_config(args.config, args.overrides)
    if args.merge and not config.model.lora_rank:
        raise ConfigError("--merge merges LoRA adapters into the model, but model.lora_rank=0 trains every weight: "
                          "final/ already holds the whole model")
    from grpokit import api
    from grpokit.runtime import distributed
    from grpokit.runtime.allocator import keep_freed_memory

    keep_freed_memory()  # every step allocates the same tensors again: reuse their pages (allocator.py)
    try:
        result = api.run(config, progress=not args.no_progress)
    except RunStopped as stop:
        return _stopped(stop, config)
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
    if args.merge:
        from grpokit.models.loading import merge_adapter

        print(f"merged model: {merge_adapter(result.run_dir / 'final', config.model.dtype)}")
    print(f"run directory: {result.run_dir}  (metrics.jsonl, config.yaml, checkpoints/, final/)\n"
          f"plots and samples: grpokit report {result.run_dir}; diagnosis: grpokit doctor {result.run_dir}")
    return 0


def _resume_hint(config) -> str:
    """How to go on with the run in config.train.output_dir once the cause is fixed."""
    from grpokit.rundir.checkpoint import latest_checkpoint

    run_dir = Path(config.train.output_dir)
    checkpoint = latest_checkpoint(run_dir)
    command = f"grpokit train --config {run_dir / 'config.yaml'}"
    if checkpoint is None:
        return f"no checkpoint was saved: once the cause is fixed, {command} starts the run again"
    return f"once the cause is fixed, resume from {checkpoint.name} with: {command}"


def _eval(args) -> int:
    overrides = list(args.overrides)
    if args.task:
        overrides.append(f"data.task={args.task}")
    if args.data:
        overrides.append(f"data.path={args.data}")
    config_path = args.config
    model = Path(args.model)
    run_config = next((d / "config.yaml" for d in (model.parent, model.parent.parent) if (d / "config.yaml").is_file()),
                      None)  # final/ or checkpoints/step-N/ of a run
    if config_path is None and run_config is not None:
        # A run's final/ or checkpoint: its own data settings give the same held-out split.
        config_path = run_config
        print(f"using the run's config: {run_config}")
    config = load_config(config_path, overrides, check=False)
    # A run's settings of the variants these overrides switch off (rollout.max_turns after
    # data.task=arithmetic on a calculator run) are read by nothing here: back to their defaults.
    reset_unused(config, keep={o.split("=", 1)[0] for o in overrides})
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples={args.num_samples}: must be >= 1")
    from grpokit import api

    metrics = api.evaluate(config, args.model, args.num_samples, args.output)  # the config checked there
    how = "greedy" if args.num_samples == 1 else f"{args.num_samples} samples per prompt at temperature {config.rollout.temperature}"
    print(f"{args.model}: held-out prompts, {how}")
    for key, value in metrics.items():
        print(f"  {key}: {value:.4f}")
    if args.output:
        print(f"completions: {args.output}")
    return 0


def _config(args) -> int:
    if args.check is None:
        if args.overrides:
            raise ConfigError(f"grpokit config takes overrides with --check only, got {' '.join(args.overrides)}")
        print(describe())
        return 0
    from grpokit.training.preflight import preflight

    # What `grpokit train` checks before it loads a weight (training/preflight.py): a problem is
    # said and exits as the run would (2).
    try:
        config = load_config(args.check, args.overrides)
        checked = preflight(config)
    except StartupError as e:
        print(f"{args.check}: {e}")
        return 2
    for warning in checked.warnings:
        print(f"warning: {warning}")
    seen = ("the data, reward functions, tools and agent" if checked.model_known else
            f"not {config.model.name}'s config or the data, as it is not on this machine yet (a run checks them "
            "once it is fetched)")
    print(f"{args.check}: no problems (the settings against each other, this launch's processes, {seen})")
    if checked.model_known:
        return _memory(config, args.memory)
    if args.memory:
        print(f"--memory: {config.model.name}'s config is not on this machine: its memory cannot be estimated")
        return 1
    return 0


def _memory(config, memory: str | None) -> int:
    """grpokit config --check's estimate of a process's peak memory, and with --memory whether the run
    fits (exit status 1 when it does not)."""
    from grpokit.config.memory import estimate, fits_line, parse_memory
    from grpokit.models.loading import model_config
    from grpokit.runtime.launch import read_launch

    import torch

    launch = read_launch(int(os.environ.get("WORLD_SIZE", "1")))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where a run would train; a GPU named: that GPU
    if memory is not None:
        try:
            size, named = parse_memory(memory)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        device = named or device
    settings = dict(world_size=launch.world_size, sharded=launch.sharding, device=device)
    hf = model_config(config.model.name, local_only=True)
    print(estimate(config, hf, **settings).line())
    if memory is None:
        return 0
    verdict = fits_line(config, hf, size, **settings)
    print(f"this run {verdict}")
    return 0 if verdict.startswith("fits") else 1


def _report(args) -> int:
    from grpokit.rundir.report import report

    page = report(args.run_dir)
    plots = sorted(p.name for p in (args.run_dir / "plots").glob("*.png"))
    print(f"report: {page}\nplots: {args.run_dir / 'plots'} ({', '.join(plots)})")
    return 0


def _serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise StartupError("grpokit serve needs FastAPI and uvicorn: pip install 'grpokit[server]'") from None
    from grpokit.engines.protocols import ENGINES, engine_class
    from grpokit.models.loading import DTYPES
    from grpokit.server import serve
    from grpokit.settings.schema import QUANTIZATIONS

    servable = [name for name in ENGINES if not engine_class(name).remote]  # a server cannot serve a server
    if args.engine not in servable:
        raise ConfigError(f"--engine {args.engine}: must be one of {', '.join(servable)}")
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype {args.dtype}: must be one of {', '.join(DTYPES)}")
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--data-parallel-size", args.data_parallel_size)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
        if value > 1 and args.engine != "vllm":
            raise ConfigError(f"{flag} {value} spreads vLLM over GPUs: it needs --engine vllm (the {args.engine} "
                              "engine runs on one device; start several servers and list them in rollout.server_url)")
    if args.decode_slots is not None and (args.decode_slots < 1 or args.engine != "transformers"):
        raise ConfigError(f"--decode-slots {args.decode_slots}: must be >= 1, with --engine transformers (vLLM "
                          "schedules its own batch)")
    if args.quantization not in QUANTIZATIONS or (args.quantization != "none" and args.engine != "transformers"):
        raise ConfigError(f"--quantization {args.quantization}: must be one of {', '.join(QUANTIZATIONS)}, and other "
                          "than none with --engine transformers alone")
    if args.quantization != "none" and args.dtype == "float64":
        raise ConfigError(f"--quantization {args.quantization} with --dtype float64: bitsandbytes computes in float32, "
                          "bfloat16 or float16")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads {args.threads}: must be >= 1")
        if not os.environ.get("OMP_NUM_THREADS"):
            import torch

            torch.set_num_threads(args.threads)
    if args.engine == "vllm":  # said before any model loads or process starts
        from grpokit.engines.vllm_engine import import_vllm

        import_vllm()
    serve(args.model, args.engine, args.host, args.port, args.dtype, args.tensor_parallel_size, args.data_parallel_size,
          args.decode_slots, args.quantization)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(_parser(), argv)
    try:
        return args.run(args)
    except StartupError as e:  # nothing was trained, nothing was written over
        if os.environ.get("RANK", "0") == "0":  # every process of a launch fails alike; say it once
            print(f"grpokit: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpokit", description="GRPO training for language models")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train(commands)
    _add_eval(commands)
    _add_run_readers(commands)
    _add_serve(commands)
    p = commands.add_parser("config", help="print every config field with its default and meaning; with --check, "
                                           "every problem of a config")
    p.add_argument("--check", metavar="my.yaml", help="what `grpokit train` checks of this config file (with the "
                   "overrides that follow) before it loads a weight: the settings, the data, reward functions, tools, "
                   "agent and teacher, and the URLs it reaches (a warning); exit status 2 at a problem, as train's")
    p.add_argument("--memory", metavar="24GB|H100", help="with --check: whether the run fits this memory per process "
                   "(a size: on the CPU; a GPU's name: on that GPU), and which settings would make it fit")
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    p.set_defaults(run=_config)
    return parser


def _add_train(commands) -> None:
    p = commands.add_parser("train", help="train a model with GRPO")
    p.add_argument("--config", help="YAML config file; the overrides that follow win over it")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="e.g. train.max_steps=50")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--merge", action="store_true",
                   help="with model.lora_rank > 0: also write final/merged, the model with the adapters merged in")
    p.set_defaults(run=_train)


def _add_eval(commands) -> None:
    p = commands.add_parser("eval", help="score a model on held-out prompts (mean rewards, pass@k)")
    p.add_argument("--model", required=True, help="model folder (e.g. runs/.../final), a built-in name, or a Hub id")
    p.add_argument("--task", help="built-in task (data.task)")
    p.add_argument("--data", help="dataset (data.path); its held-out split is data.eval_path or data.eval_size rows")
    p.add_argument("--config", help="YAML config (data, reward functions, rollout lengths); overrides follow")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt: 1 is greedy; k > 1 samples and adds pass@k")
    p.add_argument("--output", help="write every completion with its rewards to this JSONL file")
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    p.set_defaults(run=_eval)


def _add_run_readers(commands) -> None:
    """`doctor` and `report`: what a run folder alone says."""
    p = commands.add_parser(
        "doctor", help="diagnose a run from its folder alone (finished, running or stopped)",
        description="Reads <run_dir>/metrics.jsonl and config.yaml and prints the run's status and "
                    "each problem found, with the evidence and a fix. The checks are those of the live "
                    "alerts; each compares windows of 20 steps (grpokit/rundir/diagnose.py documents them).",
    )
    p.add_argument("run_dir", type=Path)
    p.set_defaults(run=lambda args: print(__import__("grpokit.rundir.diagnose", fromlist=["x"]).doctor(args.run_dir)) or 0)

    p = commands.add_parser(
        "report", help="write <run_dir>/report.html and plots/*.png: curves, alerts, sample completions",
        description="Reads <run_dir>/metrics.jsonl, alerts.jsonl and completions.jsonl and writes one "
                    "self-contained HTML page (plots embedded) and the plots as PNG files. Works on a "
                    "finished, running or stopped run.",
    )
    p.add_argument("run_dir", type=Path)
    p.set_defaults(run=_report)


def _add_serve(commands) -> None:
    p = commands.add_parser(
        "serve", help="run a rollout server for rollout.engine=server (generation, weight sync)",
        description="Loads --model and serves generation over HTTP; a trainer with rollout.engine=server "
                    "and rollout.server_url=http://HOST:PORT sends it prompts and pushes it weights "
                    "(grpokit/server.py documents the endpoints).",
    )
    p.add_argument("--model", required=True, help="the trainer's model.name (built-in name, folder or Hub id)")
    p.add_argument("--engine", default="transformers", help="transformers | vllm")
    p.add_argument("--dtype", default="float32",
                   help="the trainer's model.dtype")
    p.add_argument("--quantization", default="none",
                   help="the trainer's model.quantization: a QLoRA trainer pushes its adapters to this quantized base")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="--engine vllm: GPUs each layer is split over (vLLM's tensor_parallel_size)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="--engine vllm: engine replicas, each on its own --tensor-parallel-size GPUs; a generation's "
                        "prompt groups are split among them, weights pushed to each")
    p.add_argument("--decode-slots", type=int, default=None,
                   help="--engine transformers: the most completions decoded at once; the others wait and take the "
                        "places of those that end (rollout.decode_slots; default: all of a request's)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: every core; beside a trainer on the same machine, a share of them: "
                        "docs/scaling.md). OMP_NUM_THREADS, if set, wins")
    p.set_defaults(run=_serve)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    # Overrides may come on either side of a flag (`train a=1 --merge b=2`): argparse stops a
    # positional list at the first flag, so the rest arrive here.
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


if __name__ == "__main__":
    raise SystemExit(main())
