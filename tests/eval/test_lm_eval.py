"""The lm-eval model "kvarn" (kvarn.integrations.lm_eval) offline on a tiny local task and a tiny random llama: the
fp16 preset gives lm-eval's own HF model's log-likelihoods and generations; a 2-bit preset runs both request types.
Skipped where lm-eval is not installed (it is no dependency of kvarn)."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import tiny_model_folder

pytest.importorskip("lm_eval")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
{extra}
"""
GEN = """generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match"""
LL = """metric_list:
  - metric: acc"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval")
    folder = tiny_model_folder(root / "model", "llama", ["a", "b"], 10)[0]
    data = root / "data.jsonl"
    rows = [{"question": "line " * 150 + f"code {i} is", "answer": f" {i}"} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "gen.yaml").write_text(TASK.format(name="kvarn_tiny_gen", data=data, kind="generate_until", extra=GEN))
    (tasks / "ll.yaml").write_text(TASK.format(name="kvarn_tiny_ll", data=data, kind="loglikelihood", extra=LL))
    return folder, str(tasks)


def _evaluate(folder: str, tasks: str, model: str, args: str = "") -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvarn.integrations.lm_eval  # noqa: F401  (registers "kvarn")

    return lm_eval.simple_evaluate(model=model, model_args=f"pretrained={folder},dtype=float32{args}",
                                   tasks=["kvarn_tiny_gen", "kvarn_tiny_ll"], device="cpu", batch_size=2,
                                   task_manager=TaskManager(include_path=tasks), log_samples=True)


def _responses(out: dict, task: str) -> list:
    return [s["resps"] for s in out["samples"][task]]


@pytest.mark.slow  # ~40 s (two lm-eval runs of the tiny model); the CI's 25 minutes keep the exported-tasks test below
def test_fp16_preset_matches_lm_eval_hf(setup, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder, tasks = setup
    ref = _evaluate(folder, tasks, "hf")
    fp = _evaluate(folder, tasks, "kvarn", ",preset=fp16,chunk=64")
    assert _responses(fp, "kvarn_tiny_gen") == _responses(ref, "kvarn_tiny_gen")
    for a, b in zip(_responses(fp, "kvarn_tiny_ll"), _responses(ref, "kvarn_tiny_ll")):
        (lp_a, greedy_a), (lp_b, greedy_b) = a[0][0], b[0][0]  # one (log-likelihood, is_greedy) per request
        assert math.isclose(lp_a, lp_b, rel_tol=1e-4, abs_tol=1e-4) and greedy_a == greedy_b
    q = _evaluate(folder, tasks, "kvarn", ",preset=kvarn-auto-k2v2-g64,chunk=64")
    assert len(_responses(q, "kvarn_tiny_ll")) == 3 and len(_responses(q, "kvarn_tiny_gen")) == 3


def test_exported_kvarn_tasks_run_in_lm_eval(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvarn.integrations.lm_eval  # noqa: F401  (registers "kvarn")
    from kvarn.cli import main

    folder, _ = setup
    out = tmp_path / "exported"
    assert main(["eval", "tasks", "--model", folder, "--tasks", "lines,arith", "--lines", "12", "--steps", "2",
                 "--samples", "2", "--export-lm-eval", str(out)]) == 0
    monkeypatch.syspath_prepend(str(out))
    res = lm_eval.simple_evaluate(model="kvarn", model_args=f"pretrained={folder},dtype=float32,preset=fp16,chunk=64",
                                  tasks=["kvarn_lines_L12", "kvarn_arith_steps2"], device="cpu", batch_size=1,
                                  task_manager=TaskManager(include_path=str(out)))
    for name in ("kvarn_lines_L12", "kvarn_arith_steps2"):
        assert 0 <= res["results"][name]["correct,none"] <= 1
