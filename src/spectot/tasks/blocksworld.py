"""Blocksworld (PlanBench, as used by RAP / llm-reasoners): instances, plan validation, text and the task.

This file owns everything Blocksworld-specific:

- a reader for PlanBench instance files (``(define (problem ...) (:objects ...) (:init ...) (:goal ...))``);
- spectot's own plan validator: a STRIPS simulator of the 4-operator domain (``generated_domain.pddl``:
  pick-up, put-down, stack, unstack), so grading needs no VAL binary;
- the text <-> PDDL mapping of ``bw_config.yaml`` (``(unstack c d)`` <-> "unstack the orange block from on
  top of the yellow block") and the PlanBench rendering of a state as text;
- loaders for the step-6 data (``split_*_data.json``, ``full_step_6.json``, ``*_rendered.jsonl``);
- a generator of fresh instances with optimal plans found by breadth-first search;
- ``BlocksworldTask``: RAP's few-shot "next action" prompt (G) and its "good"/"bad" self-evaluation (E).
  Its goal test (``is_final``) is the simulator above: a state is final once its actions reach the goal,
  where RAP / ToT ask the LLM world model's state and goal check. The search then stops exactly at a valid
  plan, so accuracies are not comparable with the papers' (every method here shares the rule).

Vocabulary. An *atom* is a tuple ``(predicate, *blocks)``, e.g. ``("on", "c", "d")`` or ``("handempty",)``.
A *world* is the frozenset of atoms true at one moment (STRIPS closed world). An *action* is a PDDL action
``Action("unstack", ("c", "d"))``, printed ``(unstack c d)``. A search *state* (``spectot.tasks.base.State``)
is the tuple of action lines the model wrote so far, possibly ending in ``[PLAN END]``.

Rendering (llm-reasoners ``bw_utils.parse_problem``): atoms are sorted by ``pred + " " + " ".join(args)``,
each is mapped through the config's ``predicates`` and ``encoded_objects``, and they are joined with ", " and
" and " before the last, e.g. "the red block is clear, the hand is empty and the red block is on the table".
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from spectot.data.jsonl import DataError, iter_jsonl, read_text
from spectot.tasks.base import Problem, State, StepRequest, Task

Atom = tuple[str, ...]  # ("on", "c", "d"): the predicate, then its blocks
World = frozenset[Atom]

PLAN_END = "[PLAN END]"
NUMBERING = re.compile(r"^(?:step\s*\d+\s*[:.)]?|\d+\s*[.):]|[-*•])\s*")  # "1." / "Step 1:" / "-" before an action
PREDICATE_ARITY = MappingProxyType({"clear": 1, "ontable": 1, "handempty": 0, "holding": 1, "on": 2})


class Action(NamedTuple):
    name: str  # pick-up | put-down | stack | unstack
    args: tuple[str, ...]  # the blocks, in PDDL parameter order: (?ob) or (?ob ?underob)

    def __str__(self) -> str:
        return f"({' '.join((self.name, *self.args))})"


# -- the domain (generated_domain.pddl, blocksworld-4ops), as data ------------------------------------------
class _Schema(NamedTuple):
    params: tuple[str, ...]
    pre: tuple[Atom, ...]
    add: tuple[Atom, ...]
    delete: tuple[Atom, ...]


_OB, _UNDER = "?ob", "?underob"
DOMAIN = MappingProxyType(
    {
        "pick-up": _Schema(
            params=(_OB,),
            pre=(("clear", _OB), ("ontable", _OB), ("handempty",)),
            add=(("holding", _OB),),
            delete=(("clear", _OB), ("ontable", _OB), ("handempty",)),
        ),
        "put-down": _Schema(
            params=(_OB,),
            pre=(("holding", _OB),),
            add=(("clear", _OB), ("handempty",), ("ontable", _OB)),
            delete=(("holding", _OB),),
        ),
        "stack": _Schema(
            params=(_OB, _UNDER),
            pre=(("clear", _UNDER), ("holding", _OB)),
            add=(("handempty",), ("clear", _OB), ("on", _OB, _UNDER)),
            delete=(("clear", _UNDER), ("holding", _OB)),
        ),
        "unstack": _Schema(
            params=(_OB, _UNDER),
            pre=(("on", _OB, _UNDER), ("clear", _OB), ("handempty",)),
            add=(("holding", _OB), ("clear", _UNDER)),
            delete=(("on", _OB, _UNDER), ("clear", _OB), ("handempty",)),
        ),
    }
)


# -- text configuration (bw_config.yaml) ----------------------------------------------------------------------
@dataclass(frozen=True)
class BlocksConfig:
    """How PDDL is said in English: one ``{}`` per block in every template."""

    actions: Mapping[str, str]  # action name -> "stack the {} on top of the {}"
    predicates: Mapping[str, str]  # predicate -> "the {} is on top of the {}"
    objects: Mapping[str, str]  # PDDL object -> block name: "a" -> "red block" (bw_config `encoded_objects`)


_HOLDING_TEXT = "the hand is holding the {}"  # bw_config has no `holding`: only mid-plan states need it
DEFAULT_CONFIG = BlocksConfig(  # the values of llm-reasoners' bw_config.yaml (a test checks they agree)
    actions=MappingProxyType(
        {
            "pick-up": "pick up the {}",
            "put-down": "put down the {}",
            "stack": "stack the {} on top of the {}",
            "unstack": "unstack the {} from on top of the {}",
        }
    ),
    predicates=MappingProxyType(
        {
            "ontable": "the {} is on the table",
            "clear": "the {} is clear",
            "handempty": "the hand is empty",
            "on": "the {} is on top of the {}",
            "holding": _HOLDING_TEXT,
        }
    ),
    objects=MappingProxyType(
        {
            "a": "red block",
            "b": "blue block",
            "c": "orange block",
            "d": "yellow block",
            "e": "white block",
            "f": "magenta block",
            "g": "black block",
            "h": "cyan block",
            "i": "green block",
            "j": "violet block",
            "k": "silver block",
            "l": "gold block",
        }
    ),
)


def read_config(path: str | Path) -> BlocksConfig:
    """A ``bw_config.yaml`` (needs PyYAML); ``holding``, absent there, gets "the hand is holding the {}"."""
    import yaml  # lazy: only this reader needs it; DEFAULT_CONFIG covers the installed product

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        raw = yaml.safe_load(read_text(path))
    except yaml.YAMLError as err:
        raise DataError(f"{path}: not valid YAML ({err})") from None
    actions, predicates, objects = (_string_map(raw, key, path) for key in ("actions", "predicates", "encoded_objects"))
    config = BlocksConfig(
        MappingProxyType(actions), MappingProxyType({"holding": _HOLDING_TEXT, **predicates}), MappingProxyType(objects)
    )
    _check_config(config, path)
    return config


def _string_map(raw: Any, key: str, path: Path) -> dict[str, str]:
    value = raw.get(key) if isinstance(raw, dict) else None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise DataError(f"{path}: '{key}' must be a mapping of strings to strings")
    return dict(value)


def _check_config(config: BlocksConfig, path: Path) -> None:
    for name, schema in DOMAIN.items():
        template = config.actions.get(name)
        if template is None or template.count("{}") != len(schema.params):
            raise DataError(f"{path}: actions.{name} must be a template with {len(schema.params)} '{{}}'")
    for name, arity in PREDICATE_ARITY.items():
        template = config.predicates.get(name)
        if template is None or template.count("{}") != arity:
            raise DataError(f"{path}: predicates.{name} must be a template with {arity} '{{}}'")


# -- instances (PlanBench problem files) -----------------------------------------------------------------------
@dataclass(frozen=True)
class Instance:
    """One planning problem: its blocks, the initial world and the goal atoms (as written in ``:goal``)."""

    objects: tuple[str, ...]
    init: World
    goal: tuple[Atom, ...]
    name: str = ""

    @classmethod
    def make_dummy(cls) -> Instance:
        """b on a, c on the table; goal: a on c. Optimal plan: (unstack b a) (put-down b) (pick-up a) (stack a c)."""
        init = frozenset({("handempty",), ("ontable", "a"), ("on", "b", "a"), ("ontable", "c")} | _clear("b", "c"))
        return cls(("a", "b", "c"), init, (("on", "a", "c"),), "dummy")


def _clear(*blocks: str) -> set[Atom]:
    return {("clear", block) for block in blocks}


def _sexpr(text: str, source: str) -> list[Any]:
    """The top-level s-expressions of ``text`` (comments after ';' dropped), as nested lists of lowercase symbols."""
    tokens = re.findall(r"\(|\)|[^\s()]+", re.sub(r";[^\n]*", "", text).lower())
    stack: list[list[Any]] = [[]]
    for token in tokens:
        if token == "(":
            stack.append([])
        elif token == ")":
            if len(stack) == 1:
                raise DataError(f"{source}: unbalanced ')'")
            closed = stack.pop()
            stack[-1].append(closed)
        else:
            stack[-1].append(token)
    if len(stack) != 1:
        raise DataError(f"{source}: {len(stack) - 1} unclosed '('")
    return stack[0]


def parse_instance(text: str, source: str = "<string>") -> Instance:
    """A PlanBench blocksworld problem from its PDDL text; DataError (naming ``source``) when malformed."""
    top = _sexpr(text, source)
    if len(top) != 1 or not isinstance(top[0], list) or top[0][:1] != ["define"]:
        raise DataError(f"{source}: expected one (define (problem ...) ...) form")
    sections = {
        item[0]: item[1:] for item in top[0][1:] if isinstance(item, list) and item and isinstance(item[0], str)
    }
    for key in (":objects", ":init", ":goal"):
        if key not in sections:
            raise DataError(f"{source}: no ({key} ...) section")
    objects = tuple(sections[":objects"])
    if not objects or not all(isinstance(obj, str) for obj in objects):
        raise DataError(f"{source}: (:objects ...) must list block names")
    init = frozenset(_atom(item, objects, source) for item in sections[":init"])
    goal = tuple(_atom(item, objects, source) for item in _goal_items(sections[":goal"], source))
    name = next((item[1] for item in top[0][1:] if isinstance(item, list) and item[:1] == ["problem"] and item[1:]), "")
    return Instance(objects, init, goal, name if isinstance(name, str) else "")


def _goal_items(goal: list[Any], source: str) -> list[Any]:
    if len(goal) != 1 or not isinstance(goal[0], list):
        raise DataError(f"{source}: (:goal ...) must hold one formula")
    return goal[0][1:] if goal[0][:1] == ["and"] else goal


def _atom(item: Any, objects: tuple[str, ...], source: str) -> Atom:
    if not isinstance(item, list) or not item or not all(isinstance(part, str) for part in item):
        raise DataError(f"{source}: expected a ground atom like (on a b), got {item!r}")
    arity = PREDICATE_ARITY.get(item[0])
    if arity is None or len(item) - 1 != arity:
        raise DataError(f"{source}: unknown predicate or wrong arity in ({' '.join(item)})")
    unknown = [obj for obj in item[1:] if obj not in objects]
    if unknown:
        raise DataError(f"{source}: ({' '.join(item)}) names undeclared object(s) {', '.join(unknown)}")
    return tuple(item)


def read_instance(path: str | Path) -> Instance:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    return parse_instance(read_text(path), str(path))


def instance_to_pddl(instance: Instance) -> str:
    """The instance as a PDDL problem in PlanBench's layout (``parse_instance`` reads it back)."""
    init = sorted(instance.init, key=_sort_key)
    lines = [
        f"(define (problem {instance.name or 'BW-generated'})",
        "(:domain blocksworld-4ops)",
        f"(:objects {' '.join(instance.objects)} )",
        "(:init",
        *(f"({' '.join(atom)})" for atom in init),
        ")",
        "(:goal",
        "(and",
        "\n".join(f"({' '.join(atom)})" for atom in instance.goal) + ")",
        ")",
        ")",
    ]
    return "\n".join(lines) + "\n"


