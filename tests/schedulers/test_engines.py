"""Every execution engine of a level returns what serial AR returns.

- greedy, fp32 tiny targets: ar, sd, mcsd, batched-ar, batched-sd, seed, seed-batched, continuous-ar and
  continuous-sd give token for token the same streams as serial ``ar`` (with an EDD draft, an n-gram
  draft and a tree draft);
- a chained level (continuous engines) gives each stream's follow-up exactly as if run on its own;
- sampled: batched-ar gives exactly the serial-ar samples (a stream's samples depend only on its seed), and
  so does every speculative engine with a deterministic (n-gram) draft: coupled verification;
- shared prompts are run once (prefix sharing) and still decode exactly;
- the timeline records draft / wait / verify intervals, and seed's drafts overlap verification.
"""

from __future__ import annotations

import pytest

from spectot.engine.runner import ModelRunner
from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint
from spectot.schedulers.base import Level
from spectot.schedulers.batched import BatchedEngine
from spectot.schedulers.chained import ContinuousLevelEngine
from spectot.schedulers.continuous import ContinuousEngine
from spectot.schedulers.seed import SeedEngine
from spectot.schedulers.serial import SerialEngine
from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.proposers.draft_decoder import DraftDecoderProposer
from spectot.spec.proposers.ngram import NgramProposer
from spectot.spec.sampling import SamplingParams
from spectot.spec.trees.dynamic import StaticPolicy
from spectot.spec.trees.shapes import k_config_tree

# two states x three thoughts (repeated prompts) and a prompt sharing a long prefix with them
HEADER = list(range(3, 23))
PROMPTS = [HEADER + [5, 9]] * 3 + [HEADER + [7, 1, 30]] * 3 + [[11, 4, 4, 2]]
MAX_NEW = 20


def edd(target) -> DraftDecoder:
    import torch

    head_ids = torch.arange(0, 64, 2)
    config = DraftDecoderConfig("edd", 1, -2, head_ids.numel(), fingerprint(target), target.config.to_dict())
    return DraftDecoder.initialise(config, target, head_ids).eval()


def engines(target):
    """name -> (make engine, method), each engine with its own decoder over one shared fp32 target runner."""
    runner = ModelRunner(target)
    draft = edd(target)

    def decoder(kind: str | None, policy=None) -> Decoder:
        if kind is None:
            return Decoder(runner)
        if kind == "ngram":
            return Decoder(runner, proposer=NgramProposer(width=2))
        return Decoder(runner, proposer=DraftDecoderProposer(draft, ModelRunner(draft.model), policy))

    tree = StaticPolicy(tuple(k_config_tree((2, 2, 1))))
    return {
        "ar": (lambda: SerialEngine(decoder(None), "ar"), "ar"),
        "sd": (lambda: SerialEngine(decoder("edd"), "sd"), "sd"),
        "mcsd": (lambda: SerialEngine(decoder("edd", tree), "mcsd"), "sd"),
        "batched-ar": (lambda: BatchedEngine(decoder(None)), "ar"),
        "batched-sd": (lambda: BatchedEngine(decoder("ngram"), "batched-sd"), "sd"),
        "seed": (lambda: SeedEngine(decoder("edd", tree)), "sd"),
        "seed-batched": (
            lambda: SeedEngine(
                decoder("edd"), "seed-batched", batched=True, budget=lambda b, sampling: tree if b < 4 else None
            ),
            "sd",
        ),
        "continuous-ar": (lambda: ContinuousLevelEngine(ContinuousEngine(decoder(None))), "ar"),
        "continuous-sd": (
            lambda: ContinuousLevelEngine(
                ContinuousEngine(decoder("edd"), budget=lambda b, sampling: tree if b < 4 else None), "continuous-sd"
            ),
            "sd",
        ),
    }


def make(target, name: str):
    build, method = engines(target)[name]
    return build(), method


def level(method: str, sampling: SamplingParams | None = None) -> Level:
    config = DecodeConfig(
        max_new_tokens=MAX_NEW, method=method, num_draft_tokens=4, sampling=sampling or SamplingParams()
    )
    return Level(PROMPTS, config, seeds=[100 + i for i in range(len(PROMPTS))])


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(0)


