"""Trace summary, Markdown report and Gantt chart of scheduler timelines (spectot.bench.trace)."""

from __future__ import annotations

import json

import pytest

from spectot.bench.trace import busy_seconds, draw_gantt, merge_spans, summary_markdown, trace_summary
from spectot.schedulers.timeline import Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def hand_made_timeline() -> Timeline:
    """Two streams, two levels; every number in the tests below is worked out by hand from this table.

    level 0 (TG), wall [0, 4]:  s0 draft 0-1, verify 1-2, draft 2-3, verify 3-4
                                s1 draft 0-1.5, verify 1.5-2.5, wait 2.5-3
        verify union [1, 2.5] + [3, 4] = 2.5 s busy -> utilisation 2.5 / 4 = 0.625
    level 1 (SE), wall [4, 6]:  s0 draft 4-4.5, verify 4.5-6
                                s1 draft 4-5, verify 5-6
        verify union [4.5, 6] = 1.5 s busy -> utilisation 1.5 / 2 = 0.75
    whole run: busy 4 s of 6 s wall -> 2/3.
    """
    t = Timeline(origin=0.0)
    for stream, phase, start, end in [
        (0, "draft", 0.0, 1.0),
        (0, "verify", 1.0, 2.0),
        (0, "draft", 2.0, 3.0),
        (0, "verify", 3.0, 4.0),
        (1, "draft", 0.0, 1.5),
        (1, "verify", 1.5, 2.5),
        (1, "wait", 2.5, 3.0),
    ]:
        t.add(stream, phase, start, end, level=0, component="TG")
    for stream, phase, start, end in [
        (0, "draft", 4.0, 4.5),
        (0, "verify", 4.5, 6.0),
        (1, "draft", 4.0, 5.0),
        (1, "verify", 5.0, 6.0),
    ]:
        t.add(stream, phase, start, end, level=1, component="SE")
    return t


def synthetic_timeline(levels: int = 3, streams: int = 4) -> Timeline:
    """Each level: streams draft for staggered times, wait for the target, then verify one after another."""
    t = Timeline(origin=0.0)
    clock = 0.0
    for level in range(levels):
        component = "TG" if level % 2 == 0 else "SE"
        drafted = [clock + 0.1 * (s + 1) for s in range(streams)]
        target_free = clock
        for s in range(streams):
            t.add(s, "draft", clock, drafted[s], level, component)
            start = max(drafted[s], target_free)
            t.add(s, "wait", drafted[s], start, level, component)
            t.add(s, "verify", start, start + 0.15, level, component)
            target_free = start + 0.15
        clock = target_free
    return t


def test_merge_spans_counts_overlaps_once():
    assert merge_spans([(3, 4), (1, 2), (1.5, 2.5)]) == [(1, 2.5), (3, 4)]
    assert merge_spans([(0, 1), (1, 2)]) == [(0, 2)]
    assert busy_seconds([(1, 2), (1.5, 2.5), (3, 4)]) == pytest.approx(2.5)
    assert busy_seconds([]) == 0.0


def test_summary_utilisation_and_phase_sums_by_hand():
    timeline = hand_made_timeline()
    s = trace_summary(timeline)
    assert s["wall_time"] == pytest.approx(6.0)
    assert s["target_busy"] == pytest.approx(4.0)
    assert s["target_utilisation"] == pytest.approx(4.0 / 6.0)
    assert s["target_utilisation"] == pytest.approx(timeline.target_utilisation())
    assert s["intervals"] == 11
    assert s["verify_intervals"] == 5
    assert s["phases"] == pytest.approx({"draft": 5.0, "wait": 0.5, "verify": 5.5})


def test_summary_per_stream_level_component_by_hand():
    s = trace_summary(hand_made_timeline())
    assert s["streams"] == [
        {"stream": 0, "draft": pytest.approx(2.5), "wait": 0.0, "verify": pytest.approx(3.5)},
        {"stream": 1, "draft": pytest.approx(2.5), "wait": pytest.approx(0.5), "verify": pytest.approx(2.0)},
    ]
    level0, level1 = s["levels"]
    assert (level0["level"], level0["component"], level0["streams"]) == (0, "TG", 2)
    assert level0["wall_time"] == pytest.approx(4.0)
    assert level0["target_utilisation"] == pytest.approx(0.625)
    assert (level1["level"], level1["component"]) == (1, "SE")
    assert (level1["start"], level1["end"]) == (4.0, 6.0)
    assert level1["target_utilisation"] == pytest.approx(0.75)
    assert s["components"]["TG"] == pytest.approx(
        {"draft": 3.5, "wait": 0.5, "verify": 3.0, "target_busy": 2.5, "verify_intervals": 3, "levels": 1}
    )
    assert s["components"]["SE"] == pytest.approx(
        {"draft": 1.5, "wait": 0.0, "verify": 2.5, "target_busy": 1.5, "verify_intervals": 2, "levels": 1}
    )


def test_summary_is_json_serialisable():
    s = trace_summary(hand_made_timeline())
    assert json.loads(json.dumps(s)) == s


def test_empty_timeline_summary_is_zero():
    s = trace_summary(Timeline(origin=0.0))
    assert (s["wall_time"], s["target_utilisation"], s["verify_intervals"]) == (0.0, 0.0, 0)
    assert s["streams"] == [] and s["levels"] == [] and s["components"] == {}


def test_summary_markdown_contains_utilisation_and_components():
    md = summary_markdown(trace_summary(hand_made_timeline()))
    assert "66.7%" in md
    assert "| verify | 5.500 |" in md
    assert "| TG |" in md and "| SE |" in md


def test_timeline_save_load_roundtrip(tmp_path):
    timeline = hand_made_timeline()
    path = tmp_path / "trace.json"
    timeline.save(path)
    loaded = Timeline.load(path)
    assert loaded.intervals == timeline.intervals
    assert trace_summary(loaded) == trace_summary(timeline)


def test_draw_gantt_writes_png_and_returns_summary(tmp_path):
    timeline = synthetic_timeline(levels=3, streams=4)
    out = tmp_path / "figures" / "nested" / "gantt.png"  # parent folders do not exist yet
    summary = draw_gantt(timeline, out, title="synthetic 3 x 4")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    assert summary == trace_summary(timeline)
    assert len(summary["levels"]) == 3 and len(summary["streams"]) == 4
    assert 0.0 < summary["target_utilisation"] <= 1.0


def test_draw_gantt_empty_timeline_raises(tmp_path):
    out = tmp_path / "empty.png"
    with pytest.raises(ValueError, match="no intervals"):
        draw_gantt(Timeline(origin=0.0), out)
    assert not out.exists()


@pytest.mark.parametrize(
    ("interval", "message"),
    [
        ({"stream": 0, "phase": "verify", "start": "0", "end": 1.0}, "start and end are seconds"),
        ({"stream": 0, "phase": "verify", "start": 5.0, "end": 1.0}, "ends \\(1.0\\) before it starts"),
        ({"stream": 0, "phase": "think", "start": 0.0, "end": 1.0}, "phase is draft, wait or verify"),
    ],
)
def test_a_hand_edited_trace_is_refused_by_what_is_wrong(tmp_path, interval, message) -> None:
    """String times raised a TypeError traceback from `spectot trace`; an interval ending before it starts
    reported a negative wall time with exit 0."""
    from spectot.data.jsonl import DataError

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"intervals": [interval]}))
    with pytest.raises(DataError, match=message):
        Timeline.load(path)