# -- the simulator and validator ---------------------------------------------------------------------------------
def _ground(atoms: tuple[Atom, ...], binding: Mapping[str, str]) -> list[Atom]:
    return [(atom[0], *(binding[param] for param in atom[1:])) for atom in atoms]


def _atom_false_reason(atom: Atom) -> str:
    """Why a precondition atom fails, in words: ("clear", "b") -> "b is not clear"."""
    match atom:
        case ("clear", block):
            return f"{block} is not clear"
        case ("ontable", block):
            return f"{block} is not on the table"
        case ("handempty",):
            return "the hand is not empty"
        case ("holding", block):
            return f"the hand is not holding {block}"
        case ("on", upper, lower):
            return f"{upper} is not on {lower}"
    return f"({' '.join(atom)}) is false"


def precondition_failure(world: World, action: Action, objects: Iterable[str] | None = None) -> str | None:
    """Why ``action`` cannot run in ``world`` (unknown action or block, wrong arity, a false precondition), or None."""
    schema = DOMAIN.get(action.name)
    if schema is None:
        return f"unknown action '{action.name}' (actions: {', '.join(DOMAIN)})"
    if len(action.args) != len(schema.params):
        return f"{action.name} takes {len(schema.params)} block(s), got {len(action.args)}"
    known = set(objects) if objects is not None else None
    unknown = [arg for arg in action.args if known is not None and arg not in known]
    if unknown:
        return f"unknown block(s) {', '.join(unknown)} (blocks: {', '.join(sorted(known or ()))})"
    binding = dict(zip(schema.params, action.args))
    missing = [atom for atom in _ground(schema.pre, binding) if atom not in world]
    return _atom_false_reason(missing[0]) if missing else None


