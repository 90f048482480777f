"""The project's tests use the fixtures host teams get: those of `scenarios.pytest_plugin`.

Installed (as `make` does, editable), the package registers the plugin through its
`pytest11` entry point, whose name is the module's own, so this line then does nothing;
from a bare checkout (or with PYTEST_DISABLE_PLUGIN_AUTOLOAD) it registers it.
"""

pytest_plugins = ["scenarios.pytest_plugin"]
