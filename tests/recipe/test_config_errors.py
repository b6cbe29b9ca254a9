"""Every config the user types takes effect or is refused in one line.

Through the command line's own entry point (``recipes.train.main``, in this process): a config error is one line
on stderr, exit code 2, before any work, and a rejected run changes nothing on disk. As a process of its own:
tests/recipe/test_train.py (test_cli_unknown_override_and_user_error_are_short).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from optim_factory import ConfigError
from recipes.command_line import command_line_error, shared_run_dir_error
from recipes.job import USER_ERRORS, train
from recipes.launches import record_config
from recipes.preflight import preflight
from recipes.train import compose_config
from tests.recipe.runs import QUICK, ROOT, cli, refused, snapshot

CONF = ROOT / "conf"


# ------------------------------------------------------------------------------- 1: unknown config-group option
@pytest.mark.parametrize(
    "override,line",
    [
        ("experiment=lowmen", "experiment=lowmen: no such option; available: lowmem, quick"),
        ("optim=fused_adamm", "optim=fused_adamm: no such option; available: adamw, fused_adam, fused_adam_lowmem"),
    ],
)
def test_unknown_group_option_is_refused_listing_the_available_ones(override, line, tmp_path):
    run_dir = tmp_path / "run"
    assert refused(cli(override, f"run_dir={run_dir}")) == line
    assert not run_dir.exists()


# ------------------------------------------------------------------------ 2: unknown key, with or without '+'
@pytest.mark.parametrize("plus", ["", "+"])
def test_unknown_key_is_refused_with_or_without_plus_naming_the_nearest_key(plus, tmp_path):
    run_dir = tmp_path / "run"
    line = refused(cli(f"{plus}optim.state_dict_cpu_ofload=true", *QUICK, f"run_dir={run_dir}"))
    assert line == "optim.state_dict_cpu_ofload: not a config key; did you mean optim.state_dict_cpu_offload?"
    assert not run_dir.exists()


def test_unknown_top_level_and_group_keys_added_with_plus_are_refused(tmp_path):
    for override, line in [
        ("+trainer.max_step=3", "trainer.max_step: not a config key; did you mean trainer.max_steps?"),
        ("+rundir=x", "rundir: not a config key; did you mean run_dir?"),
    ]:
        with pytest.raises(ConfigError) as info:
            preflight(compose_config([override, f"run_dir={tmp_path / 'run'}"]))
        assert str(info.value) == line
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------- 3: presets set every key they name
def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_sets_every_key_it_names(preset):
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{preset}.yaml"))
    cfg = compose_config([f"experiment={preset}"])
    group_choices = [d for d in raw.pop("defaults", []) if isinstance(d, dict)]
    leaves = _leaves(raw)
    assert "run_dir" in leaves
    for key, value in leaves.items():
        assert OmegaConf.select(cfg, key) == value, f"experiment={preset}: {key} is {OmegaConf.select(cfg, key)!r}"
    for choice in group_choices:  # e.g. {'override /optim': 'fused_adam_lowmem'}
        ((key, option),) = choice.items()
        group = key.split("/")[-1]
        assert cfg[group] == compose_config([f"{group}={option}"])[group], f"experiment={preset}: {group}"


def test_help_lists_only_what_can_be_chosen():
    """``--help`` lists each group's options: the files under conf/, never the schemas they build on."""
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    listed = {line.split(":")[0]: line.split(": ")[1].split(", ") for line in groups.splitlines() if ": " in line}
    on_disk = {p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in (ROOT / "conf").iterdir() if p.is_dir()}
    assert listed == {g: files for g, files in on_disk.items() if g != "hydra"}, groups