def apply_action(world: World, action: Action) -> World:
    """The world after ``action`` (STRIPS: delete list, then add list); ValueError if a precondition fails."""
    reason = precondition_failure(world, action)
    if reason is not None:
        raise ValueError(f"{action} is not applicable: {reason}")
    schema = DOMAIN[action.name]
    binding = dict(zip(schema.params, action.args))
    return (world - frozenset(_ground(schema.delete, binding))) | frozenset(_ground(schema.add, binding))


def legal_actions(world: World) -> list[Action]:
    """Every applicable action in ``world``, sorted by their PDDL text.

    Candidates come from the atoms (what is clear, held, stacked) and each is checked against the domain's
    preconditions, so the list is exactly the applicable groundings without trying all block tuples.
    """
    blocks = {arg for atom in world for arg in atom[1:]}
    held = [atom[1] for atom in world if atom[0] == "holding"]
    candidates = [Action("pick-up", (b,)) for b in blocks] + [Action("put-down", (b,)) for b in held]
    candidates += [Action("unstack", atom[1:]) for atom in world if atom[0] == "on"]
    candidates += [Action("stack", (h, b)) for h in held for b in blocks]
    return sorted((a for a in candidates if precondition_failure(world, a) is None), key=str)


@dataclass(frozen=True)
class Verdict:
    """The validator's judgement of one plan (VAL's "Plan valid" is ``valid``)."""

    valid: bool  # every step applicable and the goal holds at the end
    failed_step: int | None  # 0-based index of the first inapplicable step; None when all applied
    reason: str  # "step 3 (stack a b): b is not clear" (1-based in the text), or why the goal is missed
    goal_reached: bool  # the goal holds after the steps that were applied (all, or those before failed_step)


def parse_pddl_action(text: str) -> Action | None:
    """``"(stack a b)"`` -> Action("stack", ("a", "b")); None when the text is not one parenthesised action."""
    match = re.fullmatch(r"\(\s*([a-z][\w-]*)((?:\s+[\w-]+)*)\s*\)", text.strip().lower())
    return Action(match.group(1), tuple(match.group(2).split())) if match else None


