"""One preflight check's outcome: what was checked, how it went, and the exact fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def skipped(name: str, why: str) -> Check:
    return Check(name, SKIP, why)
