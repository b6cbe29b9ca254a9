"""The recipe's config: schemas of its groups (model, data, checkpoint, trainer) registered in Hydra's ConfigStore,
and the checks and messages around composing them.

The schemas hold every default; the YAML files under ``conf/`` hold only what differs (tested). With the schemas,
an unknown key, a wrongly typed value or a choice outside its Enum fails when Hydra composes the config, before
any work; :func:`config_error_line` turns any such error into the one line the recipe prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optim_factory.config import OPTIM_SCHEMAS, Choice, omegaconf_error_line, schema_keys, unknown_key_line
from optim_factory.config import register_configs as register_optim_configs
from optim_factory.factory import ConfigError


class ModelDtype(Choice):
    """Parameter dtype (``bf16`` pairs with ``optim.master_weights=true``)."""

    fp32 = "fp32"
    bf16 = "bf16"


class DataKind(Choice):
    """``addition``: the embedded synthetic task; ``tokens``: a flat uint16 token file (``data.path``)."""

    addition = "addition"
    tokens = "tokens"


class Device(Choice):
    """``auto``: CUDA when available, else CPU."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class ModelConfig:
    vocab_size: int = 16
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 64
    dtype: ModelDtype = ModelDtype.fp32  # parameter dtype
    tie_embeddings: bool = False


@dataclass
class DataConfig:
    kind: DataKind = DataKind.addition
    seq_len: int = 24
    digits: int = 2  # addition: operands have this many digits
    path: str | None = None  # tokens: flat little-endian uint16 token file
    global_batch_size: int = 32  # sequences per optimizer step over all ranks (each rank takes an equal share)
    seed: int = 1234
    eval_size: int = 256  # held-out examples per evaluation (addition: problems never trained on; tokens: windows)
    holdout_fraction: float = 0.0  # tokens: the file's last fraction, never trained on, evaluated (0: none)


@dataclass
class CheckpointConfig:
    dir: str = "${run_dir}/checkpoints"
    every_steps: int = 250
    keep_last: int = 3  # 0: keep all; deletes only older complete checkpoints
    async_save: bool = False  # dcp.async_save; the previous save is awaited before the next and at exit
    flatten_optimizer_state_dict: bool = True  # StateDictOptions(flatten_optimizer_state_dict=...)
    resume: str = "auto"  # auto (newest complete checkpoint) | never | <path of a step_* directory>
    fallback: bool = False  # resume=auto: if the newest complete checkpoint fails to load, try older ones
    enabled: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    stop_at: int = 0  # >0: stop after this step (checkpointed) as an interrupted job would; schedule follows max_steps
    warmup_steps: int = 30
    grad_clip: float = 1.0  # 0: off
    log_every: int = 25
    eval_every: int = 250  # evaluate the held-out data every N steps and at the end; 0: never
    seed: int = 0
    device: Device = Device.auto
    progress: bool | None = None  # a tqdm bar on rank 0; null: when stderr is a terminal
    threads: int = 0  # torch intra-op threads on CPU; 0: torch's default


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"  # metrics.jsonl, train.log, checkpoints/ (the same run_dir again resumes)
    optim: Any = None  # a schema of optim_factory.config.OPTIM_SCHEMAS, picked by the optim group
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "trainer": TrainerConfig,
}


def register_configs() -> None:
    """Register the recipe's and the optimizer's schemas (call before Hydra composes ``conf/train.yaml``)."""
    register_optim_configs()
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():  # at the root: a schema is not an option of its group
        cs.store(name=f"{group}_schema", node=schema)


# ------------------------------------------------------------------------------------------ checks, messages
def known_keys(optim_schema: type | None = None) -> list[str]:
    """Every valid dotted key of the recipe's config (the optim keys of ``optim_schema``, or of every schema)."""
    schemas = [optim_schema] if optim_schema else list(OPTIM_SCHEMAS.values())
    optim = {k for s in schemas for k in schema_keys(s, "optim.")}
    return schema_keys(TrainConfig) + sorted(optim)


def _unknown_keys(node: Any, prefix: str) -> list[str]:
    if isinstance(node, ListConfig):
        return [k for i, item in enumerate(node) for k in _unknown_keys(item, f"{prefix}[{i}]")]
    if not isinstance(node, DictConfig):
        return []
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    found = []
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        if fields is not None and key not in fields:
            found.append(path)
        else:
            found += _unknown_keys(node[key], path)
    return found


