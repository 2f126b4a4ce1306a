"""Worker settings: config/worker.toml documents every setting with its default, and flags
beat the environment, which beats the file."""

import argparse
import os
import re

import pytest
import tomllib
from pydantic import ValidationError

from producer_client.errors import InvalidArgument
from worker.__main__ import check_cuda_device
from worker.__main__ import main as worker_main
from worker.engine.settings import EngineSettings
from worker.settings import DEFAULT_CONFIG_FILE, WorkerSettings, add_setting_flags, settings_from_args


def parse_flags(*argv: str) -> WorkerSettings:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    return settings_from_args(parser.parse_args(list(argv)))


def test_the_shipped_file_lists_every_setting_at_its_default():
    text = DEFAULT_CONFIG_FILE.read_text()
    data = tomllib.loads(text)
    engine = data.pop("engine")
    # Settings whose default is "unset" appear commented out: TOML has no null. So does one that
    # is refused unless another, unset by default, is given (num_speculative_tokens: the loaded
    # file would stop every worker without a speculative_method), at its default.
    top, engine_text = text.split("\n[engine]\n")
    commented_top = set(re.findall(r"^# (\w+) = ", top, flags=re.M))
    assert set(data) | commented_top == set(WorkerSettings.model_fields) - {"engine"}
    assert not set(data) & commented_top
    assert all(WorkerSettings.model_fields[name].default is None for name in commented_top)
    commented = set(re.findall(r"^# (\w+) = ", engine_text, flags=re.M))
    assert set(engine) | commented == set(EngineSettings.model_fields)
    needing_another = {name for name in commented if EngineSettings.model_fields[name].default is not None}
    assert needing_another == {"num_speculative_tokens"}
    assert re.search(r"^# num_speculative_tokens = 4 ", engine_text, flags=re.M)
    assert EngineSettings.model_fields["num_speculative_tokens"].default == 4
    defaults = WorkerSettings.model_construct()
    assert {k: getattr(defaults, k) for k in data} == data
    assert {k: getattr(EngineSettings(), k) for k in engine} == engine


def test_flags_beat_the_environment_which_beats_the_file(tmp_path, monkeypatch):
    config = tmp_path / "worker.toml"
    config.write_text(
        'queue = "from-file"\nblock_ms = 11\nlog_level = "DEBUG"\n[engine]\nmax_running = 3\npage_size = 32\n'
    )
    monkeypatch.setenv("MILI_BLOCK_MS", "22")
    monkeypatch.setenv("MILI_ENGINE__PAGE_SIZE", "64")
    s = parse_flags("--config", str(config), "--block-ms", "33", "--max-running", "4", "--no-enable-prefix-cache")
    assert (s.queue, s.log_level) == ("from-file", "DEBUG")  # file over default
    assert s.engine.page_size == 64  # environment over file
    assert (s.block_ms, s.engine.max_running, s.engine.enable_prefix_cache) == (33, 4, False)  # flags over all
    monkeypatch.delenv("MILI_BLOCK_MS")
    assert parse_flags("--config", str(config)).block_ms == 11


def test_names_that_end_up_in_redis_keys_are_checked():
    with pytest.raises(InvalidArgument) as e:
        WorkerSettings.load(None, queue="a b")
    assert e.value.field == "queue"
    assert WorkerSettings.load(None, name="").name == ""  # empty: derived from host and pid


@pytest.mark.parametrize(
    "timing",
    [
        dict(claim_idle_ms=1000, heartbeat_interval_s=0.6),  # a late heartbeat would lose the entries
        dict(claim_idle_ms=5000, redis_backoff_max_s=5.0),  # a worker back from an outage would refresh too late
        dict(claim_idle_ms=5000, redis_backoff_max_s=4.0, heartbeat_interval_s=1.0),
    ],
)
def test_a_claim_idle_time_that_would_let_live_workers_lose_their_jobs_is_refused(timing):
    with pytest.raises(InvalidArgument) as e:
        WorkerSettings.load(None, **timing)
    assert e.value.field == "claim_idle_ms"
    assert WorkerSettings.load(None, **{**timing, "claim_idle_ms": 10_000}).claim_idle_ms == 10_000


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--claim-idle-ms", "3000"],
            (
                "claim_idle_ms: 3000 is too short: give more than 6000 (redis_backoff_max_s 5 s + heartbeat_interval_s "
                "1 s): a worker back from a Redis outage refreshes its running jobs' entries only that long after, "
                "and the other workers would reclaim them first"
            ),
        ),
        (
            ["--claim-idle-ms", "6500", "--wait-replicas", "1"],
            (
                "claim_idle_ms: 6500 is too short: give more than 7000 (redis_backoff_max_s 5 s + heartbeat_interval_s "
                "1 s + wait_timeout_ms 1000 with wait_replicas): a worker back from a Redis outage refreshes its "
                "running jobs' entries only that long after, and the other workers would reclaim them first"
            ),
        ),
        (
            ["--claim-idle-ms", "1000", "--heartbeat-interval-s", "0.6", "--redis-backoff-max-s", "0.1"],
            (
                "claim_idle_ms: 1000 is too short: give at least 1200 (twice heartbeat_interval_s 0.6 s): one late "
                "heartbeat would let the other workers reclaim this worker's running jobs"
            ),
        ),
    ],
)
def test_a_claim_idle_time_too_short_is_refused_with_its_minimum_and_why(flags, message, capsys):
    """As a user starting a worker sees it: one line, before anything loads."""
    assert worker_main(["serve", *flags]) == 2
    assert capsys.readouterr().err == f"error: invalid_argument: {message}\n"


