"""The tiers (tests/tiers.py): a quick test that starts a process fails, naming it; a test
reading this process's state is put in its kind's xdist group."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from processes import QUIET_PLUGINS, live_children, open_descriptors

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project whose conftest registers the tiers as this project's tests/conftest.py does."""
    pytester.makeconftest(
        f"""
        import sys

        sys.path.append({str(TESTS)!r})  # last: tests/bridge must not hide the package
        import tiers

        def pytest_configure(config):
            config.pluginmanager.register(tiers, "tiers")
        """
    )
    pytester.makeini("[pytest]\nmarkers =\n    quick: starts no process\n")
    return pytester


NGINX = "#!/bin/sh\nexit 0\n"


def test_a_quick_test_that_starts_a_process_fails_naming_it_and_the_phase(
    project: pytest.Pytester,
) -> None:
    nginx = project.path / "bin" / "nginx"
    nginx.parent.mkdir()
    nginx.write_text(NGINX)
    nginx.chmod(0o755)
    project.makepyfile(
        textwrap.dedent(
            f"""
            import asyncio, subprocess, sys
            import pytest

            NGINX = {str(nginx)!r}

            @pytest.fixture
            def started():
                subprocess.run(["true"], check=True)

            @pytest.mark.quick
            def test_runs_true():
                subprocess.run(["true"], check=True)

            @pytest.mark.quick
            def test_uses_a_fixture_that_starts_one(started):
                pass

            @pytest.mark.quick
            def test_starts_one_through_asyncio():
                async def main():
                    child = await asyncio.create_subprocess_exec("true")
                    await child.wait()
                asyncio.run(main())

            @pytest.mark.quick
            def test_checks_an_nginx_configuration():
                subprocess.run([NGINX, "-t", "-c", "/dev/null"], check=True)

            @pytest.mark.quick
            def test_starts_nginx():
                subprocess.run([NGINX, "-c", "/dev/null"], check=True)

            @pytest.fixture
            def joined():
                children = []
                yield children
                for child in children:
                    child.join()
                    child.close()

            @pytest.mark.quick
            def test_starts_one_through_multiprocessing(joined):
                import multiprocessing
                child = multiprocessing.get_context("spawn").Process(target=print)
                child.start()
                joined.append(child)

            @pytest.mark.quick
            def test_starts_nothing():
                pass

            def test_not_quick_runs_true():
                subprocess.run(["true"], check=True)
            """
        )
    )
    # In a process of its own: multiprocessing leaves its resource tracker running there.
    result = project.runpytest_subprocess("-p", "no:cacheprovider", *QUIET_PLUGINS, "-rfE")
    result.assert_outcomes(passed=3, failed=4, errors=1)
    fails = "a quick test started 1 process(es) in its"
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at setup of test_uses_a_fixture_that_starts_one _*",
            f"{fails} setup: true. A quick test runs everything in the test process*",
            "*_ test_runs_true _*",
            f"{fails} call: true. *",
            "*_ test_starts_one_through_asyncio _*",
            f"{fails} call: true. *",
            "*_ test_starts_nginx _*",
            f"{fails} call: {nginx} -c /dev/null. *",
            "*_ test_starts_one_through_multiprocessing _*",
            # The child, and the resource tracker the spawn starts first (the child may be
            # caught before its exec, or after its exit: "pid N" then).
            "a quick test started * process(es) in its call: *multiprocessing*",
        ]
    )


def test_a_test_calling_live_children_is_in_the_children_group(
    request: pytest.FixtureRequest,
) -> None:
    assert isinstance(live_children(), set)
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None
    assert marker.args == ("process-children",)


def test_a_test_counting_descriptors_is_in_the_descriptors_group(
    request: pytest.FixtureRequest,
) -> None:
    assert open_descriptors() > 0
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None
    assert marker.args == ("process-descriptors",)


@pytest.mark.quick
def test_a_test_reading_nothing_of_its_process_is_in_no_group(
    request: pytest.FixtureRequest,
) -> None:
    assert request.node.get_closest_marker("xdist_group") is None


def test_each_xdist_group_runs_on_one_worker(project: pytest.Pytester) -> None:
    # `--dist loadgroup` sends a group to one worker. pytest-xdist marks a test's group in
    # its node id, which pytest 9.2 no longer lets a plugin change: the groups were then
    # shared out like any test, silently (pyproject.toml keeps pytest below 9.2).
    log = project.path / "ran.log"
    tests = "\n".join(
        f"""
        @pytest.mark.xdist_group("{group}")
        def test_{group}_{index}():
            with open({str(log)!r}, "a") as f:
                f.write("{group} " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        """
        for group in ("first", "second")
        for index in range(6)
    )
    project.makepyfile(test_groups="import os\nimport pytest\n" + textwrap.dedent(tests))
    result = project.runpytest_subprocess(
        "-p", "no:cacheprovider", *QUIET_PLUGINS, "-n", "2", "--dist", "loadgroup"
    )
    result.assert_outcomes(passed=12)
    workers: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        group, worker = line.split()
        workers.setdefault(group, set()).add(worker)
    assert set(workers) == {"first", "second"}
    assert all(len(ran_on) == 1 for ran_on in workers.values()), workers
