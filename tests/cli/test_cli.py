"""The `spectot` command line on a tiny local checkpoint: JSON output, errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from spectot.cli.main import main


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_does_not_import_torch() -> None:
    code = "import sys; from spectot.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_generate_json_sd_equals_ar(capsys, checkpoint, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"q": "w1 w2 w3 w1 w2"}\n\n{"q": "w5 w6"}\n')
    common = [
        "generate",
        "--target",
        str(checkpoint),
        "--dtype",
        "fp32",
        "--no-chat-template",
        "--prompts",
        str(prompts),
    ]
    common += ["--field", "q", "--max-new-tokens", "12", "--json"]
    code, out_ar, _ = run(capsys, *common, "--method", "ar")
    assert code == 0
    code, out_sd, _ = run(capsys, *common, "--method", "sd", "--draft", "ngram")
    assert code == 0
    ar = [json.loads(line) for line in out_ar.splitlines()]
    sd = [json.loads(line) for line in out_sd.splitlines()]
    assert len(ar) == len(sd) == 2
    assert [r["token_ids"] for r in sd] == [r["token_ids"] for r in ar]
    for record in sd:
        assert set(record) >= {"text", "token_ids", "stats", "finish_reason"}
        assert record["stats"]["new_tokens"] == len(record["token_ids"])
        assert record["stats"]["mean_acceptance_length"] >= 1.0


def test_generate_offset_and_limit_pick_the_prompts(capsys, checkpoint, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"q": "w{i} w{i + 1}"}}\n' for i in range(5)))
    common = ["generate", "--target", str(checkpoint), "--dtype", "fp32", "--no-chat-template", "--method", "ar"]
    common += ["--prompts", str(prompts), "--field", "q", "--max-new-tokens", "2", "--json"]
    code, out, _ = run(capsys, *common, "--offset", "1", "--limit", "2")
    assert code == 0
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == ["w1 w2", "w2 w3"]
    code, out, _ = run(capsys, *common, "--offset", "3")
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == ["w3 w4", "w4 w5"]
    code, _, err = run(capsys, *common, "--offset", "-1")
    assert code == 2 and "--offset and --limit" in err


def test_malformed_prompt_line_is_named(capsys, checkpoint, tmp_path) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"question": "w1"}\n{"question": oops}\n')
    code, _, err = run(capsys, "generate", "--target", str(checkpoint), "--prompts", str(prompts))
    assert code == 2
    assert "bad.jsonl:2" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "sd", "--draft", "none"], "needs a draft"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens"),
        (["--draft", "ngram", "--tree", "pct"], "--draft ngram has none"),
        (["--temperature", "inf"], "--temperature must be a finite number"),
        (["--method", "ar", "--draft", "vdm"], "with --method ar it would be unused"),
        (["--method", "ar", "--num-draft-tokens", "9"], "--num-draft-tokens shape speculative decoding"),
    ],
)
def test_bad_flags_exit_2_with_a_fix(capsys, checkpoint, argv: list[str], message: str) -> None:
    code, _, err = run(capsys, "generate", "--target", str(checkpoint), "--prompt", "w1", *argv)
    assert code == 2
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--draft", "vdm"], "with --method ar it would be unused"),  # serve's --method defaults to ar
        (["--method", "ar", "--num-draft-tokens", "9", "--k-config", "4,2"], "--num-draft-tokens, --k-config shape"),
        (["--shutdown-grace", "inf"], "--shutdown-grace must be a finite number"),
    ],
)
def test_serve_refuses_draft_flags_it_would_ignore(capsys, checkpoint, argv: list[str], message: str) -> None:
    """serve (and generate) under --method ar served plain decoding with the draft flags ignored in silence."""
    code, _, err = run(capsys, "serve", "--target", str(checkpoint), "--port", "0", *argv)
    assert code == 2
    assert message in err


def generate_fp32(checkpoint: Path, *flags: str) -> list[str]:
    """`spectot generate` on the tiny checkpoint, exact and without a chat template."""
    return ["generate", "--target", str(checkpoint), "--dtype", "fp32", "--no-chat-template", *flags]


def test_prompt_longer_than_the_context_is_refused(capsys, checkpoint) -> None:
    long_prompt = " ".join(["w1"] * 300)  # with 1800 new tokens: past the tiny model's 2048 positions
    code, _, err = run(capsys, *generate_fp32(checkpoint, "--max-new-tokens", "1800"), "--prompt", long_prompt)
    assert code == 2
    assert "context" in err


def test_an_over_long_prompt_late_in_a_file_is_refused_before_any_decoding(capsys, checkpoint, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"q": "w1 w2"}\n{"q": "w3"}\n' + json.dumps({"q": " ".join(["w1"] * 300)}) + "\n")
    out = tmp_path / "out.jsonl"
    flags = ["--prompts", str(prompts), "--field", "q", "--out", str(out)]
    code, _, err = run(capsys, *generate_fp32(checkpoint, "--max-new-tokens", "1800"), *flags)
    assert code == 2
    assert "p.jsonl: prompt 3 has" in err and "context" in err
    assert not out.exists()  # nothing was decoded, so nothing is lost


def test_a_directory_where_a_file_goes_is_an_error_not_a_traceback(capsys, checkpoint, tmp_path) -> None:
    folder = tmp_path / "prompts.jsonl"
    folder.mkdir()
    code, _, err = run(capsys, "generate", "--target", str(checkpoint), "--prompts", str(folder))
    assert code == 2
    assert str(folder) in err and "Traceback" not in err


def test_nothing_to_do_is_an_error_before_the_model_loads(capsys, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "w1", "answer": "#### 1"}\n')
    missing_model = str(tmp_path / "no-such-model")  # never reached: the selection is checked first
    code, _, err = run(capsys, "generate", "--target", missing_model, "--prompts", str(prompts), "--offset", "5")
    assert code == 2 and "no prompts from --offset 5" in err
    code, _, err = run(capsys, "solve", "--target", missing_model, "--data", str(prompts), "--offset", "5")
    assert code == 2 and "no problems from offset 5" in err


def test_models_lists_the_default_alias(capsys) -> None:
    code, out, _ = run(capsys, "models")
    assert code == 0
    assert "smollm2-135m" in out


def test_no_boolean_flag_is_named_no_something() -> None:
    """argparse's BooleanOptionalAction reads any `--no-...` spelling as False: a field `no_x`
    would make `--no-x` switch it off (this shipped once for --no-hidden)."""
    import dataclasses

    from spectot import config

    classes = [c for c in vars(config).values() if dataclasses.is_dataclass(c)]
    bad = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c) if f.name.startswith("no_")]
    assert not bad


def test_train_draft_ablation_flag_turns_hidden_states_off(tmp_path) -> None:
    from spectot.cli.flags import from_flags
    from spectot.cli.main import build_parser
    from spectot.config import TrainDraftOptions

    corpus = tmp_path / "x.jsonl"
    corpus.write_text('{"text": "w1 w2"}\n')
    args = build_parser().parse_args(["train-draft", "--corpus", str(corpus), "--no-hidden-states"])
    assert from_flags(args, TrainDraftOptions).hidden_states is False


def test_generate_out_appends_batches_and_resumes_after_a_kill(capsys, checkpoint, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"w{i} w{i + 1} w{i}"}) + "\n" for i in range(1, 6)))
    out = tmp_path / "new" / "out.jsonl"  # its folder is made
    argv = ["generate", "--target", str(checkpoint), "--dtype", "fp32", "--no-chat-template"]
    argv += ["--prompts", str(prompts), "--method", "ar", "--max-new-tokens", "6", "--batch-size", "2"]
    argv += ["--out", str(out)]
    code, _, err = run(capsys, *argv)
    assert code == 0 and "5/5 prompts" in err
    full = out.read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in full] == [f"w{i} w{i + 1} w{i}" for i in range(1, 6)]
    # killed after the first batch, mid-way through writing the second
    out.write_text(full[0] + "\n" + full[1] + "\n" + full[2][:17])
    code, _, err = run(capsys, *argv)
    assert code == 0 and "2/5 prompts" not in err and "4/5 prompts" in err  # resumed at prompt 3, not 1
    again = out.read_text().splitlines()
    assert again[:2] == full[:2]
    assert [json.loads(line)["token_ids"] for line in again] == [json.loads(line)["token_ids"] for line in full]
    code, _, err = run(capsys, *argv)
    assert code == 0 and "already done" in err
    # the same prompts under another setup would mix two corpora in one file
    out.write_text(full[0] + "\n")
    code, _, err = run(capsys, *argv, "--temperature", "1.0")
    assert code == 2 and "holds generations of another setup (sampling differ" in err
    assert out.read_text() == full[0] + "\n"
    for torn in ("garbage", "[1]"):  # a bare parser message, and an AttributeError traceback, before
        Path(str(out) + ".run.json").write_text(torn)
        code, _, err = run(capsys, *argv)
        assert code == 2 and "out.jsonl.run.json: not the setup `spectot generate` writes" in err
    # without its setup file a resume could mix setups too (another temperature was taken and appended)
    Path(str(out) + ".run.json").unlink()
    code, _, err = run(capsys, *argv, "--temperature", "1.0")
    assert code == 2 and "holds 1 generations but no out.jsonl.run.json" in err
    assert out.read_text() == full[0] + "\n"


def test_generate_out_refuses_another_jobs_file(capsys, checkpoint, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "w1"}\n{"question": "w2"}\n')
    out = tmp_path / "out.jsonl"
    other = json.dumps({"prompt": "w1"}) + "\n" + json.dumps({"prompt": "w9"}) + "\n"
    out.write_text(other)
    argv = ["generate", "--target", str(checkpoint), "--no-chat-template", "--prompts", str(prompts)]
    code, _, err = run(capsys, *argv, "--method", "ar", "--out", str(out))
    assert code == 2 and "out.jsonl:2" in err and "another prompt" in err
    assert out.read_text() == other


def test_tree_measure_counts_the_draft_alone(capsys, checkpoint, tmp_path) -> None:
    """`tree measure` decodes with the star of the draft's W best tokens and nothing else: the lookup branch
    that --draft edd grafts by default would add ranks past W (it crashed the count once)."""
    import torch

    from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint
    from spectot.models.loader import load_model

    target = load_model(str(checkpoint), dtype="fp32").model
    head_ids = torch.arange(target.config.vocab_size)
    config = DraftDecoderConfig("edd", 1, -2, head_ids.numel(), fingerprint(target), target.config.to_dict())
    draft = DraftDecoder.initialise(config, target, head_ids)
    with torch.no_grad():  # a poor draft, so the target's loops are the lookup's to guess, not the star's
        torch.manual_seed(0)
        draft.hidden_proj.weight.normal_()
    draft.save(tmp_path / "edd", head_ids)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"q": "w1 w2 w3 w1 w2 w3 w1 w2 w3 w1 w2"}) + "\n" for _ in range(2)))
    argv = ["tree", "measure", "--target", str(checkpoint), "--dtype", "fp32", "--no-chat-template"]
    argv += ["--draft", str(tmp_path / "edd"), "--prompts", str(prompts), "--field", "q", "--offset", "0"]
    code, out, _ = run(capsys, *argv, "--limit", "2", "--width", "1", "--max-new-tokens", "60")
    assert code == 0
    result = json.loads(out)
    assert len(result["acceptance"]) == 1 and result["visits"] > 0
    assert sum(result["acceptance"]) <= 1.0 + 1e-9  # at most one rank is accepted per visit


def test_tree_measure_refuses_what_would_measure_nothing(capsys, checkpoint, tmp_path) -> None:
    """A plain draft model drafts a chain (its ranks 2.. read 0) and an --offset past the prompts measured zero
    prompts; both printed a result with exit 0."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"q": "w1 w2"}) + "\n")
    argv = ["tree", "measure", "--target", str(checkpoint), "--dtype", "fp32", "--prompts", str(prompts)]
    code, _, err = run(capsys, *argv, "--field", "q", "--draft", str(checkpoint), "--offset", "0")
    assert code != 0 and "drafts a chain" in err
    code, _, err = run(capsys, *argv, "--field", "q", "--draft", "edd", "--offset", "5")
    assert code != 0 and "no prompts from --offset 5" in err
    # shaping flags the tools override (a star of --width, chains) were taken and ignored
    code, _, err = run(capsys, *argv, "--field", "q", "--draft", "edd", "--tree", "sequoia", "--acceptance", "0.5")
    assert code != 0 and "--tree, --acceptance: tree measure drafts a shape of its own" in err
    profile = ["tree", "profile", "--target", str(checkpoint), "--draft", "edd", "--tree", "pct"]
    code, _, err = run(capsys, *profile)
    assert code != 0 and "--tree: tree profile drafts a shape of its own (chains)" in err