@pytest.mark.parametrize(
    "flags, timeout_s",
    [
        (["--wait-replicas", "1", "--wait-timeout-ms", "5000"], 5),  # embedded: redis-py's 5 s
        (["--wait-replicas", "2", "--wait-timeout-ms", "2500", "--redis", "redis://127.0.0.1:1/0?socket_timeout=2"], 2),
    ],
)
def test_a_workers_wait_as_long_as_its_socket_timeout_is_refused_before_anything_loads(flags, timeout_s, capsys):
    """A worker whose WAIT outlasted its connection's socket timeout read every publication round
    as Redis gone (RedisTimedOut), backed off and sent the round again, which timed out again:
    the first job's result was written, no later job ever ended (three jobs submitted, two never
    finished in 40 s, its log one "Redis unavailable" line each 10 s)."""
    assert worker_main(["serve", *flags]) == 2
    assert capsys.readouterr().err == (
        f"error: invalid_argument: wait_timeout_ms: must be shorter than the connection's socket_timeout "
        f"({timeout_s} s; the URL's ?socket_timeout= sets it)\n"
    )
    # Shorter, or no WAIT at all, is taken.
    assert WorkerSettings.load(None, wait_replicas=1, wait_timeout_ms=4999).wait_timeout_ms == 4999
    assert WorkerSettings.load(None, wait_replicas=0, wait_timeout_ms=60_000).wait_timeout_ms == 60_000


@pytest.mark.parametrize(
    "timing",
    [
        dict(heartbeat_interval_s=6.0),  # past the default TTL (5 s): the heartbeat is gone 1 s in 6
        dict(heartbeat_interval_s=2.0, heartbeat_ttl_s=2.0),
        dict(heartbeat_interval_s=3.0, heartbeat_ttl_s=5.0),  # stale (past half its TTL) before each beat
    ],
)
def test_a_heartbeat_that_would_expire_or_go_stale_between_its_refreshes_is_refused(timing):
    """A heartbeat refreshed every interval with a TTL no longer than that expired between beats:
    the worker counted as dead for a moment of every interval (its healthcheck failed, `/health`
    and `GET /v1/models` left its model out, a request for it was a 404); one of under two
    intervals read as stale to the board between beats. 6 s with the default TTL of 5 s passed
    every other check."""
    with pytest.raises(InvalidArgument) as e:
        WorkerSettings.load(None, **timing)
    assert e.value.field == "heartbeat_ttl_s"
    assert str(e.value) == (
        f"heartbeat_ttl_s: {timing.get('heartbeat_ttl_s', 5.0):g} is too short: give at least "
        f"{2 * timing['heartbeat_interval_s']:g} (twice heartbeat_interval_s {timing['heartbeat_interval_s']:g} s): "
        "the heartbeat would go stale, or expire and count the live worker as dead, between two refreshes"
    )
    ttl_s = 2 * timing["heartbeat_interval_s"]
    assert WorkerSettings.load(None, **{**timing, "heartbeat_ttl_s": ttl_s}).heartbeat_ttl_s == ttl_s


def test_checkpoints_sparser_than_streams_are_the_only_publish_intervals_taken():
    with pytest.raises(InvalidArgument) as e:
        WorkerSettings.load(None, stream_interval_s=0.5, checkpoint_interval_s=0.2)
    assert e.value.field == "checkpoint_interval_s"
    for bad in (dict(stream_interval_s=0), dict(checkpoint_interval_s=-1.0)):
        with pytest.raises(ValidationError):
            WorkerSettings.load(None, **bad)
    s = WorkerSettings.load(None, stream_interval_s=0.2, checkpoint_interval_s=0.2)
    assert (s.stream_interval_s, s.checkpoint_interval_s) == (0.2, 0.2)


