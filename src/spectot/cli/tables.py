"""Rich tables the CLI prints."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from spectot.spec.stats import DecodeStats


def stats_table(stats: Sequence[DecodeStats], method: str) -> Table:
    table = Table(title=f"{method}: decoding statistics (acceptance length includes the bonus token)")
    for col in (
        "prompt",
        "new tok",
        "tok/s",
        "target fwd",
        "draft fwd",
        "accept len",
        "accept rate",
        "draft s",
        "verify s",
        "other s",
    ):
        table.add_column(col, justify="right")
    for i, s in enumerate(stats):
        table.add_row(
            str(i),
            str(s.new_tokens),
            f"{s.tokens_per_second:.1f}",
            str(s.target_forwards),
            str(s.draft_forwards),
            f"{s.mean_acceptance_length:.2f}",
            f"{s.acceptance_rate:.2f}",
            f"{s.time_draft:.2f}",
            f"{s.time_verify:.2f}",
            f"{s.time_other:.2f}",
        )
    return table
