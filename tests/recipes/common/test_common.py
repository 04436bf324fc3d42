"""The recipes' shared building blocks: synthetic task, data sources, model loading, checkpoints, logging."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _tiny_models import load_build_script, run_build_script
from omegaconf import OmegaConf

from recipes.common.checkpoint import write_folder_atomically
from recipes.common.config import ConfigError
from recipes.common.data import load_preference_pairs, load_prompts
from recipes.common.metrics import MetricLogger
from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer, validate_model_node
from recipes.tasks.synthetic import (
    OracleLabeler,
    make_prompts,
    make_sft_conversations,
    oracle_score,
    well_formed_score,
)


def _node(**values):
    return OmegaConf.create(values)


def _file_node(path, eval_path=None):
    return _node(
        source="file",
        path=str(path),
        eval_path=eval_path,
        prompt_column="prompt",
        chosen_column="chosen",
        rejected_column="rejected",
    )


class TestSyntheticTask:
    def test_oracle_counts_sentiment_among_adjectives(self):
        assert oracle_score("it is great and the box is awful and the color is red.") == 0.0
        assert oracle_score("it is great and it looks nice.") == 1.0
        assert oracle_score("it is broken.") == -1.0
        assert oracle_score("it is great and it looks red.") == 0.5
        assert oracle_score("") == 0.0

    def test_well_formed_score_gives_no_credit_for_repeats_salad_or_broken_text(self):
        assert well_formed_score("the phone is great and it looks nice.") == 1.0
        assert well_formed_score("it is great and it looks red.") == 0.5  # a neutral clause counts 0, as oracle_score
        # What the default run learns to write (oracle_score 1.0 for each):
        assert well_formed_score("it seems very nice and it seems very nice and it seems very nice.") == 1 / 3
        assert well_formed_score("good good perfect good superb good.") == 0.0
        assert well_formed_score("the design design\ufffd feels solid and it is great.") == 0.5
        assert well_formed_score("it is great and it looks nice and it is good") == 2 / 3  # cut off before its period
        # The task's own reviews score as oracle_score scores them, unless they happen to repeat a clause.
        reviews = [c[1]["content"] for c in make_sft_conversations(400, seed=0)]
        differ = [r for r in reviews if well_formed_score(r) != oracle_score(r)]
        assert len(differ) <= 4 and all(len(set(r[:-1].split(" and "))) < len(r.split(" and ")) for r in differ)

    def test_prompts_are_deterministic_and_seed_dependent(self):
        assert make_prompts(20, seed=3) == make_prompts(20, seed=3)
        assert make_prompts(20, seed=3) != make_prompts(20, seed=4)

    def test_corpus_has_mixed_sentiment(self):
        reviews = [c[1]["content"] for c in make_sft_conversations(400, seed=0)]
        scores = torch.tensor([oracle_score(r) for r in reviews])
        assert abs(scores.mean().item()) < 0.15
        assert (scores > 0.5).any() and (scores < -0.5).any()

    def test_labeler_ranks_by_oracle_and_drops_ties(self):
        labeler = OracleLabeler(max_pairs_per_prompt=2)
        pairs = labeler("Review the mug.", ["it is bad.", "it is good.", "it is red.", "it is great and red."])
        assert pairs[0] == {"chosen": "it is good.", "rejected": "it is bad.", "margin": 2.0}
        assert pairs[1] == {"chosen": "it is great and red.", "rejected": "it is red.", "margin": 0.5}
        assert labeler("Review the mug.", ["it is good.", "it is nice.", "it is red and great."])[0]["margin"] == 0.5
        # Ties are dropped, never labelled at random.
        assert labeler("Review the mug.", ["it is red.", "it is new."]) == []
        assert labeler("Review the mug.", ["it is good.", "it is nice."]) == []

    def test_labeler_pairs_the_best_positive_review_against_broken_copies_of_itself(self):
        """With the well-formed oracle, each broken copy (a repeated clause, a stray word...) scores lower than the
        review it came from and is its rejected side; a best review that is not positive gets none."""
        labeler = OracleLabeler(max_pairs_per_prompt=1, score=well_formed_score, corrupted_pairs_per_prompt=3, seed=0)
        best = "it is great and the box looks nice."
        pairs = labeler("Review the mug.", [best, "it is bad."])
        assert pairs[0]["chosen"] == best and pairs[0]["rejected"] == "it is bad."
        corrupted = pairs[1:]
        assert 1 <= len(corrupted) <= 3
        for pair in corrupted:
            assert pair["chosen"] == best and pair["rejected"] != best
            assert pair["margin"] == well_formed_score(best) - well_formed_score(pair["rejected"]) > 0
        assert OracleLabeler(score=well_formed_score, corrupted_pairs_per_prompt=3)(
            "Q", ["it is bad.", "it is red."]
        ) == [{"chosen": "it is red.", "rejected": "it is bad.", "margin": 1.0}]


class TestDataSources:
    def test_prompts_from_jsonl(self, tmp_path):
        path = tmp_path / "prompts.jsonl"
        rows = [{"prompt": "Review the mug."}, {"prompt": [{"role": "user", "content": "Review the lamp."}]}]
        path.write_text("\n".join(json.dumps(r) for r in rows[:1]) + "\n")
        assert load_prompts(_file_node(path), "train") == ["Review the mug."]
        assert load_prompts(_file_node(path), "eval") == []

    def test_conversational_pairs_from_parquet(self, tmp_path):
        import datasets

        conversation = lambda text: [{"role": "user", "content": "Review it."}, {"role": "assistant", "content": text}]
        table = datasets.Dataset.from_list(
            [{"chosen": conversation("it is good."), "rejected": conversation("it is bad.")}]
        )
        table.to_parquet(tmp_path / "pairs.parquet")
        pairs = load_preference_pairs(_file_node(tmp_path / "pairs.parquet"), "train")
        assert pairs == [{"chosen": conversation("it is good."), "rejected": conversation("it is bad.")}]

    def test_missing_columns_are_listed(self, tmp_path):
        path = tmp_path / "pairs.jsonl"
        path.write_text(json.dumps({"prompt": "p", "good": "a", "bad": "b"}) + "\n")
        with pytest.raises(ConfigError, match=r"lacks column\(s\) \['chosen', 'rejected'\].*Found columns"):
            load_preference_pairs(_file_node(path), "train")

    def test_missing_file_is_named(self, tmp_path):
        with pytest.raises(ConfigError, match="no such file"):
            load_prompts(_file_node(tmp_path / "absent.jsonl"), "train")

    def test_hf_dataset_from_disk(self, tmp_path):
        import datasets

        datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"prompt": ["a", "b"]}),
                "test": datasets.Dataset.from_dict({"prompt": ["c"]}),
            }
        ).save_to_disk(tmp_path / "ds")
        node = _node(
            source="hf", name_or_path=str(tmp_path / "ds"), split="train", eval_split="test", prompt_column="prompt"
        )
        assert load_prompts(node, "train") == ["a", "b"]
        assert load_prompts(node, "eval") == ["c"]
        node.eval_split = "validation"
        with pytest.raises(ConfigError, match="has splits \\['test', 'train'\\]"):
            load_prompts(node, "eval")


class TestModels:
    def test_tiny_kit_loads_like_a_hub_checkpoint(self, tiny_dir):
        node = _node(name_or_path=str(tiny_dir / "policy"), tokenizer_name_or_path=None, trust_remote_code=False)
        tokenizer = load_tokenizer(node, padding_side="left")
        assert tokenizer.pad_token_id != tokenizer.eos_token_id
        policy = load_causal_lm(node, device="cpu", dtype="float32")
        assert policy.config.vocab_size == len(tokenizer)
        reward_node = _node(
            name_or_path=str(tiny_dir / "reward_base"), tokenizer_name_or_path=None, trust_remote_code=False
        )
        reward_model = load_reward_model(reward_node, device="cpu", dtype="bfloat16")
        assert reward_model.config.pad_token_id == tokenizer.pad_token_id
        assert reward_model.dtype == torch.bfloat16

    def test_missing_local_checkpoint_fails_before_loading(self, tmp_path, monkeypatch):
        node = _node(name_or_path=str(tmp_path / "absent"), tokenizer_name_or_path=None, trust_remote_code=False)
        with pytest.raises(ConfigError, match="model.name_or_path=.*no such model folder.*build_tiny_models"):
            validate_model_node(node, key="model")
        # A relative path with folders is no hub id: it fails at once instead of being tried on the hub.
        relative = _node(name_or_path="outputs/run/model", tokenizer_name_or_path=None, trust_remote_code=False)
        with pytest.raises(ConfigError, match="'outputs/run/model': no such model folder"):
            validate_model_node(relative, key="model")
        # A hub id passes through to from_pretrained, but offline it must be in the cache.
        hub_id = _node(name_or_path="Qwen/Qwen2.5-0.5B", tokenizer_name_or_path=None, trust_remote_code=False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ConfigError, match="not in the Hugging Face cache while offline"):
            validate_model_node(hub_id, key="model")
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
        import recipes.common.config as config

        monkeypatch.setattr(config, "hub_reachable", lambda: True)  # online (nothing is sent from the tests)
        validate_model_node(hub_id, key="model")

    def test_a_causal_lm_is_no_reward_model_and_a_reward_model_no_policy(self, tiny_dir):
        """Loaded as a reward model, a causal LM would get a random score head: refused before anything loads, and at
        load time (hub ids); the same for a sequence classifier given as the policy."""
        policy = _node(name_or_path=str(tiny_dir / "policy"), tokenizer_name_or_path=None, trust_remote_code=False)
        scorer = _node(
            name_or_path=str(tiny_dir / "reward_model"), tokenizer_name_or_path=None, trust_remote_code=False
        )
        not_a_reward_model = "is a Qwen2ForCausalLM checkpoint, not a reward model: a reward model here is a sequence"
        with pytest.raises(ConfigError, match=not_a_reward_model):
            validate_model_node(policy, key="reward_model", kind="reward_model")
        with pytest.raises(ConfigError, match=not_a_reward_model + ".*reward_trainer_from_buffer.py"):
            load_reward_model(policy, device="cpu", dtype="float32")
        with pytest.raises(ConfigError, match="is a Qwen2ForSequenceClassification checkpoint .* not a causal LM"):
            validate_model_node(scorer, key="model", kind="policy")
        with pytest.raises(ConfigError, match="not a causal LM"):
            load_causal_lm(scorer, device="cpu", dtype="float32")
        # To be trained into a reward model, a causal LM is a fine start (its new score head is what training fits).
        validate_model_node(policy, key="reward_model")
        assert load_reward_model(policy, device="cpu", dtype="float32", trained=False).config.num_labels == 1

    def test_a_reward_model_without_its_score_weights_or_with_several_labels_is_refused(self, tiny_dir, tmp_path):
        import json
        import shutil

        headless = tmp_path / "headless"
        shutil.copytree(tiny_dir / "policy", headless)  # causal LM weights under a classifier's config
        config = json.loads((headless / "config.json").read_text())
        config["architectures"] = ["Qwen2ForSequenceClassification"]
        (headless / "config.json").write_text(json.dumps({**config, "id2label": {"0": "LABEL_0"}}))
        node = _node(name_or_path=str(headless), tokenizer_name_or_path=None, trust_remote_code=False)
        with pytest.raises(ConfigError, match=r"has no weights for \['score.weight'\] \(they would start at random"):
            load_reward_model(node, device="cpu", dtype="float32")

        two_labels = tmp_path / "two_labels"
        shutil.copytree(tiny_dir / "reward_model", two_labels)
        config = json.loads((two_labels / "config.json").read_text())
        config["id2label"] = {"0": "bad", "1": "good"}
        (two_labels / "config.json").write_text(json.dumps(config))
        node = _node(name_or_path=str(two_labels), tokenizer_name_or_path=None, trust_remote_code=False)
        with pytest.raises(ConfigError, match="classifies into 2 labels; a reward model here"):
            validate_model_node(node, key="reward_model", kind="reward_model")

    def test_pad_equal_to_eos_is_refused(self, tiny_dir, tmp_path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "policy")
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(tmp_path)
        node = _node(name_or_path=str(tmp_path), tokenizer_name_or_path=None, trust_remote_code=False)
        with pytest.raises(ConfigError, match="no pad token distinct from EOS"):
            load_tokenizer(node, padding_side="left")


class TestCheckpoint:
    def test_failed_write_keeps_the_previous_folder(self, tmp_path):
        destination = tmp_path / "latest"
        write_folder_atomically(lambda folder: (folder / "state.txt").write_text("step 1"), destination)

        def crash(folder):
            (folder / "state.txt").write_text("half")
            raise RuntimeError("disk full")

        with pytest.raises(RuntimeError, match="disk full"):
            write_folder_atomically(crash, destination)
        assert (destination / "state.txt").read_text() == "step 1"
        assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no staging folder left behind
        write_folder_atomically(lambda folder: (folder / "state.txt").write_text("step 2"), destination)
        assert (destination / "state.txt").read_text() == "step 2"


def test_an_interrupted_atomic_write_is_tidied_on_the_next_start(tmp_path):
    """A kill inside write_folder_atomically leaves a staging folder (deleted) or, between its two renames, the old
    folder under .<name>.previous with no <name> (put back)."""
    from recipes.common.checkpoint import recover_interrupted_writes

    (tmp_path / ".step_0000003.staging.x1y2").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / ".model.previous").mkdir()  # the new model arrived: the old one is only left over
    (tmp_path / ".buffer.previous" / "storage").mkdir(parents=True)  # the new buffer never arrived
    done = recover_interrupted_writes(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer", "model"]
    assert (tmp_path / "buffer" / "storage").is_dir() and len(done) == 3
    assert recover_interrupted_writes(tmp_path / "absent") == []


def test_clear_records_deletes_an_earlier_run_but_what_this_run_reads(tmp_path):
    from recipes.common.run_folder import clear_records, earlier_records

    for name in ("metrics.csv", "summary.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "model").mkdir()
    (tmp_path / "buffer" / "storage").mkdir(parents=True)
    (tmp_path / ".hydra").mkdir()  # Hydra's own, rewritten at every start: not a record
    assert earlier_records(tmp_path) == ["metrics.csv", "summary.json", "model", "buffer"]
    assert clear_records(tmp_path, keep=[tmp_path / "buffer"]) == ["metrics.csv", "summary.json", "model"]
    assert earlier_records(tmp_path) == ["buffer"] and (tmp_path / ".hydra").is_dir()


def test_csv_logger_appends_rows(tmp_path):
    with MetricLogger("csv", tmp_path) as logger:
        logger.log({"train/loss": 1.5}, step=1)
        logger.log({"train/loss": 0.5}, step=2)
        logger.log({"train/loss": 0.25, "eval/accuracy": 0.75}, step=3)  # a metric first seen later
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines == ["step,train/loss,eval/accuracy", "1,1.5,", "2,0.5,", "3,0.25,0.75"]
    # A resumed run appends under the existing header.
    MetricLogger("csv", tmp_path).log({"train/loss": 0.125}, step=4)
    assert (tmp_path / "metrics.csv").read_text().splitlines()[-1] == "4,0.125,"


def test_a_new_column_rewrites_the_csv_beside_it_and_moves_it_over(tmp_path):
    """A metric first seen mid-run rewrites metrics.csv under the union of the columns: into a file beside it, then
    moved over it. Truncated and rewritten in place, a reader with the file open (a test polling a killed run's
    progress, plot_run.py) read the header again as a row ('step' as a value, CI 2026-12-06), and a run killed
    mid-write lost its rows."""
    path = tmp_path / "metrics.csv"
    with MetricLogger("csv", tmp_path) as logger:
        logger.log({"train/loss": 1.5}, step=1)
        logger.log({"train/loss": 0.5}, step=2)
        with open(path, newline="") as reader:
            logger.log({"train/loss": 0.25, "eval/accuracy": 0.75}, step=3)
            assert reader.read().splitlines() == ["step,train/loss", "1,1.5", "2,0.5"]  # the file as it was
    assert path.read_text().splitlines() == ["step,train/loss,eval/accuracy", "1,1.5,", "2,0.5,", "3,0.25,0.75"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]  # nothing left beside it


def test_build_script_writes_loadable_checkpoints(tmp_path, repo_root):
    run_build_script(repo_root, f"--out={tmp_path}", "--num-conversations=200", "--pretrain-steps=5")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    assert tokenizer.chat_template is not None and tokenizer.pad_token != tokenizer.eos_token
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "policy").config.vocab_size == len(tokenizer)
    reward_base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward_base")
    assert reward_base.config.num_labels == 1 and reward_base.config.pad_token_id == tokenizer.pad_token_id


def test_build_script_writes_the_arithmetic_policy(tmp_path, repo_root):
    arguments = [f"--out={tmp_path}", "--task=arithmetic", "--num-conversations=200", "--vocab-size=300"]
    run_build_script(repo_root, *arguments, "--pretrain-steps=5")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sorted(path.name for path in tmp_path.iterdir()) == ["arithmetic_policy"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "arithmetic_policy")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "arithmetic_policy")
    assert policy.config.vocab_size == len(tokenizer) and policy.generation_config.max_new_tokens == 16


def test_the_build_script_refuses_a_resize_below_the_tokenizer_before_pretraining(
    tmp_path, repo_root, monkeypatch, capsys
):
    """A --resize-vocab too small for the trained tokenizer, or given to a task it does nothing for, stops the build
    before the pretraining (its long part) and writes nothing."""
    build = load_build_script(repo_root)
    monkeypatch.setattr(build, "pretrain", lambda *a, **k: pytest.fail("pretrained before refusing"))
    arguments = [f"--out={tmp_path}", "--num-conversations=200", "--vocab-size=300"]
    with pytest.raises(SystemExit, match=r"--resize-vocab 50 is smaller than the trained tokenizer's \d+ tokens"):
        build.main([*arguments, "--resize-vocab=50"])
    with pytest.raises(SystemExit):
        build.main([*arguments, "--task=arithmetic", "--resize-vocab=4096"])
    assert "--task arithmetic has none" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_build_script_pretrains_on_the_tokens_the_loaded_tokenizer_makes(repo_root):
    """The BPE the script trains merges " 1" into one token; the tokenizer from_pretrained loads beside a Qwen2 policy
    splits every digit. The corpus is tokenized by the latter (as_loaded), or "17" in a prompt would be tokens the
    policy never saw."""
    build = load_build_script(repo_root)
    from recipes.tasks.arithmetic import make_sft_conversations

    corpus = [f"{m['role']}\n{m['content']}" for c in make_sft_conversations(200, seed=0) for m in c]
    trained = build.build_tokenizer(corpus, vocab_size=300)
    loaded = build.as_loaded(trained, build.build_policy(trained, hidden_size=16, num_layers=1))
    assert "Ġ1" in trained.tokenize("What is 13 + 4?")
    assert loaded.tokenize("What is 13 + 4?") == ["What", "Ġis", "Ġ", "1", "3", "Ġ+", "Ġ", "4", "?"]


def test_command_line_keys_read_an_override_whose_value_is_an_interpolation(compose_config):
    """``labeler.score=${data.oracle}`` on the command line: read unresolved, not as the node it points to (which
    Hydra's override parser cannot read back)."""
    from recipes.common.config import command_line_keys

    compose_config("reward_trainer_from_buffer", ["labeler.score=${data.oracle}", "seed=3"])
    assert command_line_keys() == {"labeler.score": "change", "seed": "change"}


def test_the_build_script_never_replaces_a_checkpoint_without_overwrite(tmp_path, repo_root):
    """Run as the README's first build command would be on a clone (a process of its own, as a user types it; the
    tests above call its main()), it must not silently replace the committed kit."""
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "model.safetensors").write_bytes(b"committed")
    command = [sys.executable, str(repo_root / "scripts" / "build_tiny_models.py"), f"--out={tmp_path}"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--overwrite" in refused.stderr and str(tmp_path / "policy") in refused.stderr
    assert (tmp_path / "policy" / "model.safetensors").read_bytes() == b"committed"
    assert not (tmp_path / "reward_base").exists(), "refused before any work"
