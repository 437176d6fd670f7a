"""A resolver for svc_common.targets whose answer a test sets (every name gets it),
and which fails, as a DNS outage would, while `fail` is set."""

from __future__ import annotations


class StubDns:
    def __init__(self, *answer: str):
        self.answer = list(answer)
        self.fail = False
        self.queries: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.queries.append((name, port))
        if self.fail:
            raise OSError(f"lookup of {name} failed")
        return list(self.answer)
