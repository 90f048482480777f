import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.limits import RestLimits, RestLimitsEnvError
from bridge.settings import LimitVariables

CONTRACT_DEFAULTS = {
    "MAX_SESSIONS": 64,
    "MAX_BODY_BYTES": 1048576,
    "CALL_TIMEOUT_MS": 60000,
    "TEXT_TURN_TIMEOUT_MS": 600000,
    "SPAWN_TIMEOUT_MS": 15000,
    "MAX_WAIT_MS": 30000,
    "EVENT_BUFFER": 4096,
    "SESSION_IDLE_TIMEOUT_MS": 1800000,
    "SSE_KEEPALIVE_MS": 15000,
    "MAX_CONCURRENT_TEXT_TURNS": 8,
    "MAX_LINE_BYTES": 16777216,
    "SHUTDOWN_GRACE_MS": 3000,
    # The project's own additions, documented with the others.
    "EVENT_BUFFER_BYTES": 33554432,
    "BODY_TIMEOUT_MS": 30000,
    "READER_STALL_MS": 10000,
    "MAX_HEADER_BYTES": 32768,
    "HEADER_TIMEOUT_MS": 10000,
    "LIVENESS_INTERVAL_MS": 10000,
    "LIVENESS_TIMEOUT_MS": 20000,
}


@pytest.mark.quick
def test_defaults_are_the_contracts():
    limits = LimitVariables.from_env({}).limits()
    assert {f.name.upper(): getattr(limits, f.name) for f in dataclasses.fields(limits)} == (
        CONTRACT_DEFAULTS
    )


@pytest.mark.quick
def test_every_limit_is_read_from_its_variable():
    env = {f"REST_ADAPTER_{name}": str(value + 1) for name, value in CONTRACT_DEFAULTS.items()}
    limits = LimitVariables.from_env(env).limits()
    for name, value in CONTRACT_DEFAULTS.items():
        assert getattr(limits, name.lower()) == value + 1


@pytest.mark.quick
def test_unrelated_variables_are_ignored():
    assert (
        LimitVariables.from_env({"REST_ADAPTER_TOKEN": "x", "MAX_SESSIONS": "zz"}).limits()
        == RestLimits()
    )


@pytest.mark.quick
@pytest.mark.parametrize("value", ["abc", "1.5", "", "0", "-3", "12kb"])
def test_unparsable_value_names_variable_value_and_type(value):
    with pytest.raises(RestLimitsEnvError) as info:
        LimitVariables.from_env({"REST_ADAPTER_MAX_SESSIONS": value}).limits()
    error = info.value
    assert error.variable == "REST_ADAPTER_MAX_SESSIONS"
    assert error.value == value
    assert error.expected == "positive integer"
    assert "REST_ADAPTER_MAX_SESSIONS" in str(error)
    assert repr(value) in str(error)


@pytest.mark.quick
@pytest.mark.parametrize("raw", [" 5 ", "+5", "1_000", "\u0665", "5\n"])
def test_only_plain_ascii_digits_are_a_limit(raw):
    with pytest.raises(RestLimitsEnvError):
        LimitVariables.from_env({"REST_ADAPTER_MAX_SESSIONS": raw}).limits()


@pytest.mark.quick
def test_a_misspelt_variable_is_named_and_changed_limits_are_listed():
    env = {
        "REST_ADAPTER_MAX_SESION": "3",
        "REST_ADAPTER_TOKEN": "t",
        "REST_ADAPTER_MAX_SESSIONS": "4",
    }
    assert RestLimits.unknown_variables(env, frozenset({"REST_ADAPTER_TOKEN"})) == [
        "REST_ADAPTER_MAX_SESION"
    ]
    assert LimitVariables.from_env(env).limits().changed() == {"REST_ADAPTER_MAX_SESSIONS": 4}


def test_serve_help_names_every_variable_an_operator_sets():
    from bridge.process.descendants import MARK_VARIABLE
    from bridge.settings import BridgeSettings

    script = Path(sys.executable).with_name("rest-bridge")
    done = subprocess.run(
        [str(script), "serve", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    text = " ".join(done.stdout.split())  # argparse folds lines
    # set by rest-bridge itself
    internal = {"REST_ADAPTER_CLUSTER_MARK", "REST_ADAPTER_BRIDGE_MARK", MARK_VARIABLE}
    for variable in sorted(set(BridgeSettings.variables().values()) - internal):
        assert variable in text, variable
    for field in dataclasses.fields(RestLimits):
        assert RestLimits.env_variable(field.name) in text