def run_plan(instance: Instance, plan: Sequence[Action | str]) -> tuple[World, Verdict]:
    """Simulate ``plan`` (actions or PDDL strings) from ``instance.init``; stop at the first inapplicable step.

    Returns the last world reached and the verdict.
    """
    world = instance.init
    for index, step in enumerate(plan):
        action = parse_pddl_action(step) if isinstance(step, str) else step
        if action is None:
            reason = f"step {index + 1} {step!r}: cannot read it as a PDDL action"
            return world, Verdict(False, index, reason, goal_reached(world, instance.goal))
        failure = precondition_failure(world, action, instance.objects)
        if failure is not None:
            reason = f"step {index + 1} {action}: {failure}"
            return world, Verdict(False, index, reason, goal_reached(world, instance.goal))
        world = apply_action(world, action)
    missing = [atom for atom in instance.goal if atom not in world]
    if missing:
        unmet = ", ".join(f"({' '.join(atom)})" for atom in missing)
        return world, Verdict(False, None, f"goal not reached after {len(plan)} steps: {unmet} false", False)
    return world, Verdict(True, None, f"plan valid: goal reached after {len(plan)} steps", True)


def validate(instance: Instance, plan: Sequence[Action | str]) -> Verdict:
    """spectot's plan validator (stands in for VAL): applicable step by step and the goal holds at the end."""
    return run_plan(instance, plan)[1]


def goal_reached(world: World, goal: Iterable[Atom]) -> bool:
    return all(atom in world for atom in goal)


def solve(init: World, goal: Iterable[Atom], max_steps: int | None = None) -> list[Action] | None:
    """An optimal plan by breadth-first search (ties broken by action text), or None within ``max_steps``."""
    goal = tuple(goal)
    if goal_reached(init, goal):
        return []
    parents: dict[World, tuple[World, Action] | None] = {init: None}
    frontier, depth = [init], 0
    while frontier and (max_steps is None or depth < max_steps):
        depth += 1
        next_frontier = []
        for world in frontier:
            for action in legal_actions(world):
                child = apply_action(world, action)
                if child in parents:
                    continue
                parents[child] = (world, action)
                if goal_reached(child, goal):
                    return _trace_back(parents, child)
                next_frontier.append(child)
        frontier = next_frontier
    return None


def _trace_back(parents: Mapping[World, tuple[World, Action] | None], world: World) -> list[Action]:
    plan = []
    while (link := parents[world]) is not None:
        world, action = link
        plan.append(action)
    return plan[::-1]


# -- text <-> PDDL -----------------------------------------------------------------------------------------------
def _sort_key(atom: Atom) -> str:
    return atom[0] + " " + " ".join(atom[1:])


def _join_and(parts: Sequence[str]) -> str:
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def atom_text(atom: Atom, config: BlocksConfig = DEFAULT_CONFIG) -> str:
    return config.predicates[atom[0]].format(*(config.objects[arg] for arg in atom[1:]))


def render_atoms(atoms: Iterable[Atom], config: BlocksConfig = DEFAULT_CONFIG) -> str:
    """PlanBench's text of a set of atoms: sorted, mapped through the config, ", "-joined with " and " last."""
    return _join_and([atom_text(atom, config) for atom in sorted(atoms, key=_sort_key)])


def render_action(action: Action, config: BlocksConfig = DEFAULT_CONFIG) -> str:
    """(unstack c d) -> "unstack the orange block from on top of the yellow block"."""
    return config.actions[action.name].format(*(config.objects[arg] for arg in action.args))


def _renderable(action: Action, config: BlocksConfig) -> bool:
    template = config.actions.get(action.name)
    known = all(arg in config.objects for arg in action.args)
    return template is not None and known and template.count("{}") == len(action.args)


def render_plan(plan: Iterable[Action | str], config: BlocksConfig = DEFAULT_CONFIG) -> str:
    """The ``gt_plan`` text: a newline, one action per line, then "[PLAN END]" and a newline."""
    actions = [_as_action(step) for step in plan]
    return "\n" + "".join(render_action(action, config) + "\n" for action in actions) + PLAN_END + "\n"


def _as_action(step: Action | str) -> Action:
    action = parse_pddl_action(step) if isinstance(step, str) else step
    if action is None:
        raise ValueError(f"not a PDDL action: {step!r}")
    return action


def render_statement(instance: Instance, config: BlocksConfig = DEFAULT_CONFIG) -> str:
    """The question llm-reasoners builds (``fill_template`` + "\\n"): [STATEMENT] ... [PLAN] and a newline."""
    init, goal = render_atoms(instance.init, config), render_atoms(instance.goal, config)
    return _statement_text(init, goal)


def _statement_text(init: str, goal: str) -> str:
    return (
        f"\n[STATEMENT]\nAs initial conditions I have that, {init.strip()}.\nMy goal is to have that {goal}."
        "\n\nMy plan is as follows:\n\n[PLAN]\n"
    )