def test_help_names_the_presets_and_the_docs():
    """``--help`` starts with the usage, each preset (every option of conf/experiment/) and where the docs are."""
    proc = cli("--help")
    header = proc.stdout.split("== Configuration groups ==")[0]
    assert header.startswith("python recipes/train.py [group=option ...] [key=value ...]\n"), header
    presets = sorted(f"experiment={p.stem}" for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert presets and all(f"  {p} " in header for p in presets), header
    assert "docs/recipe.md" in header and "docs/recipe.md" in proc.stdout.strip().splitlines()[-1], proc.stdout


def test_cfg_job_shows_the_presets_run_dir():
    proc = cli("experiment=lowmem", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = OmegaConf.create(proc.stdout)
    assert shown.run_dir == "runs/lowmem" and shown.model.dtype == "bf16" and shown.optim.exp_avg_dtype == "bf16"


# ---------------------------------------------------------------------- 5: a rejected run changes nothing
def test_a_rejected_run_changes_nothing_on_disk(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config([*QUICK, "trainer.max_steps=2", "trainer.progress=false", f"run_dir={run_dir}"]))
    before = snapshot(run_dir)
    # refused by Hydra's composition, and by the recipe's own checks (optimizer, data): nothing changes
    for bad in ["optim.exp_avg_dtype=fp64", "data.seq_len=100"]:
        refused(cli(*QUICK, "trainer.max_steps=2", f"run_dir={run_dir}", bad))
        assert snapshot(run_dir) == before, bad
    (record,) = (run_dir / "launches").iterdir()  # the accepted launch's resolved config, kept
    assert OmegaConf.load(record).optim.exp_avg_dtype == "fp32" and OmegaConf.load(record).run_dir == str(run_dir)
    assert not (run_dir / ".hydra").exists()
    fresh = tmp_path / "fresh"
    refused(cli(*QUICK, f"run_dir={fresh}", "optim.lr=-1"))
    assert not fresh.exists() and not (ROOT / "train.log").exists()


# ------------------------------------------------------------------- 11: every config error is one line, exit 2
@pytest.mark.parametrize(
    "args,line",
    [
        (["optim.exp_avg_dtype=fp64"], "optim.exp_avg_dtype='fp64': expected one of fp32|fp16|bf16|fp8"),
        (["optim.lr=fast"], "optim.lr='fast': Value 'fast' of type 'str' could not be converted to Float"),
        (["optim.lr=["], "optim.lr=[: not a valid override"),
        (
            ["optim.betas=0.9,0.95"],
            "optim.betas=0.9,0.95: a comma makes a sweep (add -m); a list is written optim.betas=[0.9,0.95]",
        ),  # not Hydra's first line: 'Ambiguous value for argument ...
        (["run_dir=???"], "run_dir: missing value (it has no default; set run_dir=...)"),
        (["checkpoint.every_steps=0"], "checkpoint.every_steps=0: must be >= 1"),
        (["checkpoint.write_threads=-1"], "checkpoint.write_threads=-1: must be >= 0 (0: automatic)"),
        (["optim.use_decoupled_grad=true"], "optim.use_decoupled_grad=true: FusedAdam would read"),
        (["checkpoint.write_in_process=true"], "checkpoint.write_in_process=true: writes async saves; set checkpoint"),
    ],
    ids=[
        "enum",
        "type",
        "syntax",
        "comma",
        "missing",
        "checkpoint",
        "write-threads",
        "decoupled-grad",
        "process-sync",
    ],
)
def test_every_config_error_is_one_line_with_exit_code_2(args, line, tmp_path):
    run_dir = [] if args[0].startswith("run_dir=") else [f"run_dir={tmp_path / 'run'}"]
    assert refused(cli(*args, *run_dir)).startswith(line)
    assert not (tmp_path / "run").exists() and not (ROOT / "???").exists()


@pytest.mark.parametrize(
    "given,unset",
    [
        ([], ["partition", "account"]),
        (["hydra.launcher.partition=debug"], ["account"]),
    ],
    ids=["neither", "no-account"],
)
def test_a_slurm_sweep_without_the_keys_its_launcher_marks_required_is_refused_before_submitting(
    given, unset, tmp_path
):
    """conf/hydra/launcher/slurm.yaml marks partition and account ``???``; Hydra merges them over the plugin's
    ``null`` and would submit. Refused in one line naming the overrides to add, exit 2, before any submission."""
    keys = ", ".join(f"hydra.launcher.{k}" for k in unset)
    add = " ".join(f"hydra.launcher.{k}=<{k}>" for k in unset)
    line = refused(cli("-m", "hydra/launcher=slurm", *given, *QUICK, f"run_dir={tmp_path / 'run'}"))
    assert line == f"hydra/launcher=slurm requires {keys}: add {add}", line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides,line",
    [
        (  # accepted, it would train without updating a weight (the loss stays where it starts, accuracy 0)
            ["optim.use_decoupled_grad=true"],
            "optim.use_decoupled_grad=true: FusedAdam would read param.decoupled_grad, which this recipe's loop never "
            "sets (it sets .grad): no parameter would be updated",
        ),
        (  # accepted, the run goes to max_steps without a word
            ["trainer.max_steps=20", "trainer.stop_at=100"],
            "trainer.stop_at=100: must be between 0 (off) and trainer.max_steps=20",
        ),
        (  # accepted, the run trains on the addition task, the file never opened
            ["data.path=/nonexistent/file.bin"],
            "data.path='/nonexistent/file.bin': only for data=tokens (add data=tokens to train on the file)",
        ),
        (["data=tokens", "data.digits=3"], "data.digits=3: only for the addition task (data=addition)"),
    ],
    ids=["decoupled-grad", "stop-at", "path-without-tokens", "digits-with-tokens"],
)
def test_a_key_that_would_have_no_effect_is_refused(overrides, line, tmp_path):
    with pytest.raises(USER_ERRORS) as info:  # ConfigError, DataError: each one line, exit 2 from the command line
        preflight(compose_config([*QUICK, *overrides, f"run_dir={tmp_path / 'run'}"]))
    assert str(info.value) == line
    assert not (tmp_path / "run").exists()


FLAG = "not an option (see --help)"


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--optim.lr=1e-3"], f"--optim.lr=1e-3: {FLAG}; did you mean optim.lr=1e-3?"),
        (["--optim.lr", "1e-3"], f"--optim.lr: {FLAG}; did you mean optim.lr=1e-3?"),
        (["-m", "--lr=3"], f"--lr=3: {FLAG}; config overrides take no dashes"),
        (["--experiment=quick"], f"--experiment=quick: {FLAG}; did you mean experiment=quick?"),  # no abbreviation
        (["--optim.lr", "-1e-3"], f"--optim.lr: {FLAG}; did you mean optim.lr=-1e-3?"),
        (["--cfg"], "--cfg/-c: expected one argument"),
        (["--cfg", "jb"], "--cfg/-c: invalid choice: 'jb' (choose from 'job', 'hydra', 'all')"),
        (
            ["-m", "--cfg", "job"],
            "--multirun, --cfg: only one of --run, --multirun, --cfg, --info, --shell-completion at a time",
        ),
        (
            ["optim.lr=1e-3", "model=tiny", "optim.lr=2e-3"],
            "optim.lr is given twice (optim.lr=1e-3, optim.lr=2e-3): only the last would take effect; give it once",
        ),
        (
            ["experiment=lowmem", "+experiment=quick"],
            "experiment is given twice (experiment=lowmem, "
            "+experiment=quick): only the last would take effect; give it once",
        ),
        (
            ["optim=fused_adam_schema"],
            "optim=fused_adam_schema: no such option; available: adamw, fused_adam, fused_adam_lowmem",
        ),
        (
            [
                "--cfg",
                "job",
                "experiment=[lowmem,quick]",
                "+trainer.x=1",
                "optim@o=adamw",
                "optim=adamw",
            ],
            None,
        ),
        (["~experiment", "model=small"], None),  # an optional group (train.yaml: experiment: null) may go
        (["~model"], "~model: a config group cannot be removed; pick one of its options: small, tiny"),  # else ignored
        (["model=null"], "model=null: no such option; available: small, tiny"),  # not Hydra's traceback
        (["-m", "optim.lr=1e-3,2e-3", "model=tiny,small", "optim.lr=[", "optim.lr=["], None),  # syntax: Hydra's
    ],
    ids=[
        "dashed-override",
        "dashed-key-then-value",
        "unknown-flag",
        "dashed-group",
        "dashed-key-then-negative-value",
        "hydra-flag-without-value",
        "bad-choice",
        "two-modes",
        "key-twice",
        "group-twice",
        "schema-option",
        "ok",
        "optional-group-removed",
        "group-removed",
        "group-null",
        "ok-sweep",
    ],
)
def test_a_command_line_hydra_would_take_silently_or_in_many_lines_is_one_line(argv, line):
    """Hydra refuses an unknown flag with 8 lines of usage and two modes with a traceback, and keeps the last of
    a key given twice without a word: the recipe says which argument and what to type instead."""
    assert command_line_error(argv, str(CONF)) == line


