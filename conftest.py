"""The project's tests use the fixtures host teams get: those of `scenarios.pytest_plugin`.

Installed (as `make` does, editable), the package registers the plugin through its
`pytest11` entry point, whose name is the module's own, so this line then does nothing;
from a bare checkout (or with PYTEST_DISABLE_PLUGIN_AUTOLOAD) it registers it.
"""

import pytest

pytest_plugins = ["scenarios.pytest_plugin"]

#: A test's limit unless it sets its own (`@pytest.mark.timeout(N)`).
TIMEOUT_SECONDS = 120


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test gets TIMEOUT_SECONDS from pytest-timeout (the `test` extra).

    Set here rather than as `timeout` in pyproject.toml, which pytest reads for any run in
    this checkout: with the `harness` extra alone (no pytest-timeout), an unknown option
    there stops `rest-bridge scenarios run` before it starts.
    """
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_SECONDS))