def parse_action(text: str, config: BlocksConfig = DEFAULT_CONFIG) -> Action | None:
    """One line of plan text -> its action, or None. Case, extra spaces, a leading "1." / "Step 1:" / "-" and a
    trailing period are ignored.

    Accepts the English form ("Unstack the orange block from on top of the yellow block.") and the PDDL form
    ("(unstack c d)"). Blocks must be named in ``config.objects``. A line that is not the template word for
    word is read as llm-reasoners' ``text_to_plan_blocksworld`` reads it before VAL: the action named first
    anywhere in it, then the distinct blocks in the order they appear, as many as the action takes ("unstack the
    red block from the blue block" -> unstack a b; "stack the red block" -> None).
    """
    line = NUMBERING.sub("", " ".join(text.strip().lower().split())).rstrip(".").strip()
    if line.startswith("("):
        return parse_pddl_action(line)
    by_name = {name.lower(): obj for obj, name in config.objects.items()}
    for action_name, template in config.actions.items():
        pattern = r"\s+".join(re.escape(word) for word in template.lower().split()).replace(r"\{\}", "(.+?)")
        match = re.fullmatch(pattern, line)
        if match and all(name in by_name for name in match.groups()):
            blocks = tuple(by_name[name] for name in match.groups())
            return Action(action_name, blocks) if len(set(blocks)) == len(blocks) else None  # one block, named twice
    return _action_by_keywords(line, config, by_name)


def _action_by_keywords(line: str, config: BlocksConfig, by_name: dict[str, str]) -> Action | None:
    """The action whose words come first in ``line`` ("next, unstack ..." too; a whole word: "stack" is not read
    inside "unstack") and the distinct blocks it names, in order of appearance; None unless there are exactly as
    many as the action takes ("stack the red block on the red block" names one)."""
    verbs = {
        name: template.lower().split("{}")[0].removesuffix("the ").strip() for name, template in config.actions.items()
    }
    named = [(m.start(), name) for name, verb in verbs.items() for m in re.finditer(rf"\b{re.escape(verb)}\b", line)]
    if not named:
        return None
    action_name = min(named)[1]
    found = sorted(
        (m.start(), obj) for name, obj in by_name.items() for m in re.finditer(rf"\b{re.escape(name)}\b", line)
    )
    blocks = tuple(dict.fromkeys(obj for _, obj in found))
    return Action(action_name, blocks) if len(blocks) == config.actions[action_name].count("{}") else None


def parse_plan_text(text: str, config: BlocksConfig = DEFAULT_CONFIG) -> list[Action]:
    """The actions of a plan text, up to "[PLAN END]"; lines that are not actions are skipped.

    Skipping follows llm-reasoners' ``text_to_plan_blocksworld``, which drops lines it cannot read before VAL.
    """
    actions = []
    for line in text.splitlines():
        end = line.lower().find(PLAN_END.lower())
        action = parse_action(line if end < 0 else line[:end], config)  # "<action> [PLAN END]": the action counts
        if action is not None:
            actions.append(action)
        if end >= 0:
            break
    return actions