@pytest.mark.parametrize(
    "argv,shared",
    [
        (
            ["-m", "experiment=quick", "optim.lr=1e-3,3e-3", "run_dir=/r"],
            "jobs 0 (experiment=quick optim.lr=0.001 "
            "run_dir=/r) and 1 (experiment=quick optim.lr=0.003 run_dir=/r) would both train in run_dir=/r",
        ),
        (
            ["-m", "trainer.max_steps=range(10,30,10)"],
            "jobs 0 (trainer.max_steps=10) and 1 (trainer.max_steps=20) would both train in run_dir=runs/default",
        ),
        (["-m", "experiment=quick,lowmem"], None),  # runs/quick, runs/lowmem
        (["-m", "optim.lr=1e-3,3e-3", "run_dir=/r/lr${optim.lr}"], None),
        (["-m", "optim.lr=1e-3,3e-3", "run_dir=/r/${hydra:job.num}"], None),  # composes only under Hydra's launcher
        (["-m", "optim.lr=1e-3"], None),
        (["optim.lr=1e-3,3e-3"], None),  # not a sweep without -m (Hydra refuses the value)
        (["-m", "-cn", "train", "optim.lr=1e-3,3e-3"], None),  # another primary config: not composed here
        (["-m", "optim.lr=1e-3,3e-3", "run_dir=/r/${now:%Y-%m-%d}"], None),  # resolved when each job starts
        (["-m", "hydra.sweeper.params.optim.lr=1e-3,1e-4"], None),  # Hydra's one line, not a traceback
        (
            ["-m", "optim.lr=1e-3,3e-3", "run_dir=/r/lr${optim.lr}/../same"],
            "jobs 0 (optim.lr=0.001 run_dir=/r/lr${optim.lr}/../same) and 1 (optim.lr=0.003 "
            "run_dir=/r/lr${optim.lr}/../same) would both train in run_dir=/r/lr0.003/../same",
        ),
    ],
    ids=[
        "same-run-dir",
        "default-run-dir",
        "experiments",
        "interpolated",
        "job-num",
        "one-job",
        "no-m",
        "config-name",
        "now",
        "sweeper-params",
        "same-directory-two-spellings",
    ],
)
def test_a_sweep_whose_jobs_share_a_run_dir_is_refused_before_any_job(argv, shared):
    """The second job would resume the first's checkpoints (or be refused once it finished): ``-m
    trainer.max_steps=10,20 run_dir=X`` would continue job 0's run without a word."""
    line = shared_run_dir_error(argv, compose_config)
    assert line == (
        None
        if shared is None
        else f"-m: {shared}, the later resuming the earlier's checkpoints; give "
        "each job its own, e.g. 'run_dir=runs/sweep/${hydra:job.num}'"
    )


