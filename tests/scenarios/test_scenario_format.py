"""The scenario format: the library validates, the schema agrees, bad files say where."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic_core import PydanticUndefined

from fakes.app_server import script as fake_script
from scenarios.format import ScenarioError, load_scenario, parse_scenario
from scenarios.schema import scenario_schema

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = sorted((ROOT / "scenarios" / "library").glob("*.scenario.yaml"))
REST_BRIDGE = str(Path(sys.executable).with_name("rest-bridge"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = scenario_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.quick
def test_the_library_has_a_scenario_for_each_feature() -> None:
    text = "\n".join(path.read_text() for path in LIBRARY)
    for feature in (
        "createSession:", "call:", "http:", "poll:", "stream:", "read:", "close:",
        "reply:", "await:", "background:", "until:", "capture:", "lastEventId:",
        "json:", "jsonSubset:", "jsonPath:", "headers:", "body:", "error:",
        "$regex", "$type", "$absent", "$contains",
        "events:", "subsequence:", "absent:", "kinds:", "ids:", "quietMs:", "toEnd:",
        "token:", "auth: false", "limits:", "preset: default", "preset: text-turn",
        "model:", "appServer:", "onReply:", "sleep:", "exit:", "raw:", "stderr:",
    ):  # fmt: skip
        assert feature in text, f"no library scenario uses {feature}"


@pytest.mark.quick
@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.name)
def test_library_scenarios_load_and_match_the_schema(path: Path, validator) -> None:
    loaded = load_scenario(path)
    assert loaded.scenario.steps
    errors = sorted(validator.iter_errors(yaml.safe_load(path.read_text())), key=str)
    assert not errors, f"{path.name}: {errors[0].message} at {list(errors[0].absolute_path)}"


@pytest.mark.quick
def test_the_schema_rejects_what_the_models_reject(validator) -> None:
    bad = {"scenario": 1, "steps": [{"teleport": {"to": "/v1"}}]}
    assert list(validator.iter_errors(bad))
    with pytest.raises(ScenarioError):
        parse_scenario(bad)
    assert list(validator.iter_errors({"scenario": 2, "steps": [{"close": "x"}]}))


@pytest.mark.quick
def test_the_schema_accepts_the_fake_script_shorthands(validator) -> None:
    document = {
        "scenario": 1,
        "appServer": {
            "version": 1,
            "methods": {"x/one": {"result": 1}, "x/list": [{"result": 1}, {}]},
            "turns": [
                "Just text.",
                {
                    "steps": [
                        {"agentMessage": "hi"},
                        {"completeTurn": None},
                        {"stall": True},
                        {"spawnChild": True},
                        {"exit": 3},
                    ]
                },
            ],
            "onInitialized": [{"respond": None}, {"respondTwice": True}],
        },
        "steps": [{"http": {"path": "/health"}}],
    }
    parse_scenario(document)
    assert not list(validator.iter_errors(document))


@pytest.mark.quick
def test_every_fake_script_shorthand_says_what_it_accepts() -> None:
    """A "before" validator in the fake's models must declare its input type, so the
    generated schema documents the shorthand (test_the_schema_accepts_... checks it)."""
    for model in vars(fake_script).values():
        if not (isinstance(model, type) and issubclass(model, fake_script.BaseModel)):
            continue
        decorators = model.__pydantic_decorators__
        for validator in decorators.field_validators.values():
            if validator.info.mode == "before":
                declared = validator.info.json_schema_input_type
                assert declared is not PydanticUndefined, (model.__name__, validator.info.fields)
        for name, validator in decorators.model_validators.items():
            assert validator.info.mode != "before" or name == "_reject_boolean_keys", (model, name)


def test_the_schema_command_prints_the_generated_schema() -> None:
    done = subprocess.run(
        [REST_BRIDGE, "scenarios", "schema"], capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == scenario_schema()


# -- malformed files ------------------------------------------------------------------------

MALFORMED = {
    "invalid-yaml": (
        """
        scenario: 1
        steps:
          - http: {path: /health
        """,
        [":5:", "invalid YAML"],
    ),
    "not-a-scenario": ("version: 1\nturns: []\n", [":1:", "not a scenario", "scenario: 1"]),
    "unknown-step": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
          - teleport: {to: /v1}
        """,
        [":5:", "steps[1]", "unknown step kind 'teleport'; a step's kind is one of await, call"],
    ),
    "misspelt-step": (
        """
        scenario: 1
        steps:
          - creatSession: s
        """,
        [
            ":4:",
            "steps[0]: unknown step kind 'creatSession' (did you mean 'createSession'?); "
            "a step's kind is one of await, call, close, createSession, http, poll, read, "
            "reply, stream",
        ],
    ),
    "two-step-kinds": (
        """
        scenario: 1
        steps:
          - {http: {path: /health}, poll: {session: s}}
        """,
        [":4:", "steps[0]: a step has exactly one kind; this one has http, poll"],
    ),
    "unknown-key": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            expect: {stauts: 200}
        """,
        [":5:", "steps[0].expect.stauts", "Extra inputs are not permitted"],
    ),
    "unknown-matcher": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            expect:
              json: {status: {$regx: ok}}
        """,
        [":6:", "unknown matcher operator $regx"],
    ),
    "bad-regex": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            expect: {body: {$regex: "(unclosed"}}
        """,
        [":5:", "invalid regular expression"],
    ),
    "bad-jsonpath": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            capture: {v: "$..[?("}
        """,
        [":5:", "invalid JSONPath"],
    ),
    "undefined-variable": (
        """
        scenario: 1
        steps:
          - createSession: s
          - call:
              session: "${s}"
              method: turn/start
              params: {threadId: "${thread}"}
            capture: {thread: $.result.thread.id}
        """,
        [":8:", "${thread} is not defined here", "defined so far: base, s, tmp, token"],
    ),
    "stream-not-open": (
        """
        scenario: 1
        steps:
          - createSession: s
          - read: {stream: events, count: 1}
        """,
        [":5:", "stream 'events' is not open here"],
    ),
    "await-without-background": (
        """
        scenario: 1
        steps:
          - await: slow
        """,
        [":4:", "no request named 'slow' was sent in the background"],
    ),
    "background-with-expect": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            background: h
            expect: {status: 200}
        """,
        [":4:", "checked by its `await` step; move `expect` there"],
    ),
    "bad-app-server-section": (
        """
        scenario: 1
        appServer:
          version: 1
          turns:
            - steps:
                - agentMessage: fine
                - commandApproval: {command: ls, colour: red}
        steps:
          - http: {path: /health}
        """,
        [":8:", "appServer.turns[0].steps[1].commandApproval.colour", "Extra inputs"],
    ),
    "misspelt-app-server-step": (
        """
        scenario: 1
        appServer:
          version: 1
          turns:
            - steps:
                - comandApproval: {command: ls}
                  onReply: {accept: []}
        steps:
          - http: {path: /health}
        """,
        [
            ":7:11:",
            "appServer.turns[0].steps[0]: unknown step kind 'comandApproval' (did you mean "
            "'commandApproval'?); a step's kind is one of agentMessage, bigLine, "
            "commandApproval, completeTurn,",
        ],
    ),
    "misspelt-reply-branch": (
        """
        scenario: 1
        appServer:
          version: 1
          turns:
            - steps:
                - commandApproval: {command: ls}
                  onReply: {decilne: [{agentMessage: declined}]}
        steps:
          - http: {path: /health}
        """,
        [
            ":8:",
            "appServer.turns[0].steps[0].onReply: 'decilne' is no reply's key (did you mean "
            "'decline'?)",
        ],
    ),
    "misspelt-event-key": (
        """
        scenario: 1
        steps:
          - createSession: s
          - poll: {session: "${s}", through: {knd: request}}
        """,
        [":5:", "steps[1].poll.through: an event has no key 'knd' (did you mean 'kind'?)"],
    ),
    "limit-as-a-string": (
        """
        scenario: 1
        bridge:
          limits: {maxSessions: "2"}
        steps:
          - http: {path: /health}
        """,
        [":4:", "bridge.limits.maxSessions: Input should be a valid integer"],
    ),
    "timeout-as-a-float": (
        """
        scenario: 1
        timeoutMs: 1.0
        steps:
          - http: {path: /health, timeoutMs: 5e3}
        """,
        [
            ":3:1: timeoutMs: Input should be a valid integer",
            ":5:",
            "steps[0].http.timeoutMs: Input should be a valid integer",
        ],
    ),
    "both-backends": (
        """
        scenario: 1
        appServer: {version: 1}
        model: {replies: [{text: hi}]}
        steps:
          - http: {path: /health}
        """,
        ["not both"],
    ),
    "bad-status": (
        """
        scenario: 1
        steps:
          - http: {path: /health}
            expect: {status: two hundred}
        """,
        [":5:", "a status is a number"],
    ),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_file_names_the_file_the_line_and_the_problem(
    case: str, tmp_path: Path
) -> None:
    text, expected = MALFORMED[case]
    path = tmp_path / f"{case}.scenario.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(ScenarioError) as raised:
        load_scenario(path)
    message = str(raised.value)
    for fragment in expected:
        fragment = fragment.replace(":", f"{path}:", 1) if fragment.startswith(":") else fragment
        assert fragment in message, message
