"""Made-up content for scripts that leave it out: agent text, commands, file paths.

Plausible and varied (Faker words and sentences in shapes a coding agent produces),
and reproducible: with a seed, the same script makes the same content in the same
order. Faker is imported on first use only; it is slow to import.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from faker import Faker

_DIRECTORIES = ("src", "tests", "docs", "scripts", "lib", "app", "tools")
_EXTENSIONS = ("py", "ts", "md", "json", "toml", "yaml", "rs", "go", "txt")
_COMMANDS = (
    "ls -la {dir}",
    "cat {file}",
    "sed -n '1,{lines}p' {file}",
    'rg -n "{word}" {dir}',
    "pytest -q tests/test_{word}.py",
    "git status --short",
    "git diff --stat",
    "git log --oneline -n {count}",
    "wc -l {file}",
    "python -m {word} --help",
    "mkdir -p {dir}/{word}",
    "head -n {lines} {file}",
    "npm test -- {word}",
    "find {dir} -name '*.{ext}'",
)


class Invented:
    """A seeded source of made-up agent content."""

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._faker: Faker | None = None

    @property
    def faker(self) -> Faker:
        """The Faker instance, seeded like the server."""
        if self._faker is None:
            from faker import Faker

            self._faker = Faker()
            if self._seed is not None:
                self._faker.seed_instance(self._seed)
        return self._faker

    def sentences(self, count: int | None = None) -> str:
        """`count` sentences of text (1 to 3 when not given)."""
        if count is None:
            count = self.faker.random_int(1, 3)
        return " ".join(self.faker.sentence() for _ in range(count))

    def _word(self) -> str:
        return str(self.faker.word()).lower()

    def relative_file(self) -> str:
        """A file path such as `src/answer_light.py`."""
        directory = self.faker.random_element(_DIRECTORIES)
        extension = self.faker.random_element(_EXTENSIONS)
        return f"{directory}/{self._word()}_{self._word()}.{extension}"

    def path(self, cwd: str) -> str:
        """An absolute path of a file under `cwd`."""
        return os.path.join(cwd, self.relative_file())

    def command(self) -> str:
        """A shell command a coding agent might run."""
        template = self.faker.random_element(_COMMANDS)
        return template.format(
            dir=self.faker.random_element(_DIRECTORIES),
            file=self.relative_file(),
            word=self._word(),
            ext=self.faker.random_element(_EXTENSIONS),
            lines=self.faker.random_element((20, 40, 80, 120, 200)),
            count=self.faker.random_int(3, 20),
        )