@pytest.mark.parametrize(
    "argv,shared",
    [
        (
            ["-m", "optim.lr=1e-3,3e-3", "run_dir=/r/lr${optim.lr}", "checkpoint.dir=/c"],
            "jobs 0 (optim.lr=0.001 run_dir=/r/lr${optim.lr} checkpoint.dir=/c) and 1 (optim.lr=0.003 "
            "run_dir=/r/lr${optim.lr} checkpoint.dir=/c) would both save in checkpoint.dir=/c",
        ),
        (  # two spellings of one directory
            ["-m", "checkpoint.dir=c,./c", "run_dir=/r/x${checkpoint.dir}"],
            "jobs 0 (checkpoint.dir=c run_dir=/r/x${checkpoint.dir}) and 1 (checkpoint.dir=./c "
            "run_dir=/r/x${checkpoint.dir}) would both save in checkpoint.dir=./c",
        ),
        (["-m", "optim.lr=1e-3,3e-3", "run_dir=/r/lr${optim.lr}", "checkpoint.dir=/c/${optim.lr}"], None),
        (
            ["-m", "optim.lr=1e-3,3e-3", "run_dir=/r/lr${optim.lr}", "checkpoint.dir=/c", "checkpoint.enabled=false"],
            None,
        ),
    ],
    ids=["explicit", "two-spellings", "interpolated", "not-saving"],
)
def test_a_sweep_whose_jobs_share_a_checkpoint_dir_is_refused_before_any_job(argv, shared):
    """Different run_dirs, one checkpoint.dir: the later job would resume the earlier's checkpoints."""
    line = shared_run_dir_error(argv, compose_config)
    assert line == (
        None
        if shared is None
        else f"-m: {shared}, the later resuming the earlier's checkpoints; give "
        "each job its own, e.g. 'checkpoint.dir=${run_dir}/checkpoints'"
    )


