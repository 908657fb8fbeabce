"""EleutherAI's lm-evaluation-harness against `kvstack serve`: the harness itself, with its
`local-completions` model and vLLM's tokenizer endpoints, on a multiple-choice task
(log-likelihoods through `echo` + `logprobs`) and a generation task, over JSONL files in
tests/data. Its log-likelihoods must be the library's own."""

from pathlib import Path

import pytest
from test_serve import MODEL, local, server  # noqa: F401  (fixtures)

DATA = Path(__file__).parent / "data" / "lmeval"
CHOICE_TASK = """task: kvstack_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: kvstack_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/generate.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  temperature: 0
metric_list:
  - metric: exact_match
"""


def test_lm_eval_scores_and_generates_against_the_server(server, local, tmp_path,  # noqa: F811
                                                         monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # local JSONL only: nothing downloaded
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    for name, text in (("choice", CHOICE_TASK), ("generate", GENERATE_TASK)):
        (tmp_path / f"{name}.yaml").write_text(text.format(data=DATA))
    results = simple_evaluate(
        model="local-completions",
        model_args=(f"base_url={server.url}/v1/completions,model={MODEL},"
                    "tokenizer_backend=remote,num_concurrent=1,max_retries=1,"
                    "tokenized_requests=True"),
        tasks=["kvstack_choice", "kvstack_generate"],
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    assert set(results["results"]) == {"kvstack_choice", "kvstack_generate"}
    assert "acc,none" in results["results"]["kvstack_choice"]
    # Every (context, continuation) pair's log-likelihood is what the library computes.
    compared = 0
    for sample in results["samples"]["kvstack_choice"]:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"],
                                                     strict=True):
            # As the harness splits a pair: trailing spaces of the context move to the
            # continuation, and the continuation's tokens are the whole's after the
            # context's.
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = local.encode(context + continuation)
            context_ids = local.encode(context)
            scores = local.prompt_logprobs(whole)
            expected = sum(s.logprob for s in scores[len(context_ids):])
            assert response[0][0] == pytest.approx(expected, abs=1e-4)
            compared += 1
    assert compared == 4 * 3
    generated = [s["resps"][0][0] for s in results["samples"]["kvstack_generate"]]
    assert len(generated) == 3 and all(isinstance(g, str) for g in generated)