@pytest.fixture(scope="module")
def reference(target):
    """Each prompt alone through a fresh plain decoder: the ground truth."""
    decoder = Decoder(ModelRunner(target))
    return [decoder.generate([p], DecodeConfig(max_new_tokens=MAX_NEW))[0].token_ids for p in PROMPTS]


ALL = ["ar", "sd", "mcsd", "batched-ar", "batched-sd", "seed", "seed-batched", "continuous-ar", "continuous-sd"]


@pytest.mark.parametrize("name", ALL)
def test_every_engine_matches_serial_greedy_ar(target, reference, name: str) -> None:
    engine, method = make(target, name)
    timeline = Timeline()
    try:
        results = engine.run(level(method), timeline)
    finally:
        getattr(engine, "close", lambda: None)()
    assert [r.token_ids for r in results] == reference
    if method == "sd":
        assert sum(r.stats.accepted for r in results) > 0  # drafts were really verified
    for r in results:  # one count of tokens per step everywhere: the prefill's token, then accepted + 1 per step
        assert r.stats.accepted + r.stats.verify_steps + 1 == r.stats.new_tokens == len(r.token_ids)
    if name.startswith("continuous"):
        return  # requests of one engine: no per-level timeline
    phases = {i.phase for i in timeline.intervals}
    assert "verify" in phases
    if method == "sd":
        assert "draft" in phases


@pytest.mark.parametrize("name", ["continuous-ar", "continuous-sd"])
def test_a_chained_level_runs_each_follow_up_as_if_alone(target, reference, name: str) -> None:
    """Stream i's follow-up (here: its prompt + its output + one token) is built from its result and
    decodes exactly as that prompt decodes alone; every follow-up gets its own seed."""
    engine, method = make(target, name)
    then = DecodeConfig(max_new_tokens=6, method=method, num_draft_tokens=4)
    seen = []

    def follow(i: int, result) -> tuple[list[int], DecodeConfig, int]:
        seen.append(i)
        return list(result.prompt_ids) + list(result.token_ids) + [9], then, 500 + i

    try:
        run = engine.run_chained(level(method), follow)
    finally:
        engine.close()
    assert [r.token_ids for r in run.first] == reference
    assert sorted(seen) == list(range(len(PROMPTS)))
    alone = Decoder(ModelRunner(target))
    for i, r in enumerate(run.then):
        prompt = PROMPTS[i] + reference[i] + [9]
        assert r.prompt_ids == prompt
        assert r.token_ids == alone.generate([prompt], DecodeConfig(max_new_tokens=6))[0].token_ids
    assert 0 < run.first_seconds <= run.seconds and 0 < run.first_forwards < run.forwards


def test_batched_sampling_reproduces_serial_samples(target) -> None:
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    serial = make(target, "ar")[0].run(level("ar", sampling))
    batched = make(target, "batched-ar")[0].run(level("ar", sampling))
    assert [r.token_ids for r in serial] == [r.token_ids for r in batched]
    # the three thoughts of one state share a prompt but not their samples
    assert len({tuple(r.token_ids) for r in serial[:3]}) > 1


def test_seed_verifies_while_drafting_and_records_waits(target) -> None:
    engine, _ = make(target, "seed")
    timeline = Timeline()
    engine.run(level("sd"), timeline)
    verify = [i for i in timeline.intervals if i.phase == "verify"]
    draft = [i for i in timeline.intervals if i.phase == "draft"]
    # the target never verifies two streams at once (one per round, FCFS)
    spans = sorted((i.start, i.end) for i in verify if i.end - i.start > 0)
    starts = {}
    for i in verify:
        starts.setdefault((i.start, i.end), set()).add(i.stream)
    assert all(len(v) == 1 for k, v in starts.items() if k != spans[0])  # the first span is the batched prefill
    assert draft and {i.stream for i in draft} == set(range(len(PROMPTS)))
    assert 0.0 < timeline.target_utilisation() <= 1.0


