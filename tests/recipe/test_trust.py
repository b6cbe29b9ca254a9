"""The recipe's resume reads a checkpoint as data, and with ``checkpoint.key_env`` names a changed one before it
trusts it (docs/reliability.md, "Trust"). The attacker here can write into the checkpoint folder and recompute
every unkeyed hash (the files' XXH3 and the manifest's own)."""

from __future__ import annotations

import json
import logging
import shutil
import warnings

import pytest
import torch.distributed.checkpoint as dcp

from recipes.checkpoint import FALLBACK_HINT, MARKER, CheckpointError, read_checkpoint, read_manifest
from recipes.checkpoint.checksums import ALGORITHM, KEYED, MANIFEST_DIGEST, MANIFEST_MAC, file_hash, seal_manifest
from recipes.job import train
from recipes.train import compose_config
from tests.planted import RunsACommand, plant_metadata
from tests.recipe.runs import QUICK, cli, refused, snapshot

STEP10, STEP20 = "step_00000010", "step_00000020"
KEY_ENV = "OPTIM_FACTORY_TEST_KEY"
UNSAFE = "holds posix.system, which"


def _run(run_dir, *extra):
    return train(compose_config([*QUICK, f"run_dir={run_dir}", *extra]))


def reseal(step_dir, key: bytes | None = None) -> None:
    """What an attacker without the key does after changing files: every file's size and XXH3 recomputed, the
    manifest's own hash too (with ``key``: what a holder of the key would write)."""
    manifest = json.loads((step_dir / MARKER).read_text())
    for name in ("files", MANIFEST_DIGEST, MANIFEST_MAC):
        manifest.pop(name, None)
    files = {}
    for path in sorted(step_dir.iterdir()):
        if path.name != MARKER:
            size, digest = file_hash(path)
            files[path.name] = {"size": size, ALGORITHM: digest}
    (step_dir / MARKER).write_text(seal_manifest({**manifest, "files": files}, key))


def plant_item(step_dir, marker) -> None:
    """The checkpoint rewritten with its trainer's step count replaced by a pickle that runs a command."""
    state = read_checkpoint(step_dir)
    state["trainer.step"] = RunsACommand(marker)
    for path in step_dir.glob("*.distcp"):
        path.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)


def _refused(run_dir, *extra) -> str:
    """Resuming raises one CheckpointError line; nothing on disk changes."""
    before = snapshot(run_dir / "checkpoints")
    with pytest.raises(CheckpointError) as info:
        _run(run_dir, "trainer.max_steps=25", *extra)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert snapshot(run_dir / "checkpoints") == before
    return msg


