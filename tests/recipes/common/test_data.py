"""Bad data files end in a ConfigError naming the file, the line or row, and the column: never a reader's traceback."""

from __future__ import annotations

import json

import pytest

from recipes.common.config import ConfigError
from recipes.common.data import load_preference_pairs, load_prompts, prompt_text


@pytest.fixture
def file_node(compose_config):
    """``file_node(path, eval_path=None)``: the ``data=file`` node of the reward recipe pointing at ``path``."""

    def make(path, eval_path=None):
        overrides = ["data=file", f"data.path={path}", f"data.eval_path={eval_path or 'null'}"]
        return compose_config("reward_trainer_from_buffer", overrides).data

    return make


def _write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


class TestFiles:
    @pytest.mark.parametrize("content", ["", "\n  \n\n"])
    @pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
    def test_an_empty_file_says_what_it_should_hold(self, file_node, tmp_path, suffix, content):
        path = tmp_path / f"prompts{suffix}"
        path.write_text(content)
        with pytest.raises(ConfigError, match=f"data.path='{path}': the file is empty. It should hold") as error:
            load_prompts(file_node(path), "train")
        assert "prompt" in str(error.value)

    def test_an_empty_eval_file_names_eval_path(self, file_node, tmp_path):
        train = _write_lines(tmp_path / "train.jsonl", [json.dumps({"chosen": "a", "rejected": "b"})])
        (tmp_path / "eval.jsonl").write_text("")
        node = file_node(train, eval_path=tmp_path / "eval.jsonl")
        assert len(load_preference_pairs(node, "train")) == 1
        pattern = r"data.eval_path='.*eval.jsonl': the file is empty.*\{\"prompt\": \"...\", \"chosen\": \"...\""
        with pytest.raises(ConfigError, match=pattern):
            load_preference_pairs(node, "eval")

    def test_a_csv_with_a_header_and_no_rows_is_refused(self, file_node, tmp_path):
        path = _write_lines(tmp_path / "prompts.csv", ["prompt"])
        with pytest.raises(ConfigError, match="the file has no rows"):
            load_prompts(file_node(path), "train")

    def test_a_malformed_jsonl_line_is_named_with_its_start(self, file_node, tmp_path):
        lines = [json.dumps({"prompt": "Review the mug."}), "", '{"prompt": "Review the lamp.",}']
        path = _write_lines(tmp_path / "prompts.jsonl", lines)
        with pytest.raises(ConfigError) as error:
            load_prompts(file_node(path), "train")
        message = str(error.value)
        assert f"data.path='{path}', line 3: not valid JSON" in message
        assert '\'{"prompt": "Review the lamp.",}\'' in message and "Fix or remove that line" in message

    def test_a_jsonl_line_that_is_no_object_is_named(self, file_node, tmp_path):
        path = _write_lines(tmp_path / "prompts.jsonl", [json.dumps({"prompt": "a"}), '["a", "b"]'])
        with pytest.raises(ConfigError, match="line 2: a JSON list, not an object of columns"):
            load_prompts(file_node(path), "train")

    def test_json_documents_and_json_lines_both_load_and_name_their_bad_line(self, file_node, tmp_path):
        document = tmp_path / "prompts.json"
        document.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
        assert load_prompts(file_node(document), "train") == ["a", "b"]
        # A syntax error in a document spread over lines: the document's line, not its first line.
        document.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b"\n]\n')
        with pytest.raises(ConfigError, match=r"prompts.json', line 4: .*: '\]'"):
            load_prompts(file_node(document), "train")
        json_lines = _write_lines(tmp_path / "lines.json", ['{"prompt": "a"}', '{"prompt": "b"', '{"prompt": "c"}'])
        with pytest.raises(ConfigError, match=r"lines.json', line 2: not valid JSON"):
            load_prompts(file_node(json_lines), "train")

    def test_an_unreadable_parquet_file_is_named(self, file_node, tmp_path):
        path = tmp_path / "pairs.parquet"
        path.write_bytes(b"not a parquet file at all")
        with pytest.raises(ConfigError, match=f"data.path='{path}': the file cannot be read as .parquet"):
            load_preference_pairs(file_node(path), "train")


