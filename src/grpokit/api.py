"""grpokit from Python: `grpokit.train(...)`, and `run(config)` under it, which the CLI calls;
`evaluate(config, model)`, what `grpokit eval` runs.

    import grpokit
    result = grpokit.train(model="smollm2-135m-instruct", dataset=rows, reward_functions=[my_reward],
                           train={"max_steps": 20}, **{"rollout.max_completion_length": 16})
    result.model.generate(...)

What a config file names by text, the API also takes as Python objects: a loaded model and its
tokenizer, a `datasets.Dataset` or a list of dicts, reward functions, tools and an environment
class. The run folder is the one the CLI writes, config.yaml included, so that a run started from
Python can be resumed, evaluated and reported from the command line:
- an in-memory dataset is written to <run>/data/train.jsonl (and eval.jsonl), and data.path names it;
- a function, class or object importable by `module:name` is recorded by that name; any other
  (a closure, a lambda, a callable object, a function of a notebook) is recorded by its own name,
  registered for this process: resuming such a run takes the same objects again, through the API.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from grpokit.config.loading import flatten, load_config, settle
from grpokit.rewards.reward_set import BUILTIN_REWARDS, REWARD_FUNCTIONS
from grpokit.rundir.folder import TrainResult
from grpokit.runtime import user_code
from grpokit.runtime.errors import ConfigError
from grpokit.settings.schema import Config
from grpokit.tasks.dataset import IMAGE_COLUMNS



def train(
    config: str | Path | dict | Config | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    dataset: Any = None,
    eval_dataset: Any = None,
    reward_functions: Any = None,
    tools: Iterable[Callable] | None = None,
    environment: Any = None,
    agent: Any = None,
    progress: bool = True,
    reward_funcs: Any = None,
    train_dataset: Any = None,
    environment_factory: Any = None,
    processing_class: Any = None,
    args: Any = None,
    **overrides,
) -> TrainResult:
    """Train with GRPO; every argument but `config` is optional.

    config: a YAML file, a mapping (of sections or dotted keys, e.g. from_trl's), or a Config.
    model: a name (model.name), or a loaded causal LM (`PreTrainedModel`, trained in place), given
      with its `tokenizer`.
    dataset / eval_dataset: a path (data.path / data.eval_path), a `datasets.Dataset` (of a
      DatasetDict, the train split for `dataset`, the test or validation split for `eval_dataset`),
      or a list of dicts; rows as in a data file.
    reward_functions: a callable with TRL's shape `f(completions, **kwargs) -> list[float | None]`
      (a function, closure, callable object, async function), a name, or a {name: <callable or
      name>, weight: w, **arguments} entry, or a list of them, as reward.functions takes.
    tools: functions the model may call (rollout.tools); environment: a class or factory
      (rollout.environment, TRL's environment_factory); without a dataset, its reset() gives the
      prompts (data.task=environment).
    agent: an `async def agent(client, model, row)` run once per rollout with an openai client on
      the run's own endpoint, returning the rollout's reward (rollout.agent).
    TRL's names (TRL_NAMES; args: a GRPOConfig, through from_trl) are taken too, and a call that
      uses one runs as TRL runs: string prompts as plain text (data.chat_template=false, unless set).
    overrides: config settings, as sections (`train={"max_steps": 5}`) or dotted keys
      (`**{"train.max_steps": 5}`); they win over `config`. A Config given is copied, never changed.
    """
    trl_names = {name: value for name, value in zip(TRL_NAMES, (args, reward_funcs, train_dataset, environment_factory,
                                                               processing_class)) if value is not None}
    config, reward_functions, dataset, environment, tokenizer = (
        _one_of(ours, value, trl_names) for ours, value in zip(TRL_NAMES.values(), (
            config, reward_functions, dataset, environment, tokenizer)))
    config = _config(config, overrides)
    created = _take_objects(config, trl_names, model=model, tokenizer=tokenizer, reward_functions=reward_functions,
                            tools=tools, environment=environment, agent=agent, dataset=dataset,
                            eval_dataset=eval_dataset)
    try:
        return run(config, model=model if not isinstance(model, (str, Path)) else None, tokenizer=tokenizer,
                   progress=progress)
    except BaseException:
        _remove_if_unused(created)
        raise


def _take_objects(config: Config, trl_names: dict, *, model, tokenizer, reward_functions, tools, environment, agent,
                  dataset, eval_dataset) -> Path | None:
    """`config` with the objects of train()'s arguments in it (each recorded by name, and counted
    as given), settled. Returns the run folder when this call created it (for the datasets)."""
    _take_model(config, model, tokenizer)
    _take_code(config, reward_functions, tools, environment, agent)
    if trl_names and "data.chat_template" not in config.given:
        _as_trl_does(config, trl_names)
    created = _take_datasets(config, dataset, eval_dataset)
    config.given |= {key for key, value in (("reward.functions", reward_functions), ("rollout.tools", tools),
                                            ("rollout.environment", environment), ("rollout.agent", agent),
                                            ("data.path", dataset),
                                            ("data.eval_path", eval_dataset)) if value is not None}
    settle(config)
    return created


def _remove_if_unused(created: Path | None) -> None:
    """A refused start leaves no folder behind, as from the CLI: the run folder this call made for
    its datasets (`created`) goes while it holds nothing else."""
    if (created is not None and os.environ.get("RANK", "0") == "0" and created.is_dir()
            and {p.name for p in created.iterdir()} <= {"data"}):
        from grpokit.rundir.folder import release_run_dir

        release_run_dir(created)
        shutil.rmtree(created, ignore_errors=True)


def run(config: Config, *, model=None, tokenizer=None, progress: bool = True) -> TrainResult:
    """Train with `config` as it is (every name in it resolvable; `model` a loaded model, trained in
    place, with its `tokenizer`). It sets config.train.output_dir to the run folder: the CLI's
    entry, which names that folder when a run stops."""
    from grpokit.training.trainer import Trainer

    return Trainer(config, progress=progress, model=model, tokenizer=tokenizer).train()


def evaluate(config: Config, model_path: str, num_samples: int = 1, output: str | None = None) -> dict:
    """`grpokit eval`: score the model in `model_path` on the held-out prompts of `config`'s data,
    greedy (`num_samples` 1) or `num_samples` samples per prompt with pass@k; with `output`, every
    completion with its rewards to that JSONL file. Its metrics."""
    import torch

    from grpokit.engines.batch import SamplingParams
    from grpokit.rewards.reward_set import trainer_state
    from grpokit.runtime import distributed
    from grpokit.sampling.evaluation import score, summarize
    from grpokit.training import setup

    run = setup.build(config, "eval", model_name=model_path)
    for note in run.notes:
        print(note)
    params = SamplingParams.of(config.rollout, greedy=num_samples == 1)
    rewards, examples = run.prepared.rewards, run.prepared.task.eval_examples
    logged = {}
    try:
        with torch.no_grad():
            records = score(run.kind, run.engine, run.tokenizer, rewards, examples, params, num_samples,
                            seed=config.train.seed, logged=logged,
                            state=trainer_state(_steps_trained(Path(model_path), config), config.train.max_steps,
                                                config.updates_per_step))
    finally:
        run.kind.close()
        run.engine.close()
    if output:
        with Path(output).open("w") as f:
            for record in records:
                prompt = examples[record["index"]].prompt
                f.write(json.dumps({"prompt": prompt, **record}, default=str) + "\n")
    return {**summarize(records, rewards.names, num_samples, prefix=""), **distributed.means(logged)}


def _steps_trained(model: Path, config) -> int:
    """The steps of training behind a model folder, for reward functions' trainer_state: a run's
    checkpoints/step-N has N, its final/ the run's train.max_steps, any other model 0."""
    if model.parent.name == "checkpoints" and model.name.startswith("step-") and model.name[5:].isdigit():
        return int(model.name[5:])
    return config.train.max_steps if model.name == "final" and (model.parent / "config.yaml").is_file() else 0


# TRL GRPOTrainer's argument names that grpokit.train takes, and its own name for each, in the
# order train() hands them to _one_of.
TRL_NAMES = {"args": "config", "reward_funcs": "reward_functions", "train_dataset": "dataset",
             "environment_factory": "environment", "processing_class": "tokenizer"}


def _one_of(name: str, value, trl_given: dict):
    """Argument `name` as given by grpokit's name or by TRL's (in `trl_given`); TRL's `args`, a
    GRPOConfig, as from_trl's settings."""
    trl_name = next(k for k, v in TRL_NAMES.items() if v == name)
    if trl_name not in trl_given:
        return value
    if value is not None:
        raise ConfigError(f"{name}= and {trl_name}= (TRL's name for it) are both given: give one")
    return _from_trl_args(trl_given[trl_name]) if trl_name == "args" else trl_given[trl_name]


def _as_list(value) -> list:
    """One entry (a callable, a name, a mapping), as TRL takes a single reward function, or a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _as_trl_does(config: Config, trl_names: dict) -> None:
    """A call with TRL's argument names gets TRL's string prompts: plain text, no chat template."""
    config.data.chat_template = False
    print(f"grpokit: a TRL-shaped call ({', '.join(f'{n}=' for n in trl_names)}): string prompts are sent as plain "
          "text, as TRL does (data.chat_template=false; set data.chat_template=true for the chat template)",
          file=sys.stderr)


def _from_trl_args(args) -> dict:
    """The settings of a TRL GRPOConfig (or a dict of its fields) given as args=, by from_trl; what
    it does not carry is said on stderr, as from_trl lists it."""
    from grpokit.trl_config import from_trl

    settings, not_carried = from_trl(args)
    for item in not_carried:
        print(f"grpokit: args= (TRL GRPOConfig): not carried: {item}", file=sys.stderr)
    return settings


def _config(config, overrides: dict) -> Config:
    """The config of the call, not yet checked: the Trainer checks it once the objects given as
    arguments are in it (a dataset object makes data.path, an environment may be the only reward)."""
    if isinstance(config, Config):  # copied, with the overrides on top; a value away from its default counts as given
        defaults = flatten(Config().to_dict())
        base = copy.deepcopy(config)
        base.given |= {k for k, v in flatten(config.to_dict()).items() if v != defaults.get(k)}
        return load_config(values=overrides, base=base, check=False)
    if isinstance(config, dict):
        return load_config(values={**flatten(config), **flatten(overrides)}, check=False)
    if config is not None and not isinstance(config, (str, Path)):
        raise ConfigError(f"config must be a YAML file's path, a mapping or a grpokit Config, got {type(config).__name__}")
    return load_config(config, values=overrides, check=False)


# ---------------------------------------------------------------- the model


def _take_model(config: Config, model, tokenizer) -> None:
    """model.name (and model.dtype) for `model`; ConfigError for what cannot be used."""
    if model is None:
        return
    if isinstance(model, (str, Path)):
        config.model.name = str(model)
        return
    import torch

    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "generate", None)):
        raise ConfigError(f"model= must be a model name, a folder, or a loaded causal LM (a transformers "
                          f"PreTrainedModel), got {type(model).__name__}")
    if tokenizer is None:
        raise ConfigError(f"model= is a loaded {type(model).__name__} but tokenizer= is missing: pass the tokenizer "
                          "it was trained with (grpokit renders prompts with its chat template)")
    if getattr(model, "hf_device_map", None) or getattr(model, "hf_quantizer", None):
        raise ConfigError(f"model= is a {type(model).__name__} loaded with device_map= or quantized: grpokit places "
                          "the model itself and trains its weights in model.dtype: load it without them (to train "
                          "on a quantized base, pass its name or folder with model.quantization and model.lora_rank)")
    if config.model.quantization != "none":
        raise ConfigError(f"model.quantization={config.model.quantization} quantizes the weights as model.name loads, "
                          f"but model= is a {type(model).__name__} already loaded: pass its name or folder instead")
    from grpokit.models.loading import DTYPES

    dtype = next((name for name, d in DTYPES.items() if d == model.dtype), None)
    if dtype is None:
        raise ConfigError(f"model= holds weights in {model.dtype}; grpokit trains in {', '.join(DTYPES)}")
    if config.model.dtype not in (dtype, type(config.model)().dtype):
        raise ConfigError(f"model.dtype={config.model.dtype} but model= holds {dtype} weights: cast the model "
                          f"(model.to(torch.{config.model.dtype})) or leave model.dtype out")
    config.model.dtype = dtype
    # Where it came from: recorded in config.yaml and the model card (a resumed run loads its own
    # weights from the checkpoint over it).
    name = getattr(model, "name_or_path", "") or getattr(tokenizer, "name_or_path", "")
    if not name and (config.rollout.engine != "transformers" or config.model.lora_rank):
        raise ConfigError(f"model= is a {type(model).__name__} with no name_or_path (the folder or Hub id it was "
                          f"loaded from), and {'model.lora_rank' if config.model.lora_rank else 'rollout.engine=' + config.rollout.engine} "
                          "loads the model by that name: save it (model.save_pretrained(folder), with the tokenizer) "
                          "and pass the folder")
    config.model.name = name or "python-object"


# ---------------------------------------------------------------- reward functions, tools, environments


def _take_code(config: Config, reward_functions, tools, environment, agent=None) -> None:
    """reward.functions, rollout.tools, rollout.environment and rollout.agent for the objects given
    (each recorded by the name `_register` finds for it)."""
    if reward_functions is not None:
        if config.reward.functions is not None:
            raise ConfigError("reward_functions= and reward.functions both name reward functions: give one")
        config.reward.functions = _reward_entries(_as_list(reward_functions))
    if tools is not None:
        if config.rollout.tools is not None:
            raise ConfigError("tools= and rollout.tools both name tools: give one")
        names: set = set()
        config.rollout.tools = [_register(fn, f"tools[{i}]", callable_needed=True, taken=names)
                                for i, fn in enumerate(_as_list(tools))]
    if environment is not None:
        if config.rollout.environment is not None:
            raise ConfigError("environment= and rollout.environment both name an environment: give one")
        if isinstance(environment, dict):
            raise ConfigError(f"environment= is a dict of {len(environment)} environments (TRL's multi-environment "
                              "form, each row choosing one by its `environment` column): grpokit trains one environment "
                              "class per run; give one class (or factory), or train a run per environment")
        if type(environment).__module__.startswith("verifiers."):  # an environment object of verifiers': its task
            config.data.task = "verifiers:" + _register(environment, "environment", callable_needed=False)
            config.given.add("data.task")
        else:
            config.rollout.environment = _register(environment, "environment", callable_needed=True)
    if agent is not None:
        if config.rollout.agent is not None:
            raise ConfigError("agent= and rollout.agent both name an agent: give one")
        config.rollout.agent = _register(agent, "agent", callable_needed=True)


def _reward_entries(functions: list) -> list:
    entries, used = [], set()
    for i, entry in enumerate(functions):
        spec = dict(entry) if isinstance(entry, dict) else {"name": entry}
        if "name" not in spec:
            raise ConfigError(f"reward_functions[{i}]={entry!r}: a mapping needs a 'name' (a callable or a name)")
        if not isinstance(spec["name"], str):
            name = _register(spec["name"], f"reward_functions[{i}]", callable_needed=True, taken=used,
                             registry=REWARD_FUNCTIONS)
            spec["name"] = name
        used.add(spec["name"].rsplit(":", 1)[-1])
        entries.append(spec if set(spec) != {"name"} else spec["name"])
    return entries


def _register(obj, what: str, callable_needed: bool, taken: set = frozenset(), registry: dict | None = None) -> str:
    """The name `obj` is recorded by in the config: `module:name` when importing that gives `obj`
    back, else its own name (made unique among `taken`), registered for this process."""
    if isinstance(obj, str):
        return obj
    if callable_needed and not callable(obj):
        raise ConfigError(f"{what}={obj!r} is not callable: give a function (or a callable object)")
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qualname and module != "__main__" and "." not in qualname and "<" not in qualname:
        try:
            if user_code.find(what, f"{module}:{qualname}") is obj:
                return f"{module}:{qualname}"
        except ConfigError:
            pass
    registry = registry if registry is not None else user_code.OBJECTS
    reserved = BUILTIN_REWARDS if registry is REWARD_FUNCTIONS else {}

    def free(name: str) -> bool:  # not a built-in, nor an object registered by hand
        return (name not in taken and name not in reserved
                and (name not in registry or (id(registry), name) in _REGISTERED or registry[name] is obj))

    base = _own_name(obj)
    name, n = base, 2
    while not free(name):
        name, n = f"{base}_{n}", n + 1
    registry[name] = obj
    _REGISTERED.add((id(registry), name))
    return name


# The names this module registered (a later run may register another object under one of them).
_REGISTERED: set[tuple[int, str]] = set()


def _own_name(obj) -> str:
    if isinstance(obj, functools.partial):
        return _own_name(obj.func)
    name = getattr(obj, "__name__", None) or type(obj).__name__  # a callable object: its class's name
    return "lambda" if name == "<lambda>" else name


# ---------------------------------------------------------------- datasets


# Each dataset argument: its file in <run>/data/ and the setting that names the data.
_DATASETS = {"dataset": ("train.jsonl", "path"), "eval_dataset": ("eval.jsonl", "eval_path")}


def _take_datasets(config: Config, dataset, eval_dataset) -> Path | None:
    """data.path / data.eval_path for datasets given as objects: written to the run folder as JSONL.
    Returns the run folder when this call created it."""
    given = {"dataset": dataset, "eval_dataset": eval_dataset}
    rows = {what: _rows(d, what, config.data.prompt_column) for what, d in given.items() if d is not None}
    for what, d in given.items():
        if isinstance(d, (str, Path)):
            setattr(config.data, _DATASETS[what][1], str(d))
    in_memory = {what: r for what, r in rows.items() if r is not None}
    if not in_memory:
        return None
    if config.train.output_dir is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would stamp its own folder name
            raise ConfigError("a dataset object on several processes needs train.output_dir (the run folder it is "
                              "written to)")
        from grpokit.rundir.folder import default_output_dir

        config.train.output_dir = default_output_dir(config, "dataset")
    run_dir = Path(config.train.output_dir)
    created = None if run_dir.exists() else run_dir
    folder = run_dir / "data"
    pictures = {}  # a row's images: written beside the data as PNG files named by their content

    def picture(image) -> str:
        png = io.BytesIO()
        image.save(png, format="PNG")
        name = f"images/{hashlib.sha1(png.getvalue()).hexdigest()[:16]}.png"
        pictures[name] = png.getvalue()
        return name

    texts = {what: "".join(json.dumps(_with_image_files(row, picture), ensure_ascii=False) + "\n" for row in r)
             for what, r in in_memory.items()}
    for what, text in texts.items():  # every check before anything is written
        path = folder / _DATASETS[what][0]
        if not path.is_file() or path.read_text() == text:
            continue
        if (run_dir / "checkpoints").is_dir():
            raise ConfigError(f"{what} differs from the one the run in {run_dir} was trained on ({path}): resuming it "
                              "would not continue that run; choose another train.output_dir")
        if not (run_dir / "config.yaml").is_file():  # not a run's folder: the file is someone's own
            raise ConfigError(f"{what} would be written to {path}, which holds another file and is not a grpokit run's: "
                              "choose another train.output_dir")
    folder.mkdir(parents=True, exist_ok=True)
    for name, png in pictures.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(png)
    for what, text in texts.items():
        path = folder / _DATASETS[what][0]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        setattr(config.data, _DATASETS[what][1], str(path))
    return created


def _rows(dataset, what: str, prompt_column: str) -> list[dict] | None:
    """The rows of a dataset object (None for a path), each JSON-serializable."""
    if isinstance(dataset, (str, Path)):
        return None
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.DatasetDict):
        wanted = ("train",) if what == "dataset" else ("test", "validation")
        split = next((name for name in wanted if name in dataset), None)
        if split is None:
            raise ConfigError(f"{what} is a DatasetDict with splits {list(dataset)} but no {' or '.join(map(repr, wanted))} "
                              "split: pass one Dataset")
        dataset = dataset[split]
    if datasets is not None and isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ConfigError(f"{what} is a streaming IterableDataset: grpokit reads every row before training (to check "
                          "them and to hold out eval rows); pass a Dataset (dataset.take(n) and Dataset.from_list)")
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        if prompt_column not in dataset.column_names:
            raise ConfigError(f"{what} has no column {prompt_column!r} (data.prompt_column); its columns: "
                              f"{dataset.column_names}")
        dataset = dataset.to_list()
    if not isinstance(dataset, (list, tuple)):
        raise ConfigError(f"{what} must be a path, a datasets.Dataset or a list of dicts, got {type(dataset).__name__}")
    for i, row in enumerate(dataset):
        if not isinstance(row, dict):
            raise ConfigError(f"{what}[{i}] is a {type(row).__name__}, not a dict of columns")
        if prompt_column not in row:
            raise ConfigError(f"{what}[{i}] has no column {prompt_column!r} (data.prompt_column); its columns: {list(row)}")
        try:
            json.dumps({k: v for k, v in row.items() if k not in IMAGE_COLUMNS})  # images: written as files
        except (TypeError, ValueError) as e:
            bad = next((k for k, v in row.items() if k not in IMAGE_COLUMNS and not _serializable(v)), None)
            raise ConfigError(f"{what}[{i}]: column {bad!r} holds a value that cannot be written to the run folder as "
                              f"JSON ({e})") from None
    return list(dataset)


def _with_image_files(row: dict, picture) -> dict:
    """`row` with its images (column image / images, tasks/dataset.py) as file names: a PIL image or
    `datasets`' {"bytes", "path"} is written by picture(image) -> its name relative to the data
    file; a path given in Python is made absolute (it was relative to where Python ran)."""
    from grpokit.tasks.images import open_image

    def one(value):
        if isinstance(value, (str, Path)):
            return str(Path(value).resolve())
        return picture(open_image(value, None, "an image of a dataset given in Python"))

    out = dict(row)
    for column in IMAGE_COLUMNS:
        value = row.get(column)
        if value is not None:
            out[column] = [one(v) for v in value] if isinstance(value, (list, tuple)) else one(value)
    return out


def _serializable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
