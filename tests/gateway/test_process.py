"""The gateway as a program: its settings' precedence, its flags, and what it imports."""

import http.server
import subprocess
import sys
import threading

import pytest
import tomllib
from pydantic import ValidationError

from gateway.__main__ import build_parser, main
from gateway.settings import DEFAULT_CONFIG_FILE, GatewaySettings, settings_from_args
from harness.processes import REPO, ProcessNotReady
from producer_client import InvalidArgument
from tests.support.gateways import GatewayProcess
from worker.embedded_redis import free_port


def test_the_gateway_imports_neither_torch_nor_the_worker():
    code = (
        "import sys, gateway.__main__; "
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'worker', 'kernels', 'triton', 'numba'}); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_shipped_file_lists_every_setting_at_its_default():
    """docs/http-api.md: config/gateway.toml "lists each one at its default", as config/worker.toml
    does the worker's (tests/queue/test_settings.py)."""
    shipped = tomllib.loads(DEFAULT_CONFIG_FILE.read_text())
    defaults = {
        name: field.get_default(call_default_factory=True) for name, field in GatewaySettings.model_fields.items()
    }
    assert shipped == defaults


def test_flags_override_the_environment_which_overrides_the_file(tmp_path, monkeypatch):
    config = tmp_path / "gateway.toml"
    config.write_text('port = 9001\nkeepalive_s = 2.5\nredis = "redis://file:6379/0"\n[models]\nqwen = "q1"\n')
    monkeypatch.setenv("MILI_PORT", "9002")
    monkeypatch.setenv("MILI_API_KEYS", '["k"]')
    args = build_parser().parse_args(
        ["--config", str(config), "--redis", "redis://flag:6379/0", "--models", '{"a": "qa"}']
    )
    settings = settings_from_args(args)
    assert (settings.redis, settings.port, settings.keepalive_s) == ("redis://flag:6379/0", 9002, 2.5)
    assert settings.api_keys == ["k"]
    assert settings.models == {"qwen": "q1", "a": "qa"}  # a map given twice is merged, the flag's names on top


def test_the_gateway_joins_an_existing_redis_only():
    with pytest.raises(ValidationError, match="no embedded Redis"):
        GatewaySettings(redis="embedded")


@pytest.mark.parametrize("bad", ["", "sk-Zq1 2", " sk-Zq12", "sk-Zq1\u00e92", "sk-Zq1\t2"])
@pytest.mark.parametrize("field", ["api_keys", "admin_api_keys"])
def test_an_api_key_no_client_can_send_is_refused_naming_its_place_only(field, bad):
    """An empty key matched `Authorization: Bearer` with no key at all: the gateway was open."""
    with pytest.raises(ValidationError) as refused:
        GatewaySettings(**{field: ["sk-good-one", bad]})
    assert f"{field}[1] is empty or holds a space" in str(refused.value)
    assert bad.strip() == "" or "Zq" not in str(refused.value)


@pytest.mark.parametrize("bad", ["300.1.1.1", "10.244.0.1/16", "10.0.0.0/33", "ingress.internal", ""])
def test_a_trusted_proxy_that_is_no_address_or_network_is_refused_naming_it(bad):
    """uvicorn keeps such an entry as a literal that no client address ever equals: a network
    written with its host bits set (10.244.0.1/16) or a name trusted nobody, silently, and behind
    that ingress every client was its one address (the failed-attempt limit shared, the board's
    cookie not Secure)."""
    with pytest.raises(ValidationError) as refused:
        GatewaySettings(trusted_proxies=["127.0.0.1", bad])
    assert f"trusted_proxies[1] {bad!r} is not an address, a network or" in str(refused.value)
    kept = ["127.0.0.1", "::1", "10.244.0.0/16", "fd00::/8"]
    assert GatewaySettings(trusted_proxies=kept).trusted_proxies == kept
    assert GatewaySettings(trusted_proxies=["*"]).trusted_proxies == ["*"]


