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


def solve_table(summary: dict, title: str) -> Table:
    """Accuracy, wall time, tokens and per-component (TG / SE) speculation figures of a solve run."""
    table = Table(title=title)
    for col in ("component", "levels", "streams", "new tok", "tok/step", "accept rate", "target fwd", "seconds"):
        table.add_column(col, justify="right")
    for name, c in summary["components"].items():
        table.add_row(
            name,
            str(c["levels"]),
            str(c["streams"]),
            str(c["new_tokens"]),
            f"{c['tokens_per_step']:.2f}",
            f"{c['acceptance_rate']:.2f}",
            str(c["target_forwards"]),
            f"{c['seconds']:.1f}",
        )
    table.caption = (
        f"{summary['problems']} problems, accuracy {summary['accuracy']:.2f}, wall {summary['seconds']:.1f}s, "
        f"{summary['new_tokens']} tokens, {summary['tokens_per_second']:.1f} tok/s "
        "(tok/step: tokens per verification step of a stream, bonus token included)"
        + _failed(summary)
        + _resumed(summary)
    )
    return table


def _failed(summary: dict) -> str:
    """A caption line for problems that failed (a prompt past the context), resumed ones too: they count as wrong."""
    failed = summary.get("failed_all", summary.get("failed"))
    return f"; {failed} failed, graded 0" if failed else ""


def _resumed(summary: dict) -> str:
    """A caption line for a resumed run: how many problems earlier runs did, and the accuracy over them all."""
    if not summary.get("resumed"):
        return ""
    return f"; resumed past {summary['resumed']} problems, accuracy over all {summary['accuracy_all']:.2f}"


def tree_solve_table(summary: dict, title: str) -> Table:
    """Accuracy, throughput and SPEX's speculation figures of a tree-search run."""
    table = Table(title=title)
    for col in (
        "questions",
        "accuracy",
        "q/min",
        "seconds",
        "expansions",
        "tokens",
        "speculated",
        "hit rate",
        "saving rate",
        "wasted tok",
        "early stops",
    ):
        table.add_column(col, justify="right")
    table.add_row(
        str(summary["problems"]),
        f"{summary['accuracy']:.2f}",
        f"{summary['questions_per_minute']:.2f}",
        f"{summary['seconds']:.1f}",
        str(summary["expansions"]),
        str(summary["tokens"]),
        str(summary["speculated"]),
        f"{summary['hit_rate']:.2f}",
        f"{summary['saving_rate']:.2f}",
        str(summary["wasted_tokens"]),
        str(summary["stopped_early"]),
    )
    table.caption = (_failed(summary) + _resumed(summary)).removeprefix("; ") or None
    return table