def check_config(cfg: DictConfig) -> None:
    """Refuse a missing value (``???``) and any key not in the schemas, also keys added with Hydra's ``+``.

    Raises:
        ConfigError: one line naming the key (and the nearest valid key).
    """
    missing = OmegaConf.missing_keys(cfg)
    if missing:  # the outermost first: checkpoint.dir (${run_dir}/checkpoints) is missing when run_dir is
        key = min(missing, key=lambda k: (k.count("."), k))
        raise ConfigError(f"{key}: missing value (it has no default; set {key}=...)")
    unknown = _unknown_keys(cfg, "")
    optim_schema = OmegaConf.get_type(cfg.optim) if isinstance(cfg.get("optim"), DictConfig) else None
    if unknown:
        line = _another_optimizers(unknown[0], optim_schema) or unknown_key_line(unknown[0], known_keys(optim_schema))
        raise ConfigError(line)
    name = cfg.optim.get("name") if optim_schema in OPTIM_SCHEMAS.values() else None
    if name in OPTIM_SCHEMAS and OPTIM_SCHEMAS[name] is not optim_schema:  # optim.name=adamw on fused_adam's keys
        raise ConfigError(
            f"optim.name={name}: the optimizer is chosen by its config group (optim={name}); optim.name "
            "follows the group"
        )