@pytest.mark.parametrize(
    "bad",
    ["https://app.example.com/", "https://app.example.com/chat", "app.example.com", "https://App.example.com", ""],
)
def test_a_cors_origin_no_browser_sends_is_refused_naming_it(bad):
    """CORS grants an Origin header equal to an entry, and a browser's Origin is `scheme://host[:port]`
    in lower case, with no path: an entry with a trailing slash (as a URL is often copied), a path
    or no scheme granted nothing, silently, and the page's every request failed as cross-origin."""
    with pytest.raises(ValidationError) as refused:
        GatewaySettings(cors_origins=["https://ok.example.com", bad])
    assert f"cors_origins[1] {bad!r} is not an origin as a browser sends it" in str(refused.value)
    kept = ["https://ok.example.com", "http://localhost:3000", "http://[::1]:8080"]
    assert GatewaySettings(cors_origins=kept).cors_origins == kept
    assert GatewaySettings(cors_origins=["*"]).cors_origins == ["*"]


def test_pinned_model_queues_must_be_usable_in_keys():
    with pytest.raises(InvalidArgument, match="models"):
        GatewaySettings(models={"m": "{bad}"})


def squat(port: int) -> http.server.HTTPServer:
    """An HTTP server on `port`: another process's socket, answering as a gateway would."""
    squatter = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    return squatter


def test_a_restarted_gateway_whose_port_was_taken_is_not_taken_for_ready(redis_server, tmp_path):
    """The harness restarts a gateway on its port (the test holds its URL); a process that took the
    port meanwhile answers the probe while the gateway fails to bind, and must not pass for it."""
    gateway = GatewayProcess(redis_server.url, tmp_path).start()
    gateway.stop()
    squatter = squat(gateway.port)
    try:
        with pytest.raises(ProcessNotReady, match="exited"):
            gateway.start()
        assert "address already in use" in gateway.log_of_this_start().lower()
    finally:
        squatter.shutdown()
        squatter.server_close()
        gateway.stop()


def test_a_first_start_whose_port_was_taken_meanwhile_moves_to_another(redis_server, tmp_path):
    """free_port() can only say what was free when it asked: a socket that takes the port before
    the gateway binds it (CI met it once) costs the gateway's first start a retry on another port."""
    gateway = GatewayProcess(redis_server.url, tmp_path)
    taken = gateway.port
    squatter = squat(taken)
    try:
        gateway.start()
        assert gateway.port != taken and gateway.url == f"http://127.0.0.1:{gateway.port}"
        assert f"listening on {gateway.url}" in gateway.log_of_this_start()
        assert "address already in use" in gateway.log().lower()  # the first try's
    finally:
        squatter.shutdown()
        squatter.server_close()
        gateway.stop()


def test_a_gateway_on_a_port_another_process_holds_stops_in_one_line_with_exit_code_2(redis_server):
    """uvicorn started the app, logged '[Errno 98] error while attempting to bind on address ...'
    among its start-up and shut-down lines, and exited 3; the worker says its taken metrics port in
    one line, exit code 2 (docs/failure-semantics.md), and so does the gateway now, before it starts."""
    squatter = squat(free_port())
    try:
        port = squatter.server_address[1]
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "--redis", redis_server.url, "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        squatter.shutdown()
        squatter.server_close()
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"error: port_taken: cannot listen on 127.0.0.1:{port} (Address already in use): another process holds "
        "the port. Stop it, or give the gateway another --port (MILI_PORT)\n"
    )


def test_an_abbreviated_flag_is_refused_not_taken_as_the_setting_it_begins(capsys):
    """`--log-lev loud` was `--log-level loud` (argparse takes a flag's prefix by default): a flag
    is given whole, or the gateway says which it does not know."""
    with pytest.raises(SystemExit) as stopped:
        main(["--log-lev", "loud"])
    assert stopped.value.code == 2
    assert "unrecognized arguments: --log-lev loud" in capsys.readouterr().err