# -- tree budgets: Sequoia's hardware-aware rule, per number of streams and sampling temperature --------
COSTS = {"t_curve": [{"n": 1, "t": 1.0}, {"n": 4, "t": 1.1}, {"n": 16, "t": 2.5}, {"n": 64, "t": 8.7}], "c": 0.0}


def test_budget_sizes_trees_from_the_acceptance_measured_nearest_the_streams_temperature() -> None:
    from spectot.pipeline import tree_by_streams

    by_temperature = {0.0: [0.7, 0.15, 0.05], 1.0: [0.15, 0.05, 0.02]}
    budget = tree_by_streams(by_temperature, COSTS)
    greedy, hot = SamplingParams(), SamplingParams(do_sample=True, temperature=1.0)
    warm = SamplingParams(do_sample=True, temperature=0.3)  # nearer 0: the greedy vector
    size = {name: len(budget(1, s).parents) for name, s in (("greedy", greedy), ("hot", hot), ("warm", warm))}
    assert size["greedy"] > size["hot"] and size["warm"] == size["greedy"]
    assert len(budget(16, greedy).parents) < size["greedy"]  # many streams share the forward: smaller trees
    only = tree_by_streams({0.0: [0.7, 0.15, 0.05]}, COSTS)  # one vector (--acceptance) serves every temperature
    assert only(1, hot).parents == budget(1, greedy).parents
    assert tree_by_streams(None, COSTS) is None


def test_acceptance_tables_are_read_by_temperature(tmp_path) -> None:
    import json

    from spectot.config import acceptance_by_temperature

    table = tmp_path / "acceptance.json"
    table.write_text(json.dumps({"acceptance": [0.5], "acceptance_by_temperature": {"0.0": [0.5], "1.0": [0.2, 0.1]}}))
    assert acceptance_by_temperature(str(table)) == {0.0: [0.5], 1.0: [0.2, 0.1]}
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"acceptance": [0.4, 0.2], "temperature": 0.6}))
    assert acceptance_by_temperature(str(plain)) == {0.6: [0.4, 0.2]}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"acceptance": [0.5], "acceptance_by_temperature": {"1.0": [0.9, 0.9]}}))
    with pytest.raises(ValueError, match="acceptance_by_temperature"):
        acceptance_by_temperature(str(bad))


@pytest.mark.parametrize("name", ["sd", "batched-sd", "seed", "seed-batched", "continuous-sd"])
@pytest.mark.parametrize("width", [1, 2])
def test_sampled_engines_with_a_deterministic_draft_reproduce_serial_ar_samples(target, name: str, width: int) -> None:
    """Token j of a stream is drawn with that stream's noise for position j whatever covers it (an AR
    step, an accepted draft token, a recovered or bonus token), so every engine builds ar's tree."""
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    runner = ModelRunner(target)
    serial = SerialEngine(Decoder(runner), "ar").run(level("ar", sampling))
    decoder = Decoder(runner, proposer=NgramProposer(width=width))
    engine = {
        "sd": lambda: SerialEngine(decoder, "sd"),
        "batched-sd": lambda: BatchedEngine(decoder, "batched-sd"),
        "seed": lambda: SeedEngine(decoder),
        "seed-batched": lambda: SeedEngine(decoder, "seed-batched", batched=True),
        "continuous-sd": lambda: ContinuousLevelEngine(ContinuousEngine(decoder), "continuous-sd"),
    }[name]()
    try:
        assert [r.token_ids for r in engine.run(level("sd", sampling))] == [r.token_ids for r in serial]
    finally:
        getattr(engine, "close", lambda: None)()


def test_a_failing_follow_up_fails_the_level_and_leaves_the_engine_usable(target, reference) -> None:
    engine, method = make(target, "continuous-ar")

    def follow(i: int, result):
        raise ValueError(f"no follow-up for stream {i}")

    try:
        with pytest.raises(ValueError, match="no follow-up"):
            engine.run_chained(level(method), follow)
        assert [r.token_ids for r in engine.run(level(method))] == reference
    finally:
        engine.close()