def test_a_shared_run_dir_sweep_on_the_command_line_is_one_line(tmp_path):
    line = refused(cli("-m", "experiment=quick", "optim.lr=1e-3,3e-3", f"run_dir={tmp_path / 'run'}"))
    assert line.startswith("-m: jobs 0 (") and not (tmp_path / "run").exists()


def test_a_refused_sweep_job_is_named(tmp_path):
    """A sweep re-run with another grid refuses job 0 as a finished run with a changed key, and the line names the
    job (the later jobs never run)."""
    sweep = [*QUICK, "trainer.max_steps=2", "trainer.progress=false", f"run_dir={tmp_path}/" + "${hydra:job.num}"]
    sweep.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    first = cli("-m", *sweep, "optim.lr=1e-3,2e-3")
    assert first.returncode == 0, first.stderr[-3000:]
    again = cli("-m", *sweep, "optim.lr=3e-3,4e-3")  # refused after its logging started: the last line
    assert again.returncode == 2, again.stderr[-3000:]
    line = again.stderr.strip().splitlines()[-1].removeprefix("error: ")
    assert line.startswith("-m job 0: run finished at step 2: ") and "optim.lr 0.001 -> 0.003" in line, line


def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="recipes.train"):
        train(compose_config([*QUICK, "trainer.max_steps=1", "trainer.progress=false", f"run_dir={tmp_path}"]))
    assert "trainer.warmup_steps=2 > trainer.max_steps=1: the learning rate peaks at 50 % of optim.lr" in [
        r.getMessage() for r in caplog.records
    ]


def test_a_dashed_override_on_the_command_line_is_refused_in_one_line(tmp_path):
    line = refused(cli("--optim.lr=1e-3", f"run_dir={tmp_path / 'run'}"))
    assert line == "--optim.lr=1e-3: not an option (see --help); did you mean optim.lr=1e-3?"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            ["optim=adamw", "optim.exp_avg_dtype=bf16"],
            "optim.exp_avg_dtype: not a key of optim=adamw; a key of optim=fused_adam",
        ),  # not 'not a config key; did you mean optim.exp_avg_dtype?'
        (
            ["optim=adamw", "+optim.exp_avg_dtype=bf16"],
            "optim.exp_avg_dtype: not a key of optim=adamw; a key of optim=fused_adam",
        ),
        (["lr=1e-3"], "lr: not a config key; did you mean optim.lr?"),
        (
            ["optim.name=adamw"],
            "optim.name=adamw: the optimizer is chosen by its config group (optim=adamw); optim.name follows the group",
        ),  # not 'optim.backend: not a config key', a key the user never typed
        (["optim=adamw,fused_adam"], "optim=adamw,fused_adam: a comma makes a sweep (add -m)"),  # a group: no list
    ],
    ids=[
        "another-optimizers-key",
        "another-optimizers-key-added",
        "key-of-a-group",
        "name-instead-of-group",
        "comma-in-a-group",
    ],
)
def test_a_key_in_the_wrong_place_names_where_it_belongs(overrides, line, tmp_path):
    """A key of another optimizer's group, or a group's key given as a plain key, is named with where it belongs."""
    with pytest.raises(ConfigError) as err:
        preflight(compose_config([*overrides, f"run_dir={tmp_path / 'run'}"]))
    assert str(err.value) == line
    assert not (tmp_path / "run").exists()


def test_a_run_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    line = refused(cli(*QUICK, f"run_dir={tmp_path / 'file' / 'run'}"))
    assert line == f"run_dir='{tmp_path / 'file' / 'run'}': not a directory ({tmp_path / 'file'} is a file)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: no unwritable directory to test with")
def test_an_unwritable_run_dir_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    line = refused(cli(*QUICK, f"run_dir={locked / 'run'}"))
    assert line == f"run_dir='{locked / 'run'}': {locked} is not writable"
    assert list(Path(locked).iterdir()) == []


def test_launches_in_one_process_and_second_get_a_record_each(tmp_path):
    """Two launches of one process within a second (a sweep's jobs, tests) get a record each: with one shared name
    the second would overwrite the first, and a refused second launch would then remove both."""
    cfg = compose_config([f"run_dir={tmp_path}"])
    paths = [record_config(cfg, str(tmp_path), [f"optim.lr={lr}"]) for lr in (1, 2, 3)]
    assert len(set(paths)) == 3 and sorted((tmp_path / "launches").iterdir()) == sorted(paths)
    assert [p.read_text().splitlines()[0] for p in paths] == [
        f"# python recipes/train.py optim.lr={v}" for v in (1, 2, 3)
    ]


