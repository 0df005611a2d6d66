"""Blocksworld: instance reading, spectot's plan validator, text <-> PDDL, loaders, the generator and the task.

The validator is checked against an independent reference simulator written here with another representation
(block -> what it sits on, and the held block), over every gold plan and every single-action corruption.
Tests that need the PlanBench data skip when ../shared/data/blocksworld is absent.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from spectot.data.jsonl import DataError, iter_jsonl
from spectot.tasks.blocksworld import (
    DEFAULT_CONFIG,
    DOMAIN,
    PLAN_END,
    Action,
    BlocksworldTask,
    Instance,
    PromptPool,
    builtin_prompt_pool,
    generate_instances,
    instance_to_pddl,
    legal_actions,
    load_problems,
    parse_action,
    parse_instance,
    parse_pddl_action,
    precondition_failure,
    problem_instance,
    read_config,
    read_instance,
    read_prompt_pool,
    render_action,
    render_atoms,
    render_plan,
    render_statement,
    run_plan,
    solve,
    to_record,
    validate,
)
from spectot.tasks.base import Problem

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "blocksworld"
PLAN_LISTS = ("split_v1_step_6_data.json", "split_v2_step_6_data.json", "full_step_6.json")
RENDERED = ("split_v1_step_6_rendered.jsonl", "split_v2_step_6_rendered.jsonl")


@pytest.fixture(scope="module")
def data_dir() -> Path:
    if not DATA.is_dir():
        pytest.skip(f"Blocksworld data not found at {DATA}")
    return DATA


@pytest.fixture(scope="module")
def gold(data_dir: Path) -> list[Problem]:
    """Every problem of the three step-6 lists (the full list is their union, but each file is read)."""
    return [problem for name in PLAN_LISTS for problem in load_problems(data_dir / name)]


# -- an independent reference simulator -------------------------------------------------------------------------
def reference_run(instance: Instance, plan: list[Action]) -> tuple[int | None, bool]:
    """(index of the first inapplicable step or None, goal holds at the end), by the domain rules in words."""
    below = {atom[1]: atom[2] for atom in instance.init if atom[0] == "on"}
    below |= {atom[1]: "table" for atom in instance.init if atom[0] == "ontable"}
    held = next((atom[1] for atom in instance.init if atom[0] == "holding"), None)

    def clear(block: str) -> bool:
        return block in below and block not in below.values()

    for index, (name, args) in enumerate(plan):
        ob = args[0]
        if name == "pick-up" and held is None and clear(ob) and below.get(ob) == "table":
            held = ob
            del below[ob]
        elif name == "unstack" and held is None and clear(ob) and below.get(ob) == args[1] != "table":
            held = ob
            del below[ob]
        elif name == "put-down" and held == ob:
            below[ob], held = "table", None
        elif name == "stack" and held == ob and clear(args[1]):
            below[ob], held = args[1], None
        else:
            return index, False
    return None, all(below.get(atom[1]) == atom[2] for atom in instance.goal)


def corruptions(plan: list[Action], objects: tuple[str, ...]) -> dict[str, list[list[Action]]]:
    """Single-action corruptions of ``plan``: drop a step, swap neighbours, change a block, change the type."""
    out: dict[str, list[list[Action]]] = {"drop": [], "swap": [], "block": [], "type": []}
    for i, action in enumerate(plan):
        out["drop"].append(plan[:i] + plan[i + 1 :])
        if i + 1 < len(plan):
            out["swap"].append(plan[:i] + [plan[i + 1], action] + plan[i + 2 :])
        for j, other in itertools.product(range(len(action.args)), objects):
            if other != action.args[j]:
                args = action.args[:j] + (other,) + action.args[j + 1 :]
                out["block"].append(plan[:i] + [Action(action.name, args)] + plan[i + 1 :])
        for changed in _type_changes(action, objects):
            out["type"].append(plan[:i] + [changed] + plan[i + 1 :])
    return out


def _type_changes(action: Action, objects: tuple[str, ...]) -> list[Action]:
    ob = action.args[0]
    others = [obj for obj in objects if obj != ob]
    return {
        "pick-up": [Action("unstack", (ob, other)) for other in others],
        "unstack": [Action("pick-up", (ob,))],
        "put-down": [Action("stack", (ob, other)) for other in others],
        "stack": [Action("put-down", (ob,))],
    }[action.name]


def actions_of(problem: Problem) -> list[Action]:
    return [parse_pddl_action(step) for step in problem.answer]


# -- PDDL reading -----------------------------------------------------------------------------------------------
def test_parse_instance_reads_objects_init_and_goal() -> None:
    text = """; a comment
    (define (problem BW-rand-3) (:domain blocksworld-4ops) (:objects a b c )
    (:init (handempty) (ontable a) (on b c) (ontable c) (clear a) (clear b))
    (:goal (and (on a c) (on c b))))"""
    instance = parse_instance(text)
    assert instance.objects == ("a", "b", "c")
    assert instance.name == "bw-rand-3"
    assert instance.init == {("handempty",), ("ontable", "a"), ("on", "b", "c"), ("ontable", "c")} | {
        ("clear", "a"),
        ("clear", "b"),
    }
    assert instance.goal == (("on", "a", "c"), ("on", "c", "b"))
    single_goal = parse_instance(text.replace("(:goal (and (on a c) (on c b)))", "(:goal (on a c))"))
    assert single_goal.goal == (("on", "a", "c"),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("(define (problem p) (:objects a) (:init (handempty)) (:goal (on a a))", "unclosed"),
        ("(define (problem p) (:objects a) (:init (handempty))))", "unbalanced"),
        ("(define (problem p) (:objects a) (:init (handempty)))", "no (:goal"),
        ("(define (problem p) (:objects a) (:init (flying a)) (:goal (on a a)))", "unknown predicate"),
        ("(define (problem p) (:objects a) (:init (on a)) (:goal (on a a)))", "wrong arity"),
        ("(define (problem p) (:objects a) (:init (ontable z)) (:goal (on a a)))", "undeclared object"),
        ("(problem p)", "expected one (define"),
        ("(define ((x)) (:objects a) (:init (handempty)))", "no (:goal"),  # a list in a head's place: TypeError
    ],
)
def test_parse_instance_names_the_source_of_a_malformed_file(text: str, message: str) -> None:
    with pytest.raises(DataError, match="inst.pddl") as err:
        parse_instance(text, "inst.pddl")
    assert message in str(err.value)


def test_a_nameless_problem_reads_with_an_empty_name() -> None:
    """``(problem)`` raised IndexError while the rest of the file was well formed."""
    instance = parse_instance("(define (problem) (:objects a b) (:init (handempty)) (:goal (on a b)))", "p.pddl")
    assert instance.name == "" and instance.goal == (("on", "a", "b"),)


def test_instance_pddl_round_trip() -> None:
    instance = Instance.make_dummy()
    assert parse_instance(instance_to_pddl(instance)) == instance


# -- the validator ----------------------------------------------------------------------------------------------
def test_validator_reports_the_failing_step_and_why() -> None:
    instance = Instance.make_dummy()  # b on a, c on the table; goal a on c
    optimal = ["(unstack b a)", "(put-down b)", "(pick-up a)", "(stack a c)"]
    assert validate(instance, optimal) == validate(instance, [parse_pddl_action(s) for s in optimal])
    assert validate(instance, optimal).valid and validate(instance, optimal).goal_reached

    bad = validate(instance, ["(unstack b a)", "(stack b c)", "(pick-up c)"])
    assert (bad.valid, bad.failed_step, bad.goal_reached) == (False, 2, False)
    assert bad.reason == "step 3 (pick-up c): c is not clear"

    short = validate(instance, optimal[:3])
    assert (short.valid, short.failed_step, short.goal_reached) == (False, None, False)
    assert "(on a c)" in short.reason
    assert "the hand is not holding a" in validate(instance, ["(stack a c)"]).reason
    assert "unknown block" in validate(instance, ["(pick-up z)"]).reason
    assert "cannot read" in validate(instance, ["pick it up"]).reason
    assert "takes 2 block" in validate(instance, [Action("stack", ("a",))]).reason


def test_every_gold_plan_is_valid_and_optimal(gold: list[Problem]) -> None:
    assert len(gold) == 127 + 122 + 130
    for problem in gold:
        instance = problem_instance(problem)
        verdict = validate(instance, problem.answer)
        assert verdict.valid and verdict.goal_reached and verdict.failed_step is None, (problem.id, verdict)
    unique = {problem.id: problem_instance(problem) for problem in gold}
    for problem_id, instance in unique.items():
        assert len(solve(instance.init, instance.goal)) == 6, problem_id  # step-6 instances: BFS optimum is 6


def test_corrupted_gold_plans_are_rejected_as_the_reference_says(gold: list[Problem]) -> None:
    unique = {problem.id: problem for problem in gold}
    for problem in unique.values():
        instance, plan = problem_instance(problem), actions_of(problem)
        for kind, variants in corruptions(plan, instance.objects).items():
            verdicts = [validate(instance, variant) for variant in variants]
            for variant, verdict in zip(variants, verdicts):
                failed_step, reached = reference_run(instance, variant)
                assert (verdict.failed_step, verdict.valid) == (failed_step, failed_step is None and reached), (
                    problem.id,
                    kind,
                    [str(a) for a in variant],
                    verdict,
                )
            if kind in ("drop", "swap"):  # optimal plans cannot lose a step; hand-empty/holding must alternate
                assert not any(verdict.valid for verdict in verdicts), (problem.id, kind)
            else:
                assert any(verdict.failed_step is not None for verdict in verdicts), (problem.id, kind)


def test_legal_actions_are_exactly_the_applicable_groundings() -> None:
    for problem in generate_instances(4, 6, seed=3, min_steps=2, max_steps=6):
        instance = problem_instance(problem)
        world = instance.init
        for step in problem.answer:
            everything = [
                Action(name, args)
                for name, schema in DOMAIN.items()
                for args in itertools.product(instance.objects, repeat=len(schema.params))
            ]
            applicable = sorted((a for a in everything if precondition_failure(world, a) is None), key=str)
            assert legal_actions(world) == applicable
            world, verdict = run_plan(Instance(instance.objects, world, instance.goal), [step])
            assert verdict.failed_step is None


# -- text <-> PDDL ----------------------------------------------------------------------------------------------
def test_read_config_matches_the_built_in_config(data_dir: Path) -> None:
    assert read_config(data_dir / "bw_config.yaml") == DEFAULT_CONFIG


def test_action_text_round_trip_for_every_grounding() -> None:
    """Every grounding reads back from its PDDL; from its English text too, but one naming a block twice ("stack the
    red block on top of the red block"), which names one block and is skipped, as llm-reasoners skips it."""
    blocks = sorted(DEFAULT_CONFIG.objects)
    for name, schema in DOMAIN.items():
        for args in itertools.product(blocks, repeat=len(schema.params)):
            action = Action(name, args)
            expected = action if len(set(args)) == len(args) else None
            assert parse_action(render_action(action)) == expected
            assert parse_action(str(action)) == action


def test_parse_action_is_tolerant_and_returns_none_for_other_text() -> None:
    expected = Action("unstack", ("c", "d"))
    assert render_action(expected) == "unstack the orange block from on top of the yellow block"
    assert parse_action("  Unstack the Orange block  from on top of the YELLOW block.  ") == expected
    assert parse_action("put down the red block.") == Action("put-down", ("a",))
    assert parse_action("( stack a b )") == Action("stack", ("a", "b"))
    for text in ["", "pick up the purple block", "stack the red block", "dance", "pick up the red and blue blocks"]:
        assert parse_action(text) is None, text


def test_parse_action_reads_free_wording_as_llm_reasoners_does() -> None:
    """Off-template lines (numbered, "from the table", "on the blue block"): the action the first words name,
    then its blocks in order, as ``text_to_plan_blocksworld`` reads plans before VAL."""
    cases = {
        "1. pick up the red block": Action("pick-up", ("a",)),
        "Step 2: unstack the red block from the blue block.": Action("unstack", ("a", "b")),
        "stack the red block on the blue block": Action("stack", ("a", "b")),
        "put down the red block on the table": Action("put-down", ("a",)),
        "- pick up the red block from the table": Action("pick-up", ("a",)),
    }
    for text, action in cases.items():
        assert parse_action(text) == action, text
    assert parse_action("stack the blue block on the red block") == Action("stack", ("b", "a"))  # order kept
    # the action named anywhere, as llm-reasoners finds it (a leading word dropped the line); distinct blocks
    assert parse_action("Next, unstack the orange block from on top of the yellow block") == Action(
        "unstack", ("c", "d")
    )
    assert parse_action("then I stack the blue block on the red block.") == Action("stack", ("b", "a"))
    assert parse_action("stack the red block on top of the red block") is None  # one block named: skipped
    assert parse_action("the red block is on the table") is None


def test_a_demo_of_the_prompt_is_never_one_of_the_problems(data_dir: Path) -> None:
    """Pool v2's first demos are split v1's lines 2, 110 and 114 (their gold plans in every prompt): refused by id;
    the built-in problems of seed 2024 came from the built-in pool's own generator run."""
    from spectot.tasks.blocksworld import demo_problems
    from spectot.tasks.registry import builtin_problems, make_task

    split_v1 = load_problems(data_dir / "split_v1_step_6_rendered.jsonl")
    pool_v2 = BlocksworldTask(data_dir / "prompts" / "pool_prompt_v2_step_6.json")
    with pytest.raises(DataError, match="are demos of the prompt pool") as refused:
        pool_v2.check_problems(split_v1)
    assert len(refused.value.args[0].split("problems ")[1].split(" are")[0].split(", ")) == 3
    BlocksworldTask(data_dir / "prompts" / "pool_prompt_v1.json").check_problems(split_v1)  # the matching pool
    demos = builtin_prompt_pool().demos
    assert len(demo_problems(generate_instances(4, 6, seed=2024, min_steps=2, max_steps=6), demos)) > 0
    problems = builtin_problems("blocksworld", 6, seed=2024)
    assert len(problems) == 6 and not demo_problems(problems, demos)
    assert builtin_problems("blocksworld", 6, seed=0) == generate_instances(4, 6, seed=0, min_steps=2, max_steps=6)
    with pytest.raises(ValueError, match="--task gsm8k would not read it"):
        make_task("gsm8k", prompt_pool=str(data_dir / "prompts" / "pool_prompt_v1.json"))


def test_rendering_reproduces_the_rendered_jsonl(data_dir: Path) -> None:
    lines = 0
    for name in RENDERED:
        for _, record in iter_jsonl(data_dir / name):
            instance = read_instance(data_dir / record["instance_file"])
            plan = [line for line in record["gt_plan_pddl"].splitlines() if line]
            assert render_atoms(instance.init) == record["init"]
            assert render_atoms(instance.goal) == record["goal"]
            assert render_plan(plan) == record["gt_plan"]
            assert render_statement(instance) == record["question"]
            lines += 1
    assert lines == 127 + 122


# -- loaders ----------------------------------------------------------------------------------------------------
def test_loaders_agree_and_honour_limit(data_dir: Path) -> None:
    from_list = load_problems(data_dir / "split_v1_step_6_data.json")
    from_jsonl = load_problems(data_dir / "split_v1_step_6_rendered.jsonl")
    # the same problems, though the rendered jsonl lists a few in another order than the json list
    assert {p.id: (p.question, p.answer) for p in from_list} == {p.id: (p.question, p.answer) for p in from_jsonl}
    assert len({p.id for p in from_list}) == len(from_list) == 127
    first = from_list[0]
    assert first.id == "generated_basic/instance-348"
    assert first.answer[:2] == ["(unstack c d)", "(put-down c)"]
    assert problem_instance(first).goal == (("on", "a", "d"), ("on", "c", "a"))
    assert len(load_problems(data_dir / "full_step_6.json", limit=5)) == 5
    assert len(load_problems(data_dir / "split_v2_step_6_rendered.jsonl", limit=3)) == 3


def test_jsonl_loader_names_the_bad_line(tmp_path: Path) -> None:
    good = to_record(generate_instances(3, 1, seed=0)[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        load_problems(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps({"gt_plan_pddl": "(pick-up a)\n"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: needs a string 'instance_file'"):
        load_problems(path)
    path.write_text(json.dumps(good | {"gt_plan_pddl": "(pick-up a)\nfly away\n"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: gold plan line 'fly away'"):
        load_problems(path)
    path.write_text(json.dumps(good | {"num_steps": 99}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: num_steps is 99"):
        load_problems(path)


def test_json_list_loader_names_the_bad_entry(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text(json.dumps([["x/generated_basic/instance-1.pddl", "(pick-up a)\n", 1], "oops"]))
    with pytest.raises(DataError, match=r"entry 1: instance file .*instance-1\.pddl not found"):
        load_problems(path)
    (tmp_path / "instances" / "generated_basic").mkdir(parents=True)
    (tmp_path / "instances" / "generated_basic" / "instance-1.pddl").write_text(instance_to_pddl(Instance.make_dummy()))
    with pytest.raises(DataError, match="entry 2: expected"):
        load_problems(path)
    assert load_problems(path, limit=1)[0].id == "generated_basic/instance-1"
    with pytest.raises(DataError, match="expected a .json plan list"):
        load_problems(tmp_path / "list.txt")


# -- generator --------------------------------------------------------------------------------------------------
def _shortest_by_enumeration(instance: Instance, longest: int) -> int | None:
    """The fewest actions reaching the goal, by trying every sequence of reference-legal actions (tiny cases)."""
    everything = [
        Action(name, args)
        for name, schema in DOMAIN.items()
        for args in itertools.permutations(instance.objects, len(schema.params))
    ]
    prefixes: list[list[Action]] = [[]]
    for length in range(longest + 1):
        if any(reference_run(instance, plan) == (None, True) for plan in prefixes):
            return length
        prefixes = [p + [a] for p in prefixes for a in everything if reference_run(instance, p + [a])[0] is None]
    return None


def test_generator_makes_valid_optimal_plans_deterministically() -> None:
    problems = generate_instances(3, 8, seed=7, min_steps=2, max_steps=4)
    assert [p.question for p in problems] == [p.question for p in generate_instances(3, 8, 7, 2, 4)]
    assert [p.question for p in problems] != [p.question for p in generate_instances(3, 8, 8, 2, 4)]
    assert len({p.question for p in problems}) == 8
    for problem in problems:
        instance = problem_instance(problem)
        assert 2 <= len(problem.answer) <= 4
        assert validate(instance, problem.answer).valid
        assert _shortest_by_enumeration(instance, 4) == len(problem.answer), problem.id
        assert problem.question == render_statement(instance)


def test_generator_scales_to_six_blocks_and_rejects_impossible_requests() -> None:
    problems = generate_instances(6, 2, seed=1, min_steps=6, max_steps=6)
    assert all(len(p.answer) == 6 and validate(problem_instance(p), p.answer).valid for p in problems)
    with pytest.raises(ValueError, match="found only"):
        generate_instances(2, 5, seed=0, min_steps=1, max_steps=2)
    with pytest.raises(ValueError, match="num_blocks"):
        generate_instances(13, 1, seed=0)


def test_generated_problems_round_trip_through_jsonl(tmp_path: Path) -> None:
    problems = generate_instances(4, 3, seed=11, min_steps=3, max_steps=5)
    path = tmp_path / "generated.jsonl"
    path.write_text("".join(json.dumps(to_record(p)) + "\n" for p in problems))
    loaded = load_problems(path)
    assert [(p.id, p.question, p.answer) for p in loaded] == [(p.id, p.question, p.answer) for p in problems]
    assert [problem_instance(p) for p in loaded] == [problem_instance(p) for p in problems]


# -- the task ---------------------------------------------------------------------------------------------------
def test_thought_prompt_follows_rap(data_dir: Path) -> None:
    pool_path = data_dir / "prompts" / "pool_prompt_v1.json"
    task = BlocksworldTask(pool_path)
    problem = load_problems(data_dir / "split_v1_step_6_data.json", limit=1)[0]
    state = ("unstack the orange block from on top of the yellow block", "put down the orange block")
    request = task.thought(problem, state)
    pool = read_prompt_pool(pool_path)
    assert request.prompt.startswith(pool.intro + "\n[STATEMENT]\n")
    assert request.prompt.endswith(problem.question + state[0] + "\n" + state[1] + "\n")
    assert request.prompt.count("[STATEMENT]") == 5 and request.prompt.count(PLAN_END) == 4
    assert pool.demos[0].plan in request.prompt
    assert request.stop == ("\n",) and request.max_new_tokens <= 32
    assert task.depth == 7 and task.name == "blocksworld"


def test_value_prompt_shows_the_simulated_state_and_last_action(data_dir: Path) -> None:
    task = BlocksworldTask(data_dir / "prompts" / "pool_prompt_v1.json")
    problem = load_problems(data_dir / "split_v1_step_6_data.json", limit=1)[0]
    state = ("unstack the orange block from on top of the yellow block", "put down the orange block")
    request = task.value(problem, state)
    tail = request.prompt[request.prompt.rindex("[STATEMENT]") :]
    assert tail == (
        "[STATEMENT]\nAs initial conditions I have that, the red block is clear, the yellow block is clear, "
        "the hand is holding the orange block, the yellow block is on top of the blue block, the red block is on "
        "the table and the blue block is on the table.\nMy goal is to have that the red block is on top of the "
        "yellow block and the orange block is on top of the red block.\n[ACTION]\nput down the orange block\n"
        "[EVALUATION]\n"
    )
    assert request.stop == ("\n",) and request.max_new_tokens <= 8
    assert [task.parse_value(text) for text in ["good", " Good.", "bad", "", "maybe"]] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_task_runs_without_data_files() -> None:
    task = BlocksworldTask()  # the built-in prompt pool
    problem = generate_instances(4, 1, seed=5, min_steps=4, max_steps=6)[0]
    steps: tuple[str, ...] = ()
    while not task.is_final(problem, steps):
        request = task.thought(problem, steps)
        assert problem.question in request.prompt and all(step in request.prompt for step in steps)
        gold_line = render_action(parse_pddl_action(problem.answer[len(steps)]))
        steps += (task.parse_thought(problem, steps, " " + gold_line.upper() + ".\n"),)
        assert task.value(problem, steps).prompt.endswith(f"[ACTION]\n{steps[-1]}\n[EVALUATION]\n")
    assert len(steps) == len(problem.answer)  # final because the goal is reached
    assert task.grade(problem, task.final_answer(problem, steps + (PLAN_END,))) == 1.0
    assert task.grade(problem, task.final_answer(problem, steps[:-1])) == 0.0


def test_parse_thought_normalises_or_keeps_the_raw_line() -> None:
    task = BlocksworldTask(builtin_prompt_pool())
    problem = generate_instances(3, 1, seed=0)[0]
    assert task.parse_thought(problem, (), "Pick up the RED block.") == "pick up the red block"
    assert task.parse_thought(problem, (), "(unstack c d)\nmore") == render_action(Action("unstack", ("c", "d")))
    assert task.parse_thought(problem, (), "  I think we are done  ") == "I think we are done"
    assert task.parse_thought(problem, (), "[PLAN END]") == PLAN_END
    assert task.parse_thought(problem, (), "(stack z)") == "(stack z)"
    # an action on the marker's line is the step (it was dropped, leaving the plan one action short)
    assert task.parse_thought(problem, (), "(unstack c d) [PLAN END]") == render_action(Action("unstack", ("c", "d")))
    assert task.parse_thought(problem, (), "done [plan end]") == PLAN_END


def test_is_final_and_grade_on_gold_and_broken_plans(data_dir: Path) -> None:
    task = BlocksworldTask(builtin_prompt_pool(), depth=7)
    problem = load_problems(data_dir / "split_v2_step_6_data.json", limit=1)[0]
    lines = tuple(render_action(action) for action in actions_of(problem))
    assert not task.is_final(problem, ()) and not task.is_final(problem, lines[:5])
    assert task.is_final(problem, lines) and task.is_final(problem, lines[:2] + (PLAN_END,))
    assert task.is_final(problem, ("dance",) * 7)
    assert task.final_answer(problem, lines + (PLAN_END,)) == "\n".join(lines)
    assert task.grade(problem, "\n".join(lines)) == 1.0
    assert task.grade(problem, "\n".join(lines[1:])) == 0.0
    assert task.grade(problem, "\n".join(lines[:3] + (PLAN_END,) + lines[3:])) == 0.0
    assert (
        task.grade(problem, "\n".join(lines[:-1] + (lines[-1] + " " + PLAN_END,))) == 1.0
    )  # the action before the marker counts
    assert task.grade(problem, "") == 0.0
    # an unreadable step is skipped by the search as by the grade: with it the plan was not final (the search went
    # on adding actions) while its answer graded 1.0
    padded, deep = ("garbage", *lines), BlocksworldTask(builtin_prompt_pool(), depth=9)  # final by its plan alone
    assert deep.is_final(problem, padded) and task.grade(problem, task.final_answer(problem, padded)) == 1.0


def test_builtin_pool_demos_are_solved_and_self_eval_has_slots() -> None:
    pool = builtin_prompt_pool()
    assert isinstance(pool, PromptPool) and len(pool.demos) == 2
    assert all(slot in pool.self_eval for slot in ("<init_state>", "<goals>", "<action>"))
    assert pool.self_eval.count("[EVALUATION]\ngood") == 2 and pool.self_eval.count("[EVALUATION]\nbad") == 2
    assert all(demo.plan.startswith("\n") and demo.plan.endswith(PLAN_END + "\n") for demo in pool.demos)


def test_read_prompt_pool_rejects_a_pool_without_slots(tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"intro": "x", "self-eval": "<init_state> <goals>", "example_pool": []}))
    with pytest.raises(DataError, match="lacks the placeholder"):
        read_prompt_pool(path)
    with pytest.raises(ValueError, match="meta\\['instance'\\]"):
        BlocksworldTask(builtin_prompt_pool()).value(Problem.make_dummy(), ("pick up the red block",))