def test_verbose_is_taken_after_the_subcommand_too() -> None:
    from spectot.cli.main import build_parser

    parser = build_parser()
    assert [parser.parse_args(argv).verbose for argv in (["models"], ["-v", "models"], ["models", "-v"])] == [
        False,
        True,
        True,
    ]
    assert parser.parse_args(["tree", "sequoia", "--acceptance", "0.5", "-v"]).verbose


def test_a_kernel_build_is_announced_without_verbose() -> None:
    """A fresh install's first run builds the native kernels for about two minutes; the line saying so was shown
    only under -v, so the CLI looked hung. Library details stay quiet."""
    code = (
        "import logging; from spectot.cli.main import main; main(['models']);"
        "logging.getLogger('spectot.engine.kernels').info('building the noise kernel');"
        "logging.getLogger('spectot.engine.kernels').debug('loading the noise kernel');"
        "logging.getLogger('spectot.engine.runner').info('a library detail')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "building the noise kernel" in done.stderr
    assert "loading the noise kernel" not in done.stderr and "a library detail" not in done.stderr


def test_bench_trees_compares_the_trained_drafts_trees_by_default(capsys) -> None:
    """Run bare it was refused: the shared default draft, n-gram, grows no trees."""
    from spectot.cli.main import build_parser
    from spectot.config import DraftOptions, check_bench

    parser = build_parser()
    args = parser.parse_args(["bench", "trees"])
    assert args.draft == "edd"
    check_bench("trees", DraftOptions(draft=args.draft), None, None)
    assert parser.parse_args(["bench", "trees", "--draft", "vdm"]).draft == "vdm"
    assert parser.parse_args(["bench", "tot"]).draft == "ngram"  # the other commands keep theirs
    for tool in ("measure", "profile"):  # they need a draft with probabilities too (their --help said 'ngram')
        assert parser.parse_args(["tree", tool]).draft == "edd"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "trees", "--help"])
    assert "(default: 'edd')" in " ".join(capsys.readouterr().out.split())  # its help said 'ngram'