@pytest.mark.parametrize(
    "args,line",
    [
        # accepted, the current directory would be the run_dir, and ${run_dir}/checkpoints the root's /checkpoints
        (["run_dir="], "run_dir='': empty; expected a directory (e.g. run_dir=runs/my_run)"),
        (["checkpoint.dir="], "checkpoint.dir='': empty; expected a directory (e.g. <run_dir>/checkpoints)"),
        # accepted, the path would be ignored, even one that does not exist, and the run would train from step 0
        (
            ["checkpoint.enabled=false", "checkpoint.resume=/nonexistent/step_00000020"],
            "checkpoint.resume='/nonexistent/step_00000020' with checkpoint.enabled=false: nothing would be loaded; "
            "drop checkpoint.resume, or set checkpoint.enabled=true",
        ),
    ],
)
def test_a_checkpoint_location_that_would_be_ignored_or_misplaced_is_refused(tmp_path, monkeypatch, args, line):
    run_dir = [] if args[0].startswith("run_dir=") else [f"run_dir={tmp_path / 'run'}"]
    monkeypatch.chdir(tmp_path)
    assert refused(cli(*QUICK, *run_dir, *args)) == line
    assert list(tmp_path.iterdir()) == []  # nothing written (here: the working directory)


def test_a_refusal_that_needs_the_model_leaves_no_launch_record(tmp_path):
    """An override pattern matching no parameter (refused once the model exists) leaves no launches/ record, which
    would make a later checkpoint.enabled=false in that run_dir a refused second launch. Broken on purpose (no
    unlink around build_optimizer): the record stays."""
    run_dir = tmp_path / "run"
    over = [*QUICK, f"run_dir={run_dir}", "trainer.max_steps=2", "trainer.progress=false"]
    with pytest.raises(ConfigError, match="matches no trainable parameter"):
        train(compose_config([*over, "optim.param_groups.overrides=[{pattern: nomatch, lr_mult: 2}]"]))
    assert not list((run_dir / "launches").glob("*.yaml"))
    assert train(compose_config([*over, "checkpoint.enabled=false"]))["end_step"] == 2


def test_threads_0_is_torch_s_default_also_after_a_job_that_set_a_count(tmp_path):
    """In a -m sweep (one process), trainer.threads=0 after a job that set a count is torch's default again."""
    from recipes.job import DEFAULT_THREADS

    over = [*QUICK, "trainer.max_steps=1", "trainer.progress=false", "checkpoint.enabled=false"]
    other = 2 if DEFAULT_THREADS == 1 else 1  # a count that is not torch's default here
    try:
        train(compose_config([*over, f"run_dir={tmp_path / 'a'}", f"trainer.threads={other}"]))
        assert torch.get_num_threads() == other
        train(compose_config([*over, f"run_dir={tmp_path / 'b'}", "trainer.threads=0"]))
        assert torch.get_num_threads() == DEFAULT_THREADS
    finally:
        torch.set_num_threads(DEFAULT_THREADS)


# ------------------------------------------------------------------ a config error is refused before torch is imported
@pytest.mark.parametrize("override", ["optim.lr_typo=1", "trainer.max_step=5", "optim.exp_avg_dtype=bf17"])
def test_a_config_error_is_refused_before_torch_or_the_job_is_imported(override):
    """What a fresh interpreter imports is what is tested, so a process of its own: ``python recipes/train.py`` with
    a typo refuses in its one line (exit 2) without importing torch (seconds, more under load) or ``recipes.job``
    (whose imports are torch's); the line printed is the one the in-process entry point prints."""
    import subprocess
    import sys

    code = (
        "import runpy, sys\n"
        f"sys.argv = ['recipes/train.py', {override!r}]\n"
        "try:\n"
        "    runpy.run_path('recipes/train.py', run_name='not_main')['main']()\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, sorted(m for m in ('torch', 'recipes.job') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "2 []", (proc.stdout, proc.stderr[-3000:])
    assert proc.stderr == cli(override).stderr and proc.stderr.count("\n") == 1, proc.stderr
