"""What a bearer-token check costs, for a match and for each kind of mismatch.

Spec section 5: the comparison must take the same time wherever the values differ,
and must not stop early on a length mismatch. `bridge.auth.BearerToken.matches`
hashes the presented value and compares SHA-256 digests with `hmac.compare_digest`,
so what varies is only the hashing of the caller's own bytes. This measures the whole
check (`presented_token` + `matches`) on a realistic header, per case:

    .venv/bin/python -m bench.auth_timing [--number 200000] [--repeats 9]

prints a table; `tests/reliability/report.py` puts it in docs/RELIABILITY.md. A
benchmark, not a test: nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from bridge.auth import BearerToken, presented_token

SECRET = "3b9f6c1e0a7d4f28b5c2e9a1d6f04c7b8e2a5d9f1c3b7e60"

#: Presented tokens. The first five have the secret's length; "shorter" and "longer"
#: differ from it by one character, so all seven hash about as many bytes.
CASES = {
    "match": SECRET,
    "mismatch in the first character": "X" + SECRET[1:],
    "mismatch in the middle": SECRET[:24] + "X" + SECRET[25:],
    "mismatch in the last character": SECRET[:-1] + "X",
    "every character wrong": "X" * len(SECRET),
    "one character shorter": SECRET[:-1],
    "one character longer": SECRET + "X",
    "empty (missing header)": "",
}


def measure(number: int = 200_000, repeats: int = 9) -> dict[str, dict[str, float]]:
    """Median and spread, in nanoseconds per check, for each case.

    Each round times every case once, in a rotated order, so that whatever else the
    machine is doing weighs on all cases alike.
    """
    token = BearerToken(SECRET)
    checks = {}
    for name, presented in CASES.items():
        header = f"Bearer {presented}" if presented else ""

        def check(header: str = header) -> bool:
            return token.matches(presented_token(header))

        assert check() is (presented == SECRET)
        checks[name] = check
    names = list(checks)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = timeit.timeit(checks[name], number=number)
            runs[name].append(seconds / number * 1e9)
    return {
        name: {
            "median_ns": statistics.median(values),
            "min_ns": min(values),
            "max_ns": max(values),
        }
        for name, values in runs.items()
    }


def table(results: dict[str, dict[str, float]]) -> str:
    reference = results["match"]["median_ns"]
    lines = [
        "| presented token | median ns/check | min | max | vs. match |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, figures in results.items():
        lines.append(
            f"| {name} | {figures['median_ns']:.0f} | {figures['min_ns']:.0f} | "
            f"{figures['max_ns']:.0f} | {figures['median_ns'] / reference - 1:+.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print(table(measure(args.number, args.repeats)))


if __name__ == "__main__":
    main()
