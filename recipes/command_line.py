"""The command line before Hydra runs, and Hydra's and OmegaConf's errors, each as the one line the recipe prints:
:func:`command_line_error` (options Hydra does not know, keys or groups given twice ...), :func:`shared_run_dir_error`
(a ``-m`` sweep whose jobs would share a directory), :func:`config_error_line` (an error raised while composing)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optim_factory.config import OPTIM_SCHEMAS, omegaconf_error_line
from optim_factory.errors import first_line
from optim_factory.tree import leaves
from recipes.config import another_optimizers_line, known_keys


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
    - A ``-m`` launcher's required key left unset (:func:`missing_launcher_keys_error`).

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
    return missing_launcher_keys_error(args, conf_dir)


def _optional_groups(conf_dir: str) -> set[str]:
    """The config groups ``train.yaml``'s defaults list leaves empty (``experiment: null``): null or removed, they
    mean "none", as by default."""
    defaults = OmegaConf.to_container(OmegaConf.load(Path(conf_dir) / "train.yaml")).get("defaults", [])
    return {k for d in defaults if isinstance(d, dict) for k, v in d.items() if v is None}


# Hydra's package header: a comment line before the file's first non-comment line
GLOBAL_PACKAGE = re.compile(r"\A(?:#.*\n|\s*\n)*#\s*@package\s+_global_\s*$", re.M)


def keys_set(overrides: list[str], conf_dir: str) -> list[str]:
    """The config keys a launch's command-line ``overrides`` (Hydra's, parsed by Hydra's parser) set, each standing
    for the keys under it too: the key of each override; a group's name where an option of it is chosen
    (``optim=fused_adam_lowmem``), or, for an option of a ``# @package _global_`` group (``experiment=quick``), the
    keys its file sets and the groups its defaults list overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key, value = override.key_or_group, override.value()
        option = Path(conf_dir) / key / f"{value}.yaml"
        if not isinstance(value, str) or not option.is_file() or not GLOBAL_PACKAGE.search(option.read_text()):
            keys.append(key)
            continue
        preset = OmegaConf.to_container(OmegaConf.load(option))
        for entry in preset.pop("defaults", []):
            keys += [k.removeprefix("override ").strip("/") for k in entry] if isinstance(entry, dict) else []
        keys += [".".join(path) for path, _ in leaves(preset, dicts_only=True)]
    return keys


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
                return f"{override}: not a valid override ({first_line(exc)})"
        return f"bad override: {first_line(exc)}"
    ambiguous = re.fullmatch(r"Ambiguous value for argument '(([^=]*)=(.*))'", first_line(exc))
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
        return another_optimizers_line(key, schema) or line
    return first_line(exc)


def missing_launcher_keys_error(args: argparse.Namespace, conf_dir: str) -> str | None:
    """For a ``-m`` sweep (``args``: Hydra's parsed command line): one line naming the keys that the chosen
    launcher's file in ``conf/hydra/launcher/`` marks required (``???``: the partition and account of
    ``slurm.yaml``) and that the composed launcher leaves unset, else None. The file's ``???`` does not make Hydra
    refuse: merged over the plugin's own defaults (``null``) it leaves those, and the launcher would submit (on
    Slurm: ``sbatch``'s multi-line traceback, or a job sent without an account). A command line that does not
    compose here is left to Hydra, which reports it."""
    from hydra import compose, initialize_config_dir

    if not args.multirun or args.config_dir or args.config_name or args.config_path:
        return None
    chosen = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("hydra/launcher=")), None)
    own = Path(conf_dir) / "hydra" / "launcher" / f"{chosen}.yaml"
    if chosen is None or not own.is_file():
        return None
    marked = OmegaConf.load(own)
    required = [key for key in marked if OmegaConf.is_missing(marked, key)]
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            launcher = compose("train", overrides=args.overrides, return_hydra_config=True).hydra.launcher
    except Exception:  # noqa: BLE001  (not this check's to report: Hydra does)
        return None
    unset = [key for key in required if OmegaConf.is_missing(launcher, key) or launcher.get(key) is None]
    if not unset:
        return None
    keys = ", ".join(f"hydra.launcher.{key}" for key in unset)
    return f"hydra/launcher={chosen} requires {keys}: add " + " ".join(f"hydra.launcher.{k}=<{k}>" for k in unset)