@pytest.mark.parametrize("planted", ["metadata", "item"])
def test_a_planted_checkpoint_is_refused_before_it_runs_and_fallback_resumes_the_previous(run_dir, tmp_path, planted):
    step_dir = run_dir / "checkpoints" / STEP20
    marker = tmp_path / "ran"
    plant_metadata(step_dir, marker) if planted == "metadata" else plant_item(step_dir, marker)
    reseal(step_dir)
    msg = _refused(run_dir)
    where = f"{step_dir}/.metadata" if planted == "metadata" else f"{step_dir}/__0_0.distcp (item trainer.step)"
    assert msg.startswith(f"checkpoint {step_dir} is refused: {where} {UNSAFE}"), msg
    assert msg.endswith(FALLBACK_HINT), msg
    assert not marker.exists()
    summary = _run(run_dir, "trainer.max_steps=25", "checkpoint.fallback=true")
    assert summary["resumed_from"].endswith(STEP10) and summary["start_step"] == 10
    assert not marker.exists()


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """The quick job with ``checkpoint.key_env``: checkpoints at steps 10 and 20, signed. Read only."""
    run_dir = tmp_path_factory.mktemp("signed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, "the key")
        _run(run_dir, "checkpoint.keep_last=0", f"checkpoint.key_env={KEY_ENV}")
    return run_dir


@pytest.fixture
def signed_run(signed, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "the key")
    shutil.copytree(signed, tmp_path / "run")
    return tmp_path / "run"


def test_a_signed_checkpoint_records_keyed_digests_and_resumes(signed_run):
    manifest = read_manifest(signed_run / "checkpoints" / STEP20, b"the key")
    assert MANIFEST_MAC in manifest
    assert all(KEYED in record and ALGORITHM in record for record in manifest["files"].values())
    summary = _run(signed_run, "trainer.max_steps=25", f"checkpoint.key_env={KEY_ENV}")
    assert summary["resumed_from"].endswith(STEP20)


@pytest.mark.parametrize("change", ["a file", "the manifest"])
def test_a_signed_checkpoint_changed_without_the_key_is_refused_and_fallback_resumes_the_previous(signed_run, change):
    step_dir = signed_run / "checkpoints" / STEP20
    if change == "a file":  # the manifest left as it is: its XXH3 of the file would tell too, its MAC must hold
        shard = next(step_dir.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        want = f"{shard.name}: keyed digest mismatch (changed without checkpoint.key_env's key, or signed with another)"
    else:
        manifest = json.loads((step_dir / MARKER).read_text())
        manifest.pop(MANIFEST_DIGEST)
        manifest["config"]["optim"]["lr"] = 1.0  # what the run would take as its checkpoint's config
        (step_dir / MARKER).write_text(json.dumps({**manifest, MANIFEST_DIGEST: _digest(manifest)}, sort_keys=True))
        want = f"{MARKER}: its MAC does not verify with checkpoint.key_env's key"
    msg = _refused(signed_run, f"checkpoint.key_env={KEY_ENV}")
    assert msg.startswith(f"checkpoint {step_dir} is damaged: {want}"), msg
    summary = _run(signed_run, "trainer.max_steps=25", f"checkpoint.key_env={KEY_ENV}", "checkpoint.fallback=true")
    assert summary["resumed_from"].endswith(STEP10)
    assert (signed_run / "checkpoints" / f"{STEP20}.damaged").is_dir()  # set aside, as a damaged one is


def _digest(manifest: dict) -> str:
    """The manifest's unkeyed hash, as anyone can recompute it."""
    text = seal_manifest(manifest)
    return json.loads(text)[MANIFEST_DIGEST]


def test_an_unsigned_checkpoint_is_refused_with_a_key(run_dir, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "the key")
    msg = _refused(run_dir, f"checkpoint.key_env={KEY_ENV}")
    assert msg.startswith(
        f"checkpoint {run_dir / 'checkpoints' / STEP20} is damaged: {MARKER}: it is not signed (checkpoint.key_env "
        "is set: only a checkpoint signed with its key loads)"
    ), msg


def test_a_key_env_without_its_variable_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    line = refused(cli(*QUICK, f"run_dir={tmp_path / 'run'}", f"checkpoint.key_env={KEY_ENV}"))
    assert line == (
        f"checkpoint.key_env={KEY_ENV}: the environment variable {KEY_ENV} is not set or empty (it holds the key "
        "that signs and verifies checkpoints; set it on every rank, or drop checkpoint.key_env)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("forged", ["a MAC of non-ASCII text", "a file record of the wrong type"])
def test_a_forged_manifest_is_a_one_line_refusal_not_a_crash(signed_run, forged):
    """What anyone can write into ``COMPLETE.json`` (its unkeyed hash recomputed) is refused in one line, as damage."""
    step_dir = signed_run / "checkpoints" / STEP20
    manifest = json.loads((step_dir / MARKER).read_text())
    manifest.pop(MANIFEST_DIGEST)
    if forged == "a MAC of non-ASCII text":
        manifest[MANIFEST_MAC] = "é" * 64
        extra, want = [f"checkpoint.key_env={KEY_ENV}"], f"{MARKER}: its MAC does not verify"
    else:
        manifest.pop(MANIFEST_MAC)
        manifest["files"]["__0_0.distcp"]["size"] = "many"
        extra, want = [], "__0_0.distcp: its record cannot be checked (TypeError: "
    (step_dir / MARKER).write_text(json.dumps({**manifest, MANIFEST_DIGEST: _digest(manifest)}, sort_keys=True))
    msg = _refused(signed_run, *extra)
    assert msg.startswith(f"checkpoint {step_dir} is damaged: {want}"), msg


def test_a_signed_checkpoint_resumed_without_the_key_says_it_is_verified_by_checksums_only(signed_run, caplog):
    with caplog.at_level(logging.WARNING, logger="recipes.checkpoint"):
        _run(signed_run, "trainer.max_steps=25")
    step_dir = signed_run / "checkpoints" / STEP20
    assert f"checkpoint {step_dir} is signed, but checkpoint.key_env is not set: verified by its XXH3" in caplog.text


@pytest.mark.parametrize("typed", ["$SECRET-VALUE", "my key", "a/b"])
def test_a_key_env_that_is_not_a_variable_name_is_refused_without_echoing_it(tmp_path, typed):
    """``checkpoint.key_env=$KEY`` unquoted puts the key itself on the command line: the refusal never repeats it."""
    line = refused(cli(*QUICK, f"run_dir={tmp_path / 'run'}", f"checkpoint.key_env={typed!r}"))
    assert line == (
        "checkpoint.key_env: expected the name of an environment variable (letters, digits, _), which holds the key: "
        "checkpoint.key_env=NAME, not its value"
    )
    assert typed not in line
