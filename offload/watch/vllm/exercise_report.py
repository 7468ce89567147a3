"""What ``kvlife vllm exercise`` reports: one run's outcome (``RunResult``) and a
family's runs summed up (``FamilyReport``: each kind of failure, how often, and one seed
that reproduces it, with the ``kvlife audit why`` command for a verdict's rid)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    """One seeded run of one family."""

    family: str
    seed: int
    steps: int
    #: the audit log of the run
    log: str
    #: vLLM's or the connector's exception, ``Type: message``, and where it was raised
    raised: str | None = None
    raised_at: str | None = None
    #: requests vLLM still held after the drain (none of them moved in its last
    #: ``STALL_STEPS`` steps)
    undrained: list[str] = field(default_factory=list)
    #: steps vLLM took to drain after the workload
    drain_steps: int = 0
    #: device blocks not back in vLLM's free pool at the end
    leaked_blocks: int = 0
    #: the audit log's verdicts: kind -> the rids they name, in order
    verdicts: dict[str, list[str]] = field(default_factory=dict)
    #: a verdict's log when it is not ``log`` (kvlife's own connector keeps a log too)
    verdict_logs: dict[str, str] = field(default_factory=dict)
    #: what the run did: requests (lifecycles), copies the wrapper saw (stores, loads,
    #: delayed frees), aborts, preemptions, ids registered again while their earlier
    #: lifecycle was not released
    lifecycles: int = 0
    copies: int = 0
    aborts: int = 0
    preemptions: int = 0
    reuses: int = 0
    #: preempted requests scheduled again (V1: resumed ids; V2: new request data)
    resumes: int = 0
    #: the shape of vLLM's scheduler output it ran under (``v1``, ``v2``)
    runner: str = "v1"
    #: copies still open when the run stopped on ``raised``: no verdict on anyone (the
    #: run, not the connector, stopped them), counted here instead of as ``unreported``
    open_at_raise: int = 0

    @property
    def failed(self) -> bool:
        return bool(self.raised or self.undrained or self.leaked_blocks or self.verdicts)

    def describe(self) -> str:
        """One line per failure of the run."""
        lines = []
        if self.raised:
            lines.append(f"raised {self.raised} at {self.raised_at}")
            if self.open_at_raise:
                lines.append(f"{self.open_at_raise} copies open when it raised (no verdict)")
        if self.undrained:
            lines.append(
                f"never drained: vLLM still holds {self.undrained} after {self.drain_steps} "
                "drain steps"
            )
        if self.leaked_blocks:
            lines.append(f"{self.leaked_blocks} device block(s) never came back")
        for kind, rids in self.verdicts.items():
            where = self.verdict_logs.get(kind, self.log)
            lines.append(f"verdict {kind} on {rids[0]!r}: {why_command(where, rids[0])}")
        return "; ".join(lines) or "clean"


def why_command(log: str, rid: str) -> str:
    """The command that tells ``rid``'s story from ``log``."""
    return f"kvlife audit why {log} --rid {rid}"


@dataclass
class FamilyReport:
    """A family's runs, summed up: each kind of failure with how often and one seed that
    reproduces it."""

    family: str
    what: str
    #: the shape of vLLM's scheduler output its runs ran under (``v1``, ``v2``)
    runner: str = "v1"
    runs: int = 0
    failed: int = 0
    #: what the runs did, summed (see ``RunResult``)
    lifecycles: int = 0
    copies: int = 0
    aborts: int = 0
    preemptions: int = 0
    reuses: int = 0
    resumes: int = 0
    #: where the runs failed, the runners the same family was clean under (a failure
    #: only this shape of vLLM's output shows)
    clean_under: list[str] = field(default_factory=list)
    #: ``Type at where`` -> (runs, the first seed, its ``Type: message``)
    raises: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    #: (runs, the first seed, its blocks) of leaked device blocks
    leaks: tuple[int, int, int] | None = None
    #: (runs, the first seed, its rids) of requests never drained
    undrained: tuple[int, int, list[str]] | None = None
    #: kind -> (runs, the first seed, an rid it names, the why command)
    verdicts: dict[str, tuple[int, int, str, str]] = field(default_factory=dict)

    def add(self, run: RunResult) -> None:
        self.runs += 1
        self.lifecycles += run.lifecycles
        self.copies += run.copies
        self.aborts += run.aborts
        self.preemptions += run.preemptions
        self.reuses += run.reuses
        self.resumes += run.resumes
        if not run.failed:
            return
        self.failed += 1
        if run.raised:
            key = f"{run.raised.split(':', 1)[0]} at {run.raised_at}"
            count, seed, text = self.raises.get(key, (0, run.seed, run.raised))
            self.raises[key] = (count + 1, seed, text)
        if run.leaked_blocks:
            count, seed, blocks = self.leaks or (0, run.seed, run.leaked_blocks)
            self.leaks = (count + 1, seed, blocks)
        if run.undrained:
            count, seed, rids = self.undrained or (0, run.seed, run.undrained)
            self.undrained = (count + 1, seed, rids)
        for kind, rids in run.verdicts.items():
            where = run.verdict_logs.get(kind, run.log)
            count, seed, rid, why = self.verdicts.get(
                kind, (0, run.seed, rids[0], why_command(where, rids[0]))
            )
            self.verdicts[kind] = (count + 1, seed, rid, why)

    def lines(self) -> list[str]:
        lines = [
            f"{self.family}, runner {self.runner.upper()}: {self.runs} runs, {self.failed} "
            f"failed ({self.what})",
            f"  did: {self.lifecycles} requests, {self.copies} copies, {self.aborts} aborts, "
            f"{self.preemptions} preemptions, {self.resumes} resumes, {self.reuses} ids "
            "reused while in flight",
        ]
        if self.clean_under:
            others = ", ".join(r.upper() for r in self.clean_under)
            lines.append(f"  only under runner {self.runner.upper()}: clean under {others}")
        for where, (count, seed, text) in self.raises.items():
            lines.append(f"  raised in {count} run(s), first seed {seed}: {text} ({where})")
        if self.leaks:
            count, seed, blocks = self.leaks
            lines.append(
                f"  leaked device blocks in {count} run(s), seed {seed}: {blocks} block(s)"
            )
        if self.undrained:
            count, seed, rids = self.undrained
            lines.append(f"  never drained in {count} run(s), seed {seed}: vLLM held {rids}")
        for kind, (count, seed, rid, why) in self.verdicts.items():
            lines.append(f"  verdict {kind} in {count} run(s), seed {seed}, rid {rid!r}: {why}")
        return lines
