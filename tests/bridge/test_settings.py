"""One model for every REST_ADAPTER_* variable (bridge.settings): one rule for integers,
unknown variables found from the model, and docs/API.md's tables checked against it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.cli import main
from bridge.limits import ReplicaSettingsError, RestLimits, RestLimitsEnvError
from bridge.settings import BridgeSettings, LimitVariables, ReplicaVariables, variable_name

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "API.md"

INTEGER_VARIABLES = sorted(
    variable
    for name, variable in BridgeSettings.variables().items()
    if BridgeSettings.model_fields[name].annotation is int
)
#: What int() takes and the docs' rule does not: whitespace, a sign, an underscore, and
#: digits of another script (here full-width).
NOT_ASCII_DIGITS = [" 5", "+5", "1_0", "\uff15"]


def test_every_limit_and_the_drain_timeout_are_integer_variables():
    limits = {RestLimits.env_variable(name) for name in LimitVariables.model_fields}
    assert set(INTEGER_VARIABLES) == limits | {"REST_ADAPTER_DRAIN_TIMEOUT_MS"}


@pytest.mark.parametrize("raw", NOT_ASCII_DIGITS)
@pytest.mark.parametrize("variable", INTEGER_VARIABLES)
def test_serve_refuses_an_integer_that_is_not_plain_ascii_digits(
    variable, raw, monkeypatch, capsys
):
    """Refused before anything starts. (An address no host has: were the value taken,
    serve would fail to listen instead, with another message.)"""
    monkeypatch.setenv(variable, raw)
    assert main(["serve", "--host", "256.0.0.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == f"rest-bridge: {variable}={raw!r} is not a valid positive integer\n"


@pytest.mark.parametrize(
    ("variable", "raw"),
    [("REST_ADAPTER_DRAIN_TIMEOUT_MS", "+5"), ("REST_ADAPTER_EVENT_BUFFER", "lots")],
)
def test_the_console_script_refuses_a_value_that_is_not_a_positive_integer(
    tmp_path: Path, variable: str, raw: str
):
    """The installed `rest-bridge`, not only `main()`: exit 2 and the one line."""
    script = Path(sys.executable).with_name("rest-bridge")
    done = subprocess.run(
        [str(script), "serve", "--host", "256.0.0.1", "--port", "0"],
        env={variable: raw, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert f"{variable}={raw!r} is not a valid positive integer" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("raw", NOT_ASCII_DIGITS)
def test_the_drain_timeout_follows_the_limits_rule(raw):
    with pytest.raises(ReplicaSettingsError, match="REST_ADAPTER_DRAIN_TIMEOUT_MS"):
        ReplicaVariables.from_env({"REST_ADAPTER_DRAIN_TIMEOUT_MS": raw}).replica()


def test_a_value_too_long_to_be_a_number_is_named_not_repeated_in_full():
    """More digits than Python converts, and a value of any length: one short line."""
    digits = "7" * 5000
    with pytest.raises(RestLimitsEnvError) as raised:
        LimitVariables.from_env({"REST_ADAPTER_MAX_SESSIONS": digits}).limits()
    assert raised.value.value == digits
    assert (
        str(raised.value)
        == f"REST_ADAPTER_MAX_SESSIONS={'7' * 80!r} is not a valid positive integer"
    )
    with pytest.raises(ReplicaSettingsError) as drained:
        ReplicaVariables.from_env({"REST_ADAPTER_DRAIN_TIMEOUT_MS": digits}).replica()
    assert len(str(drained.value)) < 200


def test_names_are_case_sensitive():
    assert BridgeSettings.from_env({"rest_adapter_max_sessions": "zz"}) == BridgeSettings()
    assert BridgeSettings.unknown_variables({"rest_adapter_max_sessions": "1"}) == []


def test_unknown_variables_come_from_the_model():
    known = {variable: "1" for variable in BridgeSettings.variables().values()}
    env = {**known, "REST_ADAPTER_MAX_SESION": "3", "REST_ADAPTER_TOKN_FILE": "/x", "HOME": "/"}
    assert BridgeSettings.unknown_variables(env) == [
        "REST_ADAPTER_MAX_SESION",
        "REST_ADAPTER_TOKN_FILE",
    ]


def test_every_variable_the_bridge_names_is_in_the_model():
    """A REST_ADAPTER_* name written anywhere in bridge/ (read, set or documented) is a
    field of the model, or serve would call it unknown."""
    known = set(BridgeSettings.variables().values())
    for source in sorted((ROOT / "bridge").rglob("*.py")):
        for name in re.findall(r"REST_ADAPTER_[A-Z][A-Z_]*[A-Z]", source.read_text()):
            assert name in known, f"{source.relative_to(ROOT)}: {name}"


def test_secrets_stay_out_of_the_repr():
    settings = BridgeSettings.from_env(
        {"REST_ADAPTER_TOKEN": "s3cret-bearer", "REST_ADAPTER_APP_SERVER_TOKEN": "s3cret-ws"}
    )
    assert settings.token == "s3cret-bearer"
    assert "s3cret" not in repr(settings)
    assert "s3cret" not in str(settings)


def test_the_first_bad_variable_in_the_models_order_is_reported():
    env = {"REST_ADAPTER_PEERS": "nonsense", "REST_ADAPTER_EVENT_BUFFER": "lots"}
    with pytest.raises(RestLimitsEnvError, match="REST_ADAPTER_EVENT_BUFFER"):
        BridgeSettings.from_env(env)


# -- docs/API.md --------------------------------------------------------------------------


def documented_variables() -> dict[str, str]:
    """Variable → its Default cell, from every table of docs/API.md's Limits section."""
    text = API.read_text(encoding="utf-8")
    section = text[text.index("\n## Limits\n") :]
    section = section[: section.index("\n## ", 1)]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = (
            re.fullmatch(r"`(REST_ADAPTER_[A-Z_]+)`", cells[0]) if line.startswith("|") else None
        )
        if match:
            assert match[1] not in rows, f"{match[1]} has two rows"
            assert len(cells) >= 3, f"{match[1]} has no description"
            assert cells[2], f"{match[1]} has no description"
            rows[match[1]] = cells[1]
    return rows


def shown_default(name: str) -> str:
    default = BridgeSettings.model_fields[name].get_default(call_default_factory=True)
    return "-" if default is None or default == frozenset() or default == {} else str(default)


def test_the_docs_have_one_row_per_variable_with_its_default():
    documented = documented_variables()
    model = {variable_name(name): shown_default(name) for name in BridgeSettings.model_fields}
    assert set(documented) - set(model) == set(), "rows that name no variable"
    assert set(model) - set(documented) == set(), "variables without a row"
    assert documented == model


def test_every_field_has_a_one_line_description():
    for name, field in BridgeSettings.model_fields.items():
        assert field.description, name
        assert "\n" not in field.description, name


def test_the_bearer_token_comes_from_its_variable_or_its_file(tmp_path: Path):
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    by_file = BridgeSettings.from_env({"REST_ADAPTER_TOKEN_FILE": str(secret)})
    assert by_file.bearer_token() == "from-a-file"
    assert BridgeSettings.from_env({"REST_ADAPTER_TOKEN": "t"}).bearer_token() == "t"
    assert BridgeSettings.from_env({}).bearer_token() is None
    both = BridgeSettings.from_env(
        {"REST_ADAPTER_TOKEN": "t", "REST_ADAPTER_TOKEN_FILE": str(secret)}
    )
    with pytest.raises(ValueError, match="are both set") as raised:
        both.bearer_token()
    assert "from-a-file" not in str(raised.value)