def test_a_flag_argparse_cannot_read_is_one_line_as_mili_says_it_and_never_shows_the_value(capsys):
    """argparse printed its usage block (35 lines) before `invalid loads value: '<the text>'`,
    an API key's text included, where mili and the worker say a usage error in one line."""
    for flags, line in (
        (["--models", "notjson"], "argument --models: is not JSON: Expecting value: line 1 column 1 (char 0)"),
        (
            ["--api-keys", "[sk-Zq1secret"],
            "argument --api-keys: is not JSON: Expecting value: line 1 column 2 (char 1)",
        ),
        (["--port", "http"], "argument --port: invalid int value: 'http'"),
    ):
        with pytest.raises(SystemExit) as stopped:
            main(flags)
        assert stopped.value.code == 2
        assert capsys.readouterr().err == f"error: invalid_argument: {line} (see mili-gateway --help)\n"


def test_a_host_that_names_no_address_is_one_line_naming_it_before_uvicorn_starts(capsys):
    """uvicorn started, then logged '[Errno -2] Name or service not known' alone, naming no host,
    and exited 3."""
    assert main(["--host", "no.such.host.invalid", "--redis", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: invalid_argument: host: 'no.such.host.invalid' is no address this host can listen on: ")
        and err.count("\n") == 1
    ), err


@pytest.mark.parametrize(
    "flags, timeout_s",
    [
        (["--wait-replicas", "1", "--wait-timeout-ms", "5000"], 5),  # redis-py's 5 s
        (
            ["--wait-replicas", "1", "--wait-timeout-ms", "900", "--redis", "redis://127.0.0.1:1/0?socket_timeout=0.5"],
            0.5,
        ),
    ],
)
def test_a_wait_as_long_as_the_socket_timeout_is_refused_in_one_line_before_serving(flags, timeout_s, capsys):
    """The gateway's client refused it only once uvicorn started the app: a traceback at start."""
    assert main(flags) == 2
    assert capsys.readouterr().err == (
        f"error: invalid_argument: wait_timeout_ms: must be shorter than the connection's socket_timeout "
        f"({timeout_s:g} s; the URL's ?socket_timeout= sets it)\n"
    )
    assert GatewaySettings(wait_replicas=1, wait_timeout_ms=4999).wait_timeout_ms == 4999


def test_keys_given_in_the_environment_as_no_json_list_are_one_line_saying_so(monkeypatch, capsys):
    """docs/operations.md and compose.yml give the gateway keys as MILI_API_KEYS='["..."]'; a key
    given bare (MILI_API_KEYS=KEY) stopped it with 'error parsing value for field "api_keys" from
    source "EnvSettingsSource"', which names neither the variable nor the JSON list it takes."""
    monkeypatch.setenv("MILI_API_KEYS", "a-bare-key")
    assert main(["--redis", "redis://localhost:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid_argument: api_keys: MILI_API_KEYS is not the JSON") and err.count("\n") == 1
    assert "MILI_API_KEYS='[\"KEY\"]'" in err and "a-bare-key" not in err


@pytest.mark.parametrize("flag", ["--batch-lease-s", "--header-timeout-s", "--job-timeout-s", "--health-timeout-s"])
def test_a_number_setting_that_is_not_finite_is_one_line_before_serving(flag, monkeypatch, capsys):
    """`inf` passed every bound (inf > 0): batch_lease_s ended the gateway with an OverflowError
    traceback, the timeouts never came. As a flag or a variable, as the worker and mili refuse it."""
    setting = flag[2:].replace("-", "_")
    assert main([flag, "inf", "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert capsys.readouterr().err == f"error: invalid_argument: {setting}: Input should be a finite number\n"
    monkeypatch.setenv(f"MILI_{setting.upper()}", "nan")
    assert main(["--redis", "redis://127.0.0.1:1/0"]) == 2
    assert capsys.readouterr().err == f"error: invalid_argument: {setting}: Input should be a finite number\n"
