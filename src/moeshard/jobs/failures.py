"""What the ranks of a job raised, as the one error the command reports: refusals raised on the
ranks stay one ValueError (exit 2), anything else is that rank's failure (exit 4, or 5 for a
timeout), with where the ranks' collective sequences part (from the traces they left)."""

from __future__ import annotations

from moeshard.errors import RankFailed
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.spawn import RankFailure
from moeshard.parallel.trace import TRACE_CAPACITY, CollectiveTrace, error_headline, explain_divergence


def where_ranks_part(traces: list, parallel: ParallelConfig, outcome: dict[int, str]) -> str:
    """'; collectives: ...': where the ranks' collective sequences part (from the traces the
    ranks left in shared memory), or '' when they all entered and left the same ones."""
    entries = {rank: CollectiveTrace(TRACE_CAPACITY, buffer).entries() for rank, buffer in enumerate(traces)}
    ep = list(range(len(traces))) if parallel.enable_ep else None
    lines = explain_divergence(entries, 0, len(traces), outcome, ep)
    return "" if lines[0].startswith("every rank with a trace entered") else "; collectives: " + lines[0]


def rank_errors(results: list, traces: list, parallel: ParallelConfig) -> None:
    """``run_plans`` / ``generate_plans`` record a rank's exception as a dict: a refusal stays a ValueError (exit 2),
    anything else is that rank's failure (exit 4), with where the ranks' collectives part."""
    errors = [(rank, r) for rank, r in enumerate(results) if isinstance(r, dict)]
    if not errors:
        return
    rank, first = errors[0]
    if first["error"] == "ValueError":
        raise ValueError(first["message"])
    outcome = {r: (f"it raised {e['error']} ({error_headline(e['message'])})" if isinstance(e, dict)
                   else "it finished") for r, e in enumerate(results)}
    raise RankFailed(f"rank {rank} raised {first['error']}: {first['message']}"
                     + where_ranks_part(traces, parallel, outcome))


def as_value_error(failure: RankFailure, traces: list | None = None, parallel: ParallelConfig | None = None) -> Exception:
    """Refusals raised on the ranks come back as one ValueError (the CLI prints it, exit 2);
    anything else stays a RankFailure (exit 4, or 5 for a timeout), its summary extended by
    where the ranks' collectives part (given their ``traces`` and the layout they ran)."""
    if failure.errors and not failure.missing and all(e.type_name == "ValueError" for e in failure.errors.values()):
        first = failure.errors[min(failure.errors)]
        return ValueError(first.message)
    if traces is None or parallel is None:
        return failure
    outcome = {}
    for rank in range(failure.world_size):
        if rank in failure.errors:
            err = failure.errors[rank]
            outcome[rank] = f"it raised {err.type_name} ({error_headline(err.message)})"
        elif rank in failure.died:
            outcome[rank] = f"it died (exit code {failure.died[rank]})"
        elif rank in failure.results:
            outcome[rank] = "it finished"
        else:
            outcome[rank] = "it sent nothing more (still inside, or stopped)"
    failure.summary += where_ranks_part(traces, parallel, outcome)
    return failure
