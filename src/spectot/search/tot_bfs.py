"""Tree-of-Thoughts breadth-first search (Yao et al. 2023; SEED's Algorithm 1).

    S_0 = {x}
    for t = 1..T:
        S'_t = {[s, z] | s in S_{t-1}, z in G(p_theta, s, n)}     # Thought Generator: n thoughts per state
        V_t  = E(p_theta, S'_t)                                  # State Evaluator
        S_t  = argmax_{S in S'_t, |S| = b} sum_{s in S} V_t(s)   # keep the b best
    return G(p_theta, argmax_{s in S_T} V_T(s), 1)               # the answer of the best state

G samples n thoughts per state (``sample``) or proposes n in one output (``propose``); E scores each
new state (``value``: a state met again in the level scores 0, as in ToT's code) or lets ``n_votes`` votes pick
among the siblings (``vote``). A state the task
calls final is not expanded again but competes with the newer ones. Every level's G (and E) calls go
to the policy at once, so its backend can schedule them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spectot.search.policy import Policy
from spectot.tasks.base import Problem, State, Task

Generation = Literal["sample", "propose"]
Evaluation = Literal["value", "vote"]


@dataclass(frozen=True)
class BfsConfig:
    breadth: int = 1  # b: states kept per level
    thoughts: int = 3  # n: thoughts generated per state
    generation: Generation = "sample"
    evaluation: Evaluation = "value"
    n_votes: int = 3  # votes per level (evaluation = "vote")
    steps: int = 0  # T: 0 = the task's depth

    def __post_init__(self) -> None:
        for name in ("breadth", "thoughts", "n_votes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0 (0 = the task's depth), got {self.steps}")


@dataclass
class Node:
    state: State
    value: float = 0.0
    raw: str = ""  # the thought's raw text (G's output)
    judgement: list[str] = field(default_factory=list)  # E's raw outputs


@dataclass
class SearchResult:
    problem: Problem
    answer: str
    best: Node
    levels: list[list[Node]]  # every evaluated state, level by level
    kept: list[list[State]]  # S_t

    def to_dict(self) -> dict:
        return {
            "id": self.problem.id,
            "answer": self.answer,
            "best_state": list(self.best.state),
            "best_value": self.best.value,
            "levels": [
                [{"state": list(n.state), "value": n.value, "judgement": n.judgement} for n in lv] for lv in self.levels
            ],
        }


def select_best(nodes: list[Node], b: int) -> list[Node]:
    """The b highest-valued nodes; ties keep generation order (a stable sort)."""
    return sorted(nodes, key=lambda n: -n.value)[:b]


def _zero_repeats(children: list[Node]) -> None:
    """A state met again in the level is worth 0 (ToT's ``local_value_cache``): b copies of one state filled every
    slot and the search went on b times over one branch. Every child is still evaluated, so the evaluations' seeds
    (and a chaining backend's, which evaluates each thought as it ends) do not depend on which ones repeat."""
    seen: set[State] = set()
    for c in children:
        if c.state in seen:
            c.value = 0.0
        seen.add(c.state)


def tally_votes(votes: list[int | None], n: int) -> list[float]:
    """Votes for each of n choices (unreadable votes count for none)."""
    counts = [0.0] * n
    for v in votes:
        if v is not None:
            counts[v] += 1
    return counts


def tot_bfs(task: Task, problem: Problem, policy: Policy, config: BfsConfig) -> SearchResult:
    steps = config.steps or task.depth
    frontier = [Node(())]
    levels: list[list[Node]] = []
    kept: list[list[State]] = []
    for t in range(steps):
        open_nodes = [n for n in frontier if not task.is_final(problem, n.state)]
        if not open_nodes:
            break
        if config.generation == "sample" and config.evaluation == "value":
            children = _expand_and_value(task, problem, policy, config, open_nodes, t)
        else:
            children = _expand(task, problem, policy, config, open_nodes, t)
            _evaluate(task, problem, policy, config, children, t)
        if config.evaluation == "value":
            _zero_repeats(children)
        levels.append(children)
        finished = [n for n in frontier if task.is_final(problem, n.state)]
        selected = select_best(children + finished, config.breadth)
        if not selected:  # nothing was proposed (every proposal empty): the search ends where it stands
            break
        frontier = selected
        kept.append([n.state for n in frontier])
    best = frontier[0]
    return SearchResult(problem, task.final_answer(problem, best.state), best, levels, kept)


# -- phases -----------------------------------------------------------------------------------
def _expand_and_value(
    task: Task, problem: Problem, policy: Policy, config: BfsConfig, nodes: list[Node], t: int
) -> list[Node]:
    """G then E for sampled thoughts valued one by one: each thought's evaluation needs only that
    thought, so a chaining backend starts it as soon as the thought is done."""
    parents = [n for n in nodes for _ in range(config.thoughts)]

    def child(i: int, text: str) -> Node:
        return Node(parents[i].state + (task.parse_thought(problem, parents[i].state, text),), raw=text)

    requests = [task.thought(problem, p.state) for p in parents]
    texts, judged = policy.generate_then_evaluate(
        requests, lambda i, text: task.value(problem, child(i, text).state), problem.id, t
    )
    children = [child(i, text) for i, text in enumerate(texts)]
    for c, text in zip(children, judged):
        c.value, c.judgement = task.parse_value(text), [text]
    return children


def _expand(task: Task, problem: Problem, policy: Policy, config: BfsConfig, nodes: list[Node], t: int) -> list[Node]:
    if config.generation == "sample":
        requests = [task.thought(problem, n.state) for n in nodes for _ in range(config.thoughts)]
        texts = policy.generate(requests, problem.id, t)
        parents = [n for n in nodes for _ in range(config.thoughts)]
        return [
            Node(p.state + (task.parse_thought(problem, p.state, text),), raw=text) for p, text in zip(parents, texts)
        ]
    requests = [task.propose(problem, n.state, config.thoughts) for n in nodes]
    texts = policy.generate(requests, problem.id, t)
    children = []
    for n, text in zip(nodes, texts):
        for proposal in task.parse_proposals(problem, n.state, text)[: config.thoughts]:
            if step := task.parse_thought(problem, n.state, proposal):  # normalised as a sampled thought is
                children.append(Node(n.state + (step,), raw=text))
    return children


def _evaluate(task: Task, problem: Problem, policy: Policy, config: BfsConfig, children: list[Node], t: int) -> None:
    if not children:
        return
    if config.evaluation == "value":
        texts = policy.evaluate([task.value(problem, c.state) for c in children], problem.id, t)
        for c, text in zip(children, texts):
            c.value, c.judgement = task.parse_value(text), [text]
        return
    request = task.vote(problem, [c.state for c in children])
    texts = policy.evaluate([request] * config.n_votes, problem.id, t)
    counts = tally_votes([task.parse_vote(text, len(children)) for text in texts], len(children))
    for c, count in zip(children, counts):
        c.value, c.judgement = count, texts