def test_a_tree_search_resume_of_another_setup_is_refused_before_the_model_loads(capsys, tmp_path) -> None:
    """The tree searches built the backend (loading the model) before run_tree_solve checked the records' setup."""
    out = tmp_path / "r.jsonl"
    out.write_text('{"id": "1"}\n')
    (tmp_path / "r.jsonl.run.json").write_text('{"SearchOptions": {}}')
    argv = ["solve", "--search", "rebase", "--target", str(tmp_path / "no-model"), "--json", str(out), "--resume"]
    code, _, err = run(capsys, *argv, "--limit", "1")
    assert code != 0 and "holds the records of another setup" in err  # not the missing model


def test_a_solve_whose_problem_failed_exits_1_and_names_it(capsys, checkpoint, tmp_path) -> None:
    """The run goes on past a problem the model cannot hold; its exit status and last line say so."""
    questions = ["w5 w6 w7?", " ".join(["w9"] * 2100) + "?"]
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n" for q in questions))
    flags = ["--target", str(checkpoint), "--dtype", "fp32", "--kernels", "torch", "--data", str(data)]
    records = ["--json", str(tmp_path / "out.jsonl")]
    code, out, err = run(capsys, "solve", *flags, "--engine", "ar", "--depth", "2", "--thoughts", "2", *records)
    assert code == 1 and "1 of 2 problems failed (2): see their records' error" in err
    assert "[2/2] 2: grade 0.00" in err + out and "failed: prompt" in err + out and "1 failed, graded 0" in out
    code, out, err = run(
        capsys, "solve", *flags, "--engine", "ar", "--depth", "2", "--thoughts", "2", *records, "--resume"
    )
    assert code == 1 and "1 of 2 problems failed (2)" in err  # resumed, the failure still counts
    assert "1 failed, graded 0" in out  # in the table's caption too