def test_every_worker_flag_says_what_it_does():
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    silent = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help" and not a.help]
    assert silent == []


def test_kv_cache_dtype_flag_offers_its_choices_and_refuses_others(capsys):
    assert parse_flags("--kv-cache-dtype", "fp8_e4m3").engine.kv_cache_dtype == "fp8_e4m3"
    assert parse_flags().engine.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse_flags("--kv-cache-dtype", "int8")
    # Python 3.12.8 stopped quoting the choices.
    assert re.search(
        r"--kv-cache-dtype: invalid choice: 'int8' \(choose from '?auto'?, '?fp8_e4m3'?\)", capsys.readouterr().err
    )


def test_speculative_flags_reach_the_engine_settings_and_a_method_without_its_model_is_refused(capsys):
    engine = parse_flags(
        "--speculative-method", "draft", "--speculative-model", "tiny", "--num-speculative-tokens", "3"
    )
    assert (engine.engine.speculative_method, engine.engine.speculative_model) == ("draft", "tiny")
    assert engine.engine.num_speculative_tokens == 3
    assert parse_flags().engine.speculative_method is None
    with pytest.raises(InvalidArgument, match="speculative_model: speculative_method eagle3 needs one"):
        parse_flags("--speculative-method", "eagle3")
    with pytest.raises(InvalidArgument, match="speculative_model: only speculative_method draft or eagle3"):
        parse_flags("--speculative-method", "ngram", "--speculative-model", "tiny")
    with pytest.raises(SystemExit):
        parse_flags("--speculative-method", "medusa")
    assert "invalid choice: 'medusa'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, environment, file",
    [
        (["--num-speculative-tokens", "4"], {}, ""),
        ([], {"MILI_ENGINE__NUM_SPECULATIVE_TOKENS": "3"}, ""),
        ([], {}, "[engine]\nnum_speculative_tokens = 2\n"),
    ],
)
def test_num_speculative_tokens_without_a_method_stops_the_worker_with_one_line_naming_both(
    flags, environment, file, tmp_path, monkeypatch, capsys
):
    """It was ignored (the worker served without speculation) where --speculative-model alone was
    refused: a setting that cannot take effect is refused before the worker touches Redis, as a
    flag, in the environment and in the settings file (even at its default, 4)."""
    for name in [n for n in os.environ if n.startswith("MILI_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "worker.toml"
    config.write_text(file)
    assert worker_main(["--redis", "redis://localhost:1/0", "--config", str(config), *flags]) == 2
    line = "num_speculative_tokens: has no effect without speculative_method (ngram, draft or eagle3)"
    assert capsys.readouterr().err == f"error: invalid_argument: {line}\n"


def test_a_settings_file_that_is_missing_or_no_toml_and_a_log_level_of_no_name_are_one_line_each(tmp_path, capsys):
    """As a user starting a worker sees them: one line and exit code 2, before anything binds or
    loads; a missing --config, TOML that does not parse and a log level logging has no name for
    were tracebacks (FileNotFoundError, TOMLDecodeError, ValueError from logging at its setup).
    The file's text (a Redis URL, with its password) is never shown."""
    not_toml = tmp_path / "not.toml"
    not_toml.write_text('redis = "redis://u:pw-in-the-file@h:1/0"\nblock_ms = \n')
    not_utf8 = tmp_path / "binary.toml"
    not_utf8.write_bytes(b"\xff\xfe")
    for flags, message in (
        (["--config", str(tmp_path / "none.toml")], f"config: settings file {tmp_path / 'none.toml'} does not exist"),
        (["--config", str(tmp_path)], f"config: settings file {tmp_path} does not exist"),
        (["--config", str(not_toml)], f"config: settings file {not_toml} is not TOML that can be read: Invalid value"),
        (["--config", str(not_utf8)], f"config: settings file {not_utf8} is not TOML that can be read: 'utf-8' codec"),
        (["--log-level", "loud"], "log_level: String should match pattern '^(?i:DEBUG|INFO|WARNING|ERROR)$'"),
    ):
        assert worker_main(["serve", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: invalid_argument: {message}") and err.count("\n") == 1, err
        assert "pw-in-the-file" not in err
    assert WorkerSettings.load(None, log_level="warning").log_level == "warning"  # any case, as logging takes it


def test_a_device_the_host_has_not_is_one_line_before_the_model_loads(capsys):
    """`--device bogus` was torch's RuntimeError, and `--device cuda:N` on a host without it an
    AssertionError ('Torch not compiled with CUDA enabled'), both tracebacks from the model's load."""
    for device in ("bogus", "CPU", "cuda:x", "gpu"):
        assert worker_main(["serve", "--device", device]) == 2
        assert capsys.readouterr().err == (
            "error: invalid_argument: device: String should match pattern '^(auto|cpu|cuda(:\\d{1,3})?)$'\n"
        )
    for device in ("cpu", "auto", "cuda", "cuda:1"):
        assert WorkerSettings.load(None, device=device).device == device
    check_cuda_device("cpu", 0)
    check_cuda_device("cuda:1", 2)
    for device, count, seen in (
        ("cuda", 0, "no CUDA device"),
        ("cuda:1", 1, "1 CUDA device (cuda:0)"),
        ("cuda:4", 4, "4 CUDA devices (cuda:0 to 3)"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            check_cuda_device(device, count)
        assert refused.value.message == f"device: {device}: torch sees {seen} on this host; use cpu, or auto"


def test_an_abbreviated_flag_is_refused_not_taken_as_the_setting_it_begins(capsys):
    """`--log-lev loud` was `--log-level loud` (argparse takes a flag's prefix by default): a flag
    is given whole, or the worker says which it does not know, for every subcommand."""
    for command in ("serve", "healthcheck"):
        with pytest.raises(SystemExit) as stopped:
            worker_main([command, "--log-lev", "loud"])
        assert stopped.value.code == 2
        assert "unrecognized arguments: --log-lev loud" in capsys.readouterr().err


def test_a_flag_argparse_cannot_read_is_one_line_as_mili_says_it(capsys):
    """argparse printed the serve command's usage block, 40 lines, before its error."""
    for argv, line in (
        (
            ["serve", "--max-running", "abc"],
            "argument --max-running: invalid int value: 'abc' (see python -m worker serve",
        ),
        (["--bogus"], "unrecognized arguments: --bogus (see python -m worker"),
    ):
        with pytest.raises(SystemExit) as stopped:
            worker_main(argv)
        assert stopped.value.code == 2
        assert capsys.readouterr().err == f"error: invalid_argument: {line} --help)\n"


def test_a_variable_whose_value_is_not_the_json_its_setting_takes_is_named_with_what_it_takes(monkeypatch, capsys):
    """MILI_ENGINE__LORA_MODULES=sql=/adapters/sql (the flag's form) stopped the worker with
    pydantic-settings' 'error parsing value for field "engine" from source "EnvSettingsSource"':
    neither the variable nor that a table of settings is JSON there (docs/operations.md's table)."""
    for name in [n for n in os.environ if n.startswith("MILI_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MILI_ENGINE__LORA_MODULES", "sql=/adapters/sql")
    assert worker_main(["serve"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: invalid_argument: engine: MILI_ENGINE__LORA_MODULES is not the JSON")
        and err.count("\n") == 1
    ), err
    assert 'MILI_ENGINE__LORA_MODULES=\'{"sql": "/adapters/sql"}\'' in err
    monkeypatch.setenv("MILI_ENGINE__LORA_MODULES", '{"sql": "/adapters/sql"}')
    assert WorkerSettings.load(None).engine.lora_modules == {"sql": "/adapters/sql"}


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--heartbeat-ttl-s", "inf"], "heartbeat_ttl_s: Input should be a finite number"),
        (["--drain-grace-s", "inf"], "drain_grace_s: Input should be a finite number"),
        (["--gpu-memory-utilization", "nan"], "engine.gpu_memory_utilization: Input should be a finite number"),
    ],
)
def test_a_number_setting_that_is_not_finite_is_one_line_before_anything_starts(flags, line, monkeypatch, capsys):
    """`inf` passed every bound (inf > 0): heartbeat_ttl_s ended the worker with an OverflowError
    traceback once it was made an integer, drain_grace_s waited for ever. As a flag, a variable
    or in the file, as mili refuses an infinite --connect-timeout."""
    assert worker_main(["--redis", "redis://localhost:1/0", *flags]) == 2
    assert capsys.readouterr().err == f"error: invalid_argument: {line}\n"
    monkeypatch.setenv("MILI_HEARTBEAT_TTL_S", "Infinity")
    assert worker_main(["--redis", "redis://localhost:1/0"]) == 2
    assert capsys.readouterr().err == "error: invalid_argument: heartbeat_ttl_s: Input should be a finite number\n"