# -- loaders -----------------------------------------------------------------------------------------------------
def load_problems(path: str | Path, limit: int = 0, config: BlocksConfig = DEFAULT_CONFIG) -> list[Problem]:
    """Problems from a step-6 list (``split_*_data.json``, ``full_step_6.json``) or a ``*_rendered.jsonl``.

    Instance paths resolve against the file's folder (``instances/<set>/instance-N.pddl``); jsonl records
    may carry the instance inline as ``instance_pddl`` instead (what ``to_record`` writes). ``limit`` > 0
    keeps the first ``limit`` problems.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        return _load_jsonl(path, limit, config)
    if path.suffix == ".json":
        return _load_json_list(path, limit, config)
    raise DataError(f"{path}: expected a .json plan list or a .jsonl file")


def _load_json_list(path: Path, limit: int, config: BlocksConfig) -> list[Problem]:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        entries = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(entries, list):
        raise DataError(f"{path}: expected a JSON list of [instance_path, plan, num_steps] entries")
    problems = []
    for number, entry in enumerate(entries[:limit] if limit else entries, start=1):
        where = f"{path}: entry {number}"
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise DataError(f"{where}: expected [instance_path, plan, num_steps], got {str(entry)[:80]}")
        local = _local_instance_path(entry[0])
        instance = _read_instance_at(path.parent / local, where)
        problem_id = f"{local.parent.name}/{local.stem}"
        problems.append(_make_problem(problem_id, instance, entry[1], entry[2], where, config))
    return problems


def _local_instance_path(origin_path: str) -> Path:
    """ ".../instances/blocksworld/generated_basic/instance-348.pddl" -> instances/generated_basic/instance-348.pddl."""
    return Path("instances", *Path(origin_path).parts[-2:])


def _load_jsonl(path: Path, limit: int, config: BlocksConfig) -> list[Problem]:
    problems = []
    for number, record in iter_jsonl(path):
        where = f"{path}:{number}"
        problem_id, instance = _record_instance(record, path.parent, where)
        problem_id = str(record.get("id") or problem_id or f"line-{number}")
        plan_text, num_steps = record.get("gt_plan_pddl"), record.get("num_steps")
        problems.append(_make_problem(problem_id, instance, plan_text, num_steps, where, config))
        if limit and len(problems) == limit:
            break
    return problems


def _record_instance(record: dict[str, Any], folder: Path, where: str) -> tuple[str | None, Instance]:
    """(id from the instance file or None, the instance) of a jsonl record: ``instance_file`` or ``instance_pddl``."""
    if isinstance(record.get("instance_pddl"), str):
        return None, parse_instance(record["instance_pddl"], f"{where} (instance_pddl)")
    if isinstance(record.get("instance_file"), str):
        local = Path(record["instance_file"])
        return f"{local.parent.name}/{local.stem}", _read_instance_at(folder / local, where)
    raise DataError(f"{where}: needs a string 'instance_file' or 'instance_pddl' (fields: {', '.join(record)})")


def _read_instance_at(instance_file: Path, where: str) -> Instance:
    if not instance_file.is_file():
        raise DataError(f"{where}: instance file {instance_file} not found")
    return read_instance(instance_file)


def _make_problem(
    problem_id: str, instance: Instance, plan_text: Any, num_steps: Any, where: str, config: BlocksConfig
) -> Problem:
    """question = the rendered statement, answer = the gold plan as PDDL strings, meta = the parsed instance."""
    if not isinstance(plan_text, str):
        raise DataError(f"{where}: the gold plan must be a string of PDDL actions, one per line")
    plan = _gold_plan(plan_text, where)
    if num_steps is not None and num_steps != len(plan):
        raise DataError(f"{where}: num_steps is {num_steps} but the gold plan has {len(plan)} actions")
    meta = {"instance": instance, "source": where}
    return Problem(problem_id, render_statement(instance, config), [str(action) for action in plan], meta)


def _gold_plan(plan_text: str, where: str) -> list[Action]:
    plan = []
    for line in filter(None, (line.strip() for line in plan_text.splitlines())):
        action = parse_pddl_action(line)
        if action is None:
            raise DataError(f"{where}: gold plan line {line!r} is not a PDDL action")
        plan.append(action)
    return plan


def to_record(problem: Problem, config: BlocksConfig = DEFAULT_CONFIG) -> dict[str, Any]:
    """A jsonl record (the rendered-jsonl fields, with the instance inline) that ``load_problems`` reads back."""
    instance = problem_instance(problem)
    return {
        "id": problem.id,
        "instance_pddl": instance_to_pddl(instance),
        "gt_plan_pddl": "".join(step + "\n" for step in problem.answer),
        "num_steps": len(problem.answer),
        "init": render_atoms(instance.init, config),
        "goal": render_atoms(instance.goal, config),
        "gt_plan": render_plan(problem.answer, config),
        "question": problem.question,
    }


def problem_instance(problem: Problem) -> Instance:
    instance = problem.meta.get("instance")
    if not isinstance(instance, Instance):
        raise ValueError(
            f"problem {problem.id} has no parsed instance in meta['instance']; "
            "make problems with load_problems or generate_instances"
        )
    return instance


# -- generator ---------------------------------------------------------------------------------------------------
def _random_towers(blocks: Sequence[str], rng: random.Random) -> list[list[str]]:
    """Blocks in a random order, cut into towers at random points (bottom block first)."""
    order = list(blocks)
    rng.shuffle(order)
    towers = [[order[0]]]
    for block in order[1:]:
        if rng.random() < 0.5:
            towers.append([block])
        else:
            towers[-1].append(block)
    return towers


def towers_world(towers: Sequence[Sequence[str]]) -> World:
    """The world of hand-empty towers, each listed bottom block first."""
    atoms: set[Atom] = {("handempty",)}
    for tower in towers:
        atoms |= {("ontable", tower[0]), ("clear", tower[-1])}
        atoms |= {("on", upper, lower) for lower, upper in zip(tower, tower[1:])}
    return frozenset(atoms)


def _random_goal(blocks: Sequence[str], rng: random.Random) -> tuple[Atom, ...]:
    """The `on` atoms of a random configuration that stacks at least two blocks (PlanBench goals name only `on`)."""
    while True:
        goal = sorted(atom for atom in towers_world(_random_towers(blocks, rng)) if atom[0] == "on")
        if goal:
            return tuple(goal)


def generate_instances(
    num_blocks: int,
    count: int,
    seed: int,
    min_steps: int = 1,
    max_steps: int = 6,
    config: BlocksConfig = DEFAULT_CONFIG,
) -> list[Problem]:
    """``count`` distinct random instances whose optimal plan (by BFS) has ``min_steps``..``max_steps`` actions.

    Blocks are the first ``num_blocks`` objects of the config (a, b, c, ...). Initial worlds are random hand-empty
    towers; goals are the `on` atoms of another random configuration. Same arguments, same problems. BFS cost grows
    quickly with blocks and ``max_steps`` (6 blocks: about 7,000 worlds in all).
    """
    if not 2 <= num_blocks <= len(config.objects):
        raise ValueError(f"num_blocks must be 2..{len(config.objects)} (the config names that many blocks)")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps} and {max_steps}")
    rng, blocks = random.Random(seed), tuple(sorted(config.objects)[:num_blocks])
    problems: list[Problem] = []
    seen: set[tuple[World, tuple[Atom, ...]]] = set()
    for _ in range(1000 * count):
        if len(problems) == count:
            break
        init, goal = towers_world(_random_towers(blocks, rng)), _random_goal(blocks, rng)
        plan = None if (init, goal) in seen else solve(init, goal, max_steps)
        seen.add((init, goal))
        if plan is not None and len(plan) >= min_steps:
            name = f"bw-gen-{num_blocks}-{seed}-{len(problems)}"  # lowercase: PDDL reads back lowercased
            problems.append(_generated_problem(Instance(blocks, init, goal, name), plan, config))
    if len(problems) < count:
        raise ValueError(
            f"found only {len(problems)} of {count} distinct {num_blocks}-block instances with "
            f"{min_steps}..{max_steps}-step optimal plans; widen the step range or use more blocks"
        )
    return problems


def _generated_problem(instance: Instance, plan: Sequence[Action], config: BlocksConfig) -> Problem:
    meta = {"instance": instance, "source": f"generated: {instance.name}"}
    return Problem(instance.name, render_statement(instance, config), [str(a) for a in plan], meta)


# -- prompts -----------------------------------------------------------------------------------------------------
class Demo(NamedTuple):
    init: str  # rendered atoms, no final period
    goal: str
    plan: str  # the gt_plan text: "\n<action>\n...[PLAN END]\n"


@dataclass(frozen=True)
class PromptPool:
    """The few-shot material of RAP's ``pool_prompt_v1.json``: the domain rules, demos and the self-eval prompt."""

    intro: str
    demos: tuple[Demo, ...]
    self_eval: str  # holds <init_state>, <goals> and <action>