def check_run_dir(run_dir: str) -> None:
    """``run_dir`` is a directory, or can be created as one, and is writable: checked without creating anything."""
    if not str(run_dir).strip():  # Path('') is the current directory, and ${run_dir}/checkpoints the root's
        raise ConfigError(f"run_dir={run_dir!r}: empty; expected a directory (e.g. run_dir=runs/my_run)")
    path = Path(run_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise ConfigError(f"run_dir={run_dir!r}: not a directory{where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir={run_dir!r}: {existing} is not writable")


def _is_value(arg: str) -> bool:
    """Whether a command-line argument after a dashed key reads as its value (``1e-3``, ``-1``, ``adamw``)."""
    if "=" in arg:
        return False
    try:
        float(arg)
        return True
    except ValueError:
        return not arg.startswith("-")


def _hydra_args(argv: list[str], *, strict: bool = False) -> tuple[argparse.Namespace, list[str]]:
    """``argv`` read by the parser ``hydra.main`` itself uses (so the options are Hydra's): (options, the rest).
    ``strict``: no abbreviated options, and a misused one raises ``argparse.ArgumentError`` instead of exiting."""
    from hydra._internal.utils import get_args_parser  # hydra.main's own parser; no public accessor in 1.3

    parser = get_args_parser()
    if strict:
        parser.exit_on_error = False  # a misused option of Hydra's (``--cfg`` without a value) raises, not exits
        parser.allow_abbrev = False  # else --experiment=quick passes as an abbreviation of --experimental-rerun
    return parser.parse_known_args(argv)


def command_line_error(argv: list[str], conf_dir: str) -> str | None:
    """One line for what is wrong with the command line before Hydra sees it, else None: what Hydra would refuse
    with its usage over several lines, or accept without a word and not do.

    - An argument that starts with ``-`` but is none of Hydra's own options (``--cfg``, ``-m``, ...: the parser
      ``hydra.main`` itself uses, so the list is Hydra's); a config override written torchtitan's way
      (``--optim.lr=1e-3``, ``--optim.lr 1e-3``) is answered with the override to type instead. A misused option
      of Hydra's (``--cfg`` without a value, a value outside its choices, two of its modes such as ``-m --cfg``).
    - A key or config group given twice (Hydra keeps the last).
    - A schema's name (``optim=fused_adam_schema``) picked as a group's option: answered before Hydra composes,
      with the group's options.

    A malformed override is left to Hydra (:func:`config_error_line` words it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args, unknown = _hydra_args(argv, strict=True)
    except argparse.ArgumentError as exc:
        return f"{exc.argument_name}: {exc.message}"
    modes = {"--run": args.run, "--multirun": args.multirun, "--cfg": args.cfg, "--info": args.info}
    modes["--shell-completion"] = args.shell_completion
    if sum(bool(on) for on in modes.values()) > 1:  # Hydra's rule; it raises a ValueError with a traceback
        return f"{', '.join(m for m, on in modes.items() if on)}: only one of {', '.join(modes)} at a time"
    flag = next((a for a in unknown if a.startswith("-") and a != "-"), None)
    if flag is not None:
        key, eq, value = flag.lstrip("-").partition("=")
        if not eq:
            following = argv[argv.index(flag) + 1 :]
            if following and _is_value(following[0]):
                eq, value = "=", following[0]
        known = key in known_keys() or key.startswith("hydra.") or (Path(conf_dir) / key).is_dir()  # a group
        hint = f"did you mean {key}{eq}{value or '...'}?" if known else "config overrides take no dashes"
        return f"{flag}: not an option (see --help); {hint}"
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        return None
    given: dict[str, str] = {}
    optional = _optional_groups(conf_dir)  # train.yaml read once, not per override
    for override in overrides:
        key = override.key_or_group + (f"@{override.package}" if override.package else "")
        if key in given:
            return (
                f"{key} is given twice ({given[key]}, {override.input_line}): only the last would take effect; "
                "give it once"
            )
        given[key] = override.input_line
        value, group = override.value(), Path(conf_dir) / override.key_or_group
        if group.is_dir() and override.key_or_group not in optional:
            options = ", ".join(sorted(p.stem for p in group.glob("*.yaml")))
            if override.is_delete():  # Hydra accepts it and runs the job with the group's default option
                return f"{override.input_line}: a config group cannot be removed; pick one of its options: {options}"
            if value is None or (isinstance(value, str) and value.endswith("_schema")):  # null: Hydra's traceback
                return f"{override.input_line}: no such option; available: {options}"
    return None


def _optional_groups(conf_dir: str) -> set[str]:
    """The config groups ``train.yaml``'s defaults list leaves empty (``experiment: null``): null or removed, they
    mean "none", as by default."""
    defaults = OmegaConf.to_container(OmegaConf.load(Path(conf_dir) / "train.yaml")).get("defaults", [])
    return {k for d in defaults if isinstance(d, dict) for k, v in d.items() if v is None}


def shared_run_dir_error(argv: list[str], compose: Callable[[list[str]], DictConfig], most: int = 256) -> str | None:
    """For a ``-m`` sweep: one line when two of its jobs would train in the same ``run_dir`` or save in the same
    ``checkpoint.dir`` (the later would resume the earlier's checkpoints, or be refused as a finished run with
    another config; ``keep_last`` would remove the other's), else None.

    The jobs are the overrides' product, as Hydra's basic sweeper makes them; ``compose`` composes one job's
    config (``recipes.train.compose_config``, the project's ``train.yaml``). Not checked: a sweep of more than
    ``most`` jobs, one with another primary config (``-cd``/``-cn``/``-cp``), one with ``${now:...}`` in an
    override (each job resolves it when it starts), and one whose jobs do not compose here (``${hydra:job.num}``,
    a bad override, ``hydra.sweeper.params``): Hydra runs or reports those itself.
    """
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = _hydra_args(argv)[0]
    if not args.multirun or args.config_dir or args.config_name or args.config_path:
        return None
    if any("${now:" in a for a in args.overrides):
        return None
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
        choices = [
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [o.input_line]
            for o in overrides
        ]
        jobs = [list(job) for job in itertools.islice(itertools.product(*choices), most + 1)]
        if len(jobs) > most:
            return None
        configs = [compose(job) for job in jobs]
        places = {key: [str(OmegaConf.select(c, key, throw_on_missing=True)) for c in configs] for key in _PER_JOB}
        saving = [bool(c.checkpoint.enabled) for c in configs]  # a job that saves nothing shares no checkpoint.dir
    except Exception:  # noqa: BLE001  (not this check's to report: Hydra does, or runs the sweep)
        return None
    for key, (what, example) in _PER_JOB.items():
        first: dict[Path, int] = {}
        for num, place in enumerate(places[key]):
            if key == "checkpoint.dir" and not saving[num]:
                continue
            resolved = Path(place).resolve()  # runs/x and ./runs/x are one directory
            if resolved in first:
                other = first[resolved]
                return (
                    f"-m: jobs {other} ({' '.join(jobs[other]) or 'no overrides'}) and {num} ({' '.join(jobs[num])}) "
                    f"would both {what} in {key}={place}, the later resuming the earlier's checkpoints; give each job "
                    f"its own, e.g. '{example}'"
                )
            first[resolved] = num
    return None


# what a sweep's jobs must not share: the key, what a job does there, an override that gives each job its own
_PER_JOB = {
    "run_dir": ("train", "run_dir=runs/sweep/${hydra:job.num}"),
    "checkpoint.dir": ("save", "checkpoint.dir=${run_dir}/checkpoints"),
}


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def config_error_line(exc: BaseException, overrides: list[str] = ()) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config from ``overrides``.

    An unknown config-group option lists the available ones; an unknown key names the nearest valid key; a value
    outside an Enum lists the allowed ones; an unparsable override is named.
    """
    if isinstance(exc, MissingConfigException) and exc.options is not None and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return f"{group}={option}: no such option; available: {', '.join(exc.options)}"
    if isinstance(exc, OverrideParseException):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        for override in overrides:
            try:
                parser.parse_override(override)
            except HydraException:  # the parser raises OverrideParseException or, on a syntax error, HydraException
                return f"{override}: not a valid override ({_first_line(exc)})"
        return f"bad override: {_first_line(exc)}"
    ambiguous = re.fullmatch(r"Ambiguous value for argument '(([^=]*)=(.*))'", _first_line(exc))
    if ambiguous:  # Hydra's next lines say how to read a comma; the one line says it with the user's values
        override, key, value = ambiguous.groups()
        keys, leaf = known_keys(), key.lstrip("+~")
        is_value = leaf in keys and not any(k.startswith(f"{leaf}.") for k in keys)  # not a group (optim=a,b)
        list_hint = f"; a list is written {key}=[{value}]" if is_value else ""
        return f"{override}: a comma makes a sweep (add -m){list_hint}"
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        schema = getattr(cause, "object_type", None)  # the node's schema: an optimizer's names only its keys
        line = omegaconf_error_line(cause, "", known_keys(schema if schema in OPTIM_SCHEMAS.values() else None))
        key = getattr(cause, "full_key", None)
        return _another_optimizers(key, schema) or line
    return _first_line(exc)


def _another_optimizers(key: str | None, schema: type | None) -> str | None:
    """``optim.exp_avg_dtype: not a key of optim=adamw; a key of optim=fused_adam`` when ``key`` is not a key of
    the optimizer schema ``schema`` but another optimizer's (None otherwise)."""
    names = {s: n for n, s in OPTIM_SCHEMAS.items()}
    others = [n for n, s in OPTIM_SCHEMAS.items() if s is not schema and key in schema_keys(s, "optim.")]
    if schema not in names or key in schema_keys(schema, "optim.") or not others:
        return None
    return f"{key}: not a key of optim={names[schema]}; a key of {' and '.join(f'optim={n}' for n in others)}"


LAUNCHES = "launches"  # <run_dir>/launches/: one resolved config per accepted launch


def earlier_launches(run_dir: str) -> list[Path]:
    """The records of the launches accepted so far in ``run_dir`` (:func:`record_config`), oldest first."""
    folder = Path(run_dir) / LAUNCHES
    return sorted(folder.glob("*.yaml")) if folder.is_dir() else []


def record_config(cfg: DictConfig, run_dir: str, argv: list[str]) -> Path:
    """Write the resolved config of an accepted launch to ``<run_dir>/launches/<time>-<pid>[-<n>].yaml``.

    A new file per launch, written only after every check passed: a later launch, rejected or not, never
    overwrites the record of an earlier one, also in the same process and second (``-<n>``: a Hydra sweep's
    jobs, tests).
    """
    import time

    folder = Path(run_dir) / LAUNCHES
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    text = f"# python recipes/train.py {' '.join(argv)}\n" + OmegaConf.to_yaml(cfg)
    n = 0
    while True:
        path = folder / (f"{stem}.yaml" if n == 0 else f"{stem}-{n}.yaml")
        try:
            with open(path, "x") as f:  # created here, never an earlier launch's file
                f.write(text)
            return path
        except FileExistsError:
            n += 1