class TestRows:
    @pytest.mark.parametrize(
        ("prompt", "found"),
        [
            (7, "got int 7"),
            ({"role": "user"}, "got dict"),
            ([{"role": "user"}], "message 0 of the list is {'role': 'user'}"),
            ([{"role": "user", "content": 3}], "message 0 has role 'user' and content 3; both must be text"),
        ],
    )
    def test_a_bad_prompt_names_its_row_and_column(self, file_node, tmp_path, prompt, found):
        path = _write_lines(tmp_path / "prompts.jsonl", [json.dumps({"prompt": "a"}), json.dumps({"prompt": prompt})])
        with pytest.raises(ConfigError) as error:
            load_prompts(file_node(path), "train")
        message = str(error.value)
        assert "row 1 (counting data rows from 0), column data.prompt_column='prompt'" in message
        assert found in message and str(path) in message

    def test_prompt_text_accepts_text_and_messages(self):
        messages = [{"role": "user", "content": "Review the mug.", "name": "ignored"}]
        assert prompt_text("Review the mug.") == "Review the mug."
        assert prompt_text(messages) == [{"role": "user", "content": "Review the mug."}]

    def test_null_responses_name_the_column_and_rows(self, file_node, tmp_path):
        rows = [{"chosen": "a", "rejected": "b"}, {"chosen": "a", "rejected": None}, {"chosen": "a"}]
        path = _write_lines(tmp_path / "pairs.jsonl", [json.dumps(row) for row in rows])
        pattern = r"2 null value\(s\) in column data.rejected_column='rejected' \(rows \[1, 2\].*Fill them or remove"
        with pytest.raises(ConfigError, match=pattern):
            load_preference_pairs(file_node(path), "train")
        path = _write_lines(tmp_path / "pairs.jsonl", [json.dumps({"chosen": None, "rejected": "b"})] * 12)
        with pytest.raises(ConfigError, match=r"column data.chosen_column='chosen' \(rows \[0, 1, .*, 9\]\.\.\."):
            load_preference_pairs(file_node(path), "train")


def test_a_file_that_is_not_utf8_names_the_line_and_the_fix(file_node, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "Review the mug."}\n{"prompt": "Caf\xe9 review."}\n')
    with pytest.raises(ConfigError, match=r"prompts.jsonl', line 2: not UTF-8 \(byte 0xe9 at offset .*iconv -f latin1"):
        load_prompts(file_node(path), "train")


@pytest.mark.parametrize("prompt", ["\u200b\u200b", " \u200c\t\u2060 ", ""])
def test_prompts_of_invisible_characters_only_are_refused_as_empty(file_node, tmp_path, prompt):
    path = _write_lines(
        tmp_path / "prompts.jsonl", [json.dumps({"prompt": "Review the mug."}), json.dumps({"prompt": prompt})]
    )
    with pytest.raises(ConfigError, match=r"1 empty prompt\(s\) in column 'prompt' \(rows \[1\]\)"):
        load_prompts(file_node(path), "train")


def test_data_hf_names_a_plain_folder_and_an_unreachable_hub_name(compose_config, tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "Review the mug."}) + "\n")
    plain = compose_config("grpo_torchrl_rm", ["data=hf", f"data.name_or_path={tmp_path}"]).data
    with pytest.raises(ConfigError, match=r"is a folder, but not one `save_to_disk` wrote .* use data=file"):
        load_prompts(plain, "train")
    offline = compose_config("grpo_torchrl_rm", ["data=hf", "data.name_or_path=someone/no-such-dataset"]).data
    with pytest.raises(ConfigError, match=r"no such folder, and the hub dataset of that name cannot be loaded"):
        load_prompts(offline, "train")


def test_data_calculator_draws_train_and_held_out_prompts_with_their_solutions(compose_config):
    from recipes.common.data import load_prompt_rows
    from recipes.tasks import calculator

    data = compose_config("grpo_torchrl_rm", ["data=calculator", "model=tiny_calculator"]).data
    train, held_out = load_prompt_rows(data, "train"), load_prompt_rows(data, "eval")
    # The eval prompts are drawn with seed + 1 from the held-out problems, as the other built-in tasks draw theirs.
    assert (train.prompts, train.columns) == calculator.make_task(data.num_train_prompts, seed=data.seed)
    assert (held_out.prompts, held_out.columns) == calculator.make_eval_task(data.num_eval_prompts, seed=data.seed + 1)
    assert len(train) == data.num_train_prompts and len(held_out) == data.num_eval_prompts
    assert set(train.prompts).isdisjoint(held_out.prompts)