_SELF_EVAL_SLOTS = ("<init_state>", "<goals>", "<action>")


def read_prompt_pool(path: str | Path) -> PromptPool:
    """A RAP prompt pool json (keys ``intro``, ``example_pool`` [{init, goal, plan}], ``self-eval``)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        raw = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) for k in ("intro", "self-eval")):
        raise DataError(f"{path}: needs string fields 'intro' and 'self-eval'")
    missing = [slot for slot in _SELF_EVAL_SLOTS if slot not in raw["self-eval"]]
    if missing:
        raise DataError(f"{path}: 'self-eval' lacks the placeholder(s) {', '.join(missing)}")
    return PromptPool(raw["intro"], _read_demos(raw.get("example_pool"), path), raw["self-eval"])


def _read_demos(pool: Any, path: Path) -> tuple[Demo, ...]:
    if not isinstance(pool, list) or not pool:
        raise DataError(f"{path}: 'example_pool' must be a non-empty list")
    demos = []
    for number, item in enumerate(pool, start=1):
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in Demo._fields):
            raise DataError(f"{path}: example_pool entry {number} needs string fields init, goal and plan")
        demos.append(Demo(item["init"], item["goal"], item["plan"]))
    return tuple(demos)


def demo_problems(problems: Iterable[Problem], demos: Sequence[Demo]) -> list[Problem]:
    """The ``problems`` whose [STATEMENT] is one of the ``demos``' (whitespace aside)."""
    statements = {_words(_statement_text(d.init, d.goal)) for d in demos}
    return [p for p in problems if _words(p.question) in statements]


def _words(text: str) -> str:
    return " ".join(text.split())


def demo_text(demo: Demo) -> str:
    """One demonstration as llm-reasoners' ``get_icl`` writes it: [STATEMENT] ... [PLAN] <plan> [PLAN END]."""
    return _statement_text(demo.init, demo.goal).removesuffix("\n") + demo.plan


def _self_eval_example(init: str, goal: str, action: str, verdict: str) -> str:
    return (
        f"[STATEMENT]\nAs initial conditions I have that, {init}.\nMy goal is to have that {goal}.\n"
        f"[ACTION]\n{action}\n[EVALUATION]\n{verdict}\n\n"
    )


BUILTIN_INTRO = (  # spectot's own wording of the 4-operator rules, for use without a prompt pool file
    "I am moving toy blocks to build stacks. Four moves are possible:\n\n"
    "Pick up a block from the table\nUnstack a block from on top of another block\n"
    "Put down the block I hold onto the table\nStack the block I hold on top of another block\n\n"
    "The rules of these moves:\n"
    "My hand holds at most one block, and I can pick up or unstack a block only while my hand is empty.\n"
    "A block is clear when no block sits on it and it is not in my hand.\n"
    "I can pick up a block only if it is clear and sits on the table.\n"
    "I can unstack a block only if it is clear and really sits on top of the other block.\n"
    "I can put down or stack only the block in my hand, and I can stack it only onto a clear block.\n"
    "After I pick up or unstack a block I hold it; after I put down or stack a block my hand is empty.\n\n"
)


def builtin_prompt_pool(config: BlocksConfig = DEFAULT_CONFIG) -> PromptPool:
    """A prompt pool that needs no data files: BUILTIN_INTRO, two generated demos and a self-eval prompt.

    The self-eval examples judge a demo's first gold action "good" and a legal action that brings the goal no
    closer (by BFS distance) "bad".
    """
    problems = generate_instances(num_blocks=4, count=2, seed=2024, min_steps=4, max_steps=4, config=config)
    demos, examples = [], []
    for problem in problems:
        instance = problem_instance(problem)
        init, goal = render_atoms(instance.init, config), render_atoms(instance.goal, config)
        demos.append(Demo(init, goal, render_plan(problem.answer, config)))
        good = _as_action(problem.answer[0])
        bad = _unhelpful_action(instance, len(problem.answer))
        examples.append(_self_eval_example(init, goal, render_action(good, config), "good"))
        examples.append(_self_eval_example(init, goal, render_action(bad, config), "bad"))
    self_eval = (
        BUILTIN_INTRO
        + "Please judge whether the given action is a good next step toward the goal.\n\n"
        + "".join(examples)
        + "[STATEMENT]\nAs initial conditions I have that, <init_state>\nMy goal is to <goals>\n"
        "[ACTION]\n<action>\n[EVALUATION]\n"
    )
    return PromptPool(BUILTIN_INTRO, tuple(demos), self_eval)


def _unhelpful_action(instance: Instance, distance: int) -> Action:
    """The first legal action after which the goal is still ``distance`` or more actions away (no progress)."""
    for action in legal_actions(instance.init):
        rest = solve(apply_action(instance.init, action), instance.goal)
        if rest is None or len(rest) >= distance:
            return action
    raise ValueError(f"every legal action in {instance.name} is optimal; pick another demo seed")


# -- the task ----------------------------------------------------------------------------------------------------
class BlocksworldTask(Task):
    """RAP's Blocksworld as a step-by-step task: one action per step, judged "good"/"bad" by the model.

    A state is final when it ends in "[PLAN END]", when its actions reach the goal, or at ``depth`` steps
    (default 7: up to 6 actions, then the end marker). The demos are the pool's first ``num_shots`` (RAP samples
    4 of 10 at random): fixed, so runs repeat exactly and every problem's prompt shares one prefix.
    ``prompt_pool`` is a RAP pool json (``pool_prompt_v1.json``), a PromptPool, or None for the built-in pool.
    """

    name = "blocksworld"
    value_range = (0.0, 1.0)  # self-evaluation: bad / good
    # RAP's prompts are few-shot continuations ending in "[PLAN]\n" / "[EVALUATION]\n", fed as text: through its
    # chat template SmolLM2 wrote 0 readable actions in 9 samples, as text 9 of 9 (3 problems x 3 samples)
    chat = False

    def __init__(
        self,
        prompt_pool: str | Path | PromptPool | None = None,
        config: BlocksConfig = DEFAULT_CONFIG,
        depth: int = 7,
        num_shots: int = 4,
    ) -> None:
        if depth < 1 or num_shots < 0:
            raise ValueError(f"need depth >= 1 and num_shots >= 0, got depth={depth}, num_shots={num_shots}")
        if isinstance(prompt_pool, PromptPool):
            self.pool = prompt_pool
        else:
            self.pool = read_prompt_pool(prompt_pool) if prompt_pool is not None else builtin_prompt_pool(config)
        self.config, self.depth, self.num_shots = config, depth, num_shots
        self._demos = "\n".join(demo_text(demo) for demo in self.pool.demos[:num_shots])

    def check_problems(self, problems: Sequence[Problem]) -> None:
        """A problem that is one of the prompt's demos has its gold plan in every prompt: refused, by id (pool v2's
        first demos are split v1's lines 2, 110 and 114)."""
        leaked = [p.id for p in demo_problems(problems, self.pool.demos[: self.num_shots])]
        if leaked:
            raise DataError(
                f"problems {', '.join(leaked)} are demos of the prompt pool: their plans are in every prompt. Use the "
                "pool that matches the data split (pool_prompt_v1.json with split_v1, v2 with v2), or leave them "
                "out (--offset / --limit)"
            )

    def thought(self, problem: Problem, state: State) -> StepRequest:
        """Rules, demos, the problem's [STATEMENT] ... [PLAN] and the actions so far; the model adds one line."""
        prompt = self.pool.intro + self._demos + problem.question + "".join(step + "\n" for step in state)
        return StepRequest(prompt, stop=("\n",), max_new_tokens=24)

    def parse_thought(self, problem: Problem, state: State, text: str) -> str:
        line = next((line.strip() for line in text.splitlines() if line.strip()), "")
        end = line.lower().find(PLAN_END.lower())
        if end >= 0:  # "<action> [PLAN END]": the action is the step (the plan ends once it reaches the goal)
            action = parse_action(line[:end], self.config)
            return render_action(action, self.config) if action and _renderable(action, self.config) else PLAN_END
        action = parse_action(line, self.config)
        return render_action(action, self.config) if action and _renderable(action, self.config) else line

    def value(self, problem: Problem, state: State) -> StepRequest:
        """RAP's self-eval prompt for the last action, in the world the earlier actions lead to.

        The earlier actions are simulated up to the first one that cannot run (an unreadable one is skipped); the
        judgement of that is left to the model.
        """
        if not state:
            raise ValueError("value() needs a state with at least one step")
        world, _ = run_plan(problem_instance(problem), self._actions(state[:-1]))
        # RAP fills the slots with the statement's own text: "<state>." and "have that <goal>."
        goals = f"have that {render_atoms(problem_instance(problem).goal, self.config)}."
        prompt = (
            self.pool.self_eval.replace("<init_state>", render_atoms(world, self.config) + ".")
            .replace("<goals>", goals)
            .replace("<action>", state[-1])
        )
        return StepRequest(prompt, stop=("\n",), max_new_tokens=4)

    def parse_value(self, text: str) -> float:
        words = text.strip().lower().split()
        return 1.0 if words and words[0].strip(".") == "good" else 0.0

    def is_final(self, problem: Problem, state: State) -> bool:
        if not state:
            return False
        if state[-1] == PLAN_END or len(state) >= self.depth:
            return True
        return validate(problem_instance(problem), self._actions(state)).valid

    def final_answer(self, problem: Problem, state: State) -> str:
        return "\n".join(step for step in state if step != PLAN_END)

    def grade(self, problem: Problem, answer: str) -> float:
        plan = parse_plan_text(answer, self.config)
        return 1.0 if validate(problem_instance(problem), plan).valid else 0.0

    def _actions(self, steps: Sequence[str]) -> list[Action]:
        """Steps as actions; an unreadable one is skipped, as ``grade`` (llm-reasoners' reading of a plan) skips it:
        kept as text it failed the plan here, so the search went on adding actions to a plan graded as solved."""
        return [action for step in steps if step != PLAN_END and (action := parse_action(step, self.config))]
