"""Held-out evaluation during GRPO training: trl's ``eval_dataset`` / ``eval_steps``, with the run's reward sources.

``eval.every_n_steps`` (null: off) evaluates the policy before the first step, every N steps and after the last, on
the data's eval split (``data.num_eval_prompts`` of a built-in task, ``data.eval_path`` of a file, ``data.eval_split``
of an HF dataset), ``eval.num_prompts`` of them, ``eval.group_size`` responses each, sampled with ``eval.generation``
(``rollout.generation``'s settings unless set; ``do_sample=false`` for greedy answers). Every response is scored by
the same sources as training (``recipes.grpo.rewards``), in the learner's process with the learner's current weights
(also in async mode, where the collector's process holds its own copy), in chunks of ``rollout.responses_per_step``.
Under torchrun the prompts are dealt out between the processes and the figures pooled.

Figures: ``eval/reward_mean``, ``eval/rewards/<name>/mean`` per source, ``eval/oracle_mean`` where the data has an
oracle, ``eval/accuracy`` (the mean of the source :func:`accuracy_source` names, a verifier's 0/1 check),
``eval/response_length``, and ``eval/<name>`` for what the trl reward functions log (``log_metric``; their
``log_extra`` columns go with the samples). Sampling runs on a random stream of its own (seeded by ``seed`` and the
step), so that the same seed gives the same figures and the training run samples exactly as it would without
evaluation.

Dependencies: torch, tensordict, accelerate, transformers (the ``TrainerState`` reward functions read), and the
recipe's own modules.
"""

from __future__ import annotations

import math

import torch
from accelerate import PartialState
from accelerate.utils import gather_object

from recipes.common.config import ConfigError, RunStopped
from recipes.common.data import PromptRows
from recipes.common.reward_functions import RewardLogs
from recipes.grpo.batch import PROMPT_INDEX, REWARD, SOURCE_REWARDS, response_mask, response_texts
from recipes.grpo.collector import make_prompt_table, make_sampling_policy, sampler_settings
from recipes.grpo.prompt_env import PromptEnv
from recipes.grpo.rewards import make_reward_scorer, reward_sources, source_names
from recipes.grpo.rollout_envs import ROLLOUT_ENVS
from recipes.grpo.schema import GRPORecipeConfig

__all__ = ["Evaluator", "accuracy_source", "check_eval_settings", "eval_due", "has_eval_split"]


def has_eval_split(data) -> bool:
    """Whether the ``data=`` node (typed: its source's dataclass) names held-out prompts."""
    if data.source in ("file",):
        return data.eval_path is not None
    if data.source == "hf":
        return data.eval_split is not None
    return int(data.num_eval_prompts) > 0


def check_eval_settings(cfg: GRPORecipeConfig) -> None:
    """Refuses, before anything loads, an evaluation the data cannot feed, or settings the sampler does not take."""
    every = cfg.eval.every_n_steps
    if every is None:
        return
    if not has_eval_split(cfg.data):
        key = {"file": "data.eval_path", "hf": "data.eval_split"}.get(cfg.data.source, "data.num_eval_prompts")
        raise ConfigError(
            f"eval.every_n_steps={every}, but data={cfg.data.source} has no held-out prompts: set {key} (or "
            "eval.every_n_steps=null)."
        )
    if not ROLLOUT_ENVS[cfg.rollout.env].evaluates:
        raise ConfigError(
            "eval.every_n_steps samples with the recipe's own sampler (rollout.env=prompt); with rollout.env=chat "
            "set eval.every_n_steps=null."
        )
    sampler_settings(eval_generation(cfg), key="eval.generation")  # its keys and values, as the Evaluator builds it
    _check_accuracy_source(cfg)


def accuracy_source(cfg: GRPORecipeConfig) -> str | None:
    """The reward source whose mean over the eval answers is ``eval/accuracy``: ``eval.accuracy_source``, or, when
    that is null, the one source there is besides the reward model (``None`` with none, or with several, which
    :func:`check_eval_settings` refuses). Reads the config only."""
    if cfg.eval.accuracy_source is not None:
        return str(cfg.eval.accuracy_source)
    candidates = [source.name for source in reward_sources(cfg) if source.kind != "model"]
    return candidates[0] if len(candidates) == 1 else None


def _check_accuracy_source(cfg: GRPORecipeConfig) -> None:
    sources = reward_sources(cfg)
    candidates = [source.name for source in sources if source.kind != "model"]
    named = cfg.eval.accuracy_source
    if named is None:
        if len(candidates) > 1:
            choices = " or ".join(f"eval.accuracy_source={name}" for name in candidates)
            raise ConfigError(
                f"eval.accuracy_source=null, but {len(candidates)} reward sources could be the accuracy "
                f"({candidates}): eval/accuracy would be whichever of them happened to score only 0 and 1 (a format "
                f"check listed first would pass for the answers' accuracy). Name the one that checks the answer: "
                f"{choices}."
            )
        return
    if named not in [source.name for source in sources]:
        raise ConfigError(
            f"eval.accuracy_source={named!r} is not a reward source of this run (they are "
            f"{[source.name for source in sources]}). Name a reward.functions or reward.terms entry that scores 0 or "
            "1, or null."
        )
    if named not in candidates:
        raise ConfigError(
            f"eval.accuracy_source={named}: the reward model's scores are not a 0/1 check of the answer. Name a "
            f"reward.functions or reward.terms entry ({candidates or 'there is none: add one'}), or null."
        )


def eval_generation(cfg: GRPORecipeConfig) -> dict:
    """``eval.generation`` over ``rollout.generation`` (whose values its YAML defaults are)."""
    return {**cfg.rollout.generation, **cfg.eval.generation}


def eval_due(cfg: GRPORecipeConfig, step: int) -> bool:
    """Whether the policy is evaluated after ``step`` (0: before the first step)."""
    every = cfg.eval.every_n_steps
    return every is not None and (step % every == 0 or step == cfg.train.steps)


class Evaluator:
    """Evaluates the policy on the held-out prompts: one call, one dict of ``eval/*`` figures (the same on every
    process).

    Args:
        cfg: the run's config.
        prompts: the eval split's prompts and columns (``recipes.common.data.load_prompt_rows(data, "eval")``).
        policy: the policy being trained (its current weights sample).
        tokenizer: the policy's tokenizer.
        reward_model, reward_tokenizer: the reward model and its tokenizer (``None`` with ``reward_model=null``).
        oracle: the data's oracle, or ``None``.
    """

    def __init__(
        self, cfg: GRPORecipeConfig, prompts: PromptRows, *, policy, tokenizer, reward_model, reward_tokenizer, oracle
    ):
        processes = PartialState()
        count = len(prompts) if cfg.eval.num_prompts is None else min(int(cfg.eval.num_prompts), len(prompts))
        if count < processes.num_processes:
            raise ConfigError(
                f"eval: {count} held-out prompts cannot be shared by {processes.num_processes} processes; raise "
                "eval.num_prompts (or the data's eval split)."
            )
        # Every process gets as many prompts (what is left over is not evaluated): under FSDP2 the processes must run
        # the same forward passes.
        per_process = count // processes.num_processes
        start = processes.process_index * per_process
        self.cfg = cfg
        self.table = make_prompt_table(cfg, prompts, tokenizer)
        self.indices = list(range(start, start + per_process))
        # With tools, multi-turn dialogs as in training, their calls answered by a tool worker of the evaluation's own.
        self.policy = make_sampling_policy(
            cfg,
            policy,
            tokenizer,
            generation=eval_generation(cfg),
            key="eval.generation",
            num_threads=cfg.rollout.learner_sampling_threads,
        )
        self.tokenizer = tokenizer
        self.oracle = oracle
        self.group_size = int(cfg.eval.group_size)
        self.names = source_names(cfg)
        self.accuracy_source = accuracy_source(cfg)
        from transformers import TrainerState  # 0.7 s with the Trainer utilities (rewards.make_reward_transform)

        self.trainer_state = TrainerState(max_steps=cfg.train.steps)  # what trl reward functions read as the step
        self.logs = RewardLogs()  # what they log: eval/<name> and the samples' extra columns
        self.scorer = make_reward_scorer(
            cfg,
            reward_model,
            reward_tokenizer,
            tokenizer,
            prompts=self.table,
            trainer_state=self.trainer_state,
            logs=self.logs,
        )
        self.samples: list[dict] = []

    def __call__(self, step: int) -> dict[str, float]:
        """The figures of the policy as it is after ``step`` (0: before training); keeps a few samples."""
        chunk = max(1, self.cfg.rollout.responses_per_step // self.group_size)
        rows = []
        devices = [self.policy.model.device] if self.policy.model.device.type == "cuda" else []
        self.trainer_state.global_step = step
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(self.cfg.seed * 1_000_003 + step)
            for begin in range(0, len(self.indices), chunk):
                rows.extend(self._evaluate(self.indices[begin : begin + chunk]))
        rows = [row for share in gather_object([rows]) for row in share] if PartialState().use_distributed else rows
        self.samples = rows[:: max(1, len(rows) // 8)][:8]
        return self._figures(rows)

    def _evaluate(self, indices: list[int]) -> list[dict]:
        # The indices are consecutive rows of the table: an unshuffled PromptEnv started at the first deals them.
        env = PromptEnv(
            self.table,
            tokenizer=self.tokenizer,
            group_size=self.group_size,
            num_prompts=len(indices),
            start=indices[0],
            shuffle=False,
            device=self.cfg.device,
        )
        step = self.policy(env.reset())
        self.scorer(step)
        metrics, columns = self.logs.pop()
        mask = response_mask(step)
        texts = response_texts(step, self.tokenizer)
        # What the samples show: a dialog's tool messages marked [tool]...[/tool].
        shown = response_texts(step, self.tokenizer, mark_tools=True)
        rewards = step.get(REWARD).reshape(-1).tolist()
        sources = step.get(SOURCE_REWARDS).reshape(len(texts), -1).tolist()
        prompt_index = step.get(PROMPT_INDEX).tolist()
        rows = [
            {
                "prompt": self.table.prompts[index],
                "response": text,
                "shown": shown[row],
                "reward": reward,
                "sources": values,
                "length": int(row_mask.sum()),
                "columns": {name: logged[row] for name, logged in columns.items()},
            }
            for row, (index, text, reward, values, row_mask) in enumerate(
                zip(prompt_index, texts, rewards, sources, mask, strict=True)
            )
        ]
        rows[0]["metrics"] = metrics  # the chunk's log_metric values, once wherever the rows are pooled
        return rows

    def close(self) -> None:
        """Ends the tool worker of a tool-calling evaluation (a later call starts another)."""
        runner = getattr(self.policy, "runner", None)
        if runner is not None:
            runner.close()

    def _figures(self, rows: list[dict]) -> dict[str, float]:
        figures = {"eval/reward_mean": sum(row["reward"] for row in rows) / len(rows)}
        for column, name in enumerate(self.names):
            values = [row["sources"][column] for row in rows if not math.isnan(row["sources"][column])]
            figures[f"eval/rewards/{name}/mean"] = sum(values) / len(values) if values else math.nan
            if name == self.accuracy_source:
                figures.update(self._accuracy(values))
        if self.oracle is not None:
            figures["eval/oracle_mean"] = sum(float(self.oracle(row["response"])) for row in rows) / len(rows)
        figures["eval/response_length"] = sum(row["length"] for row in rows) / len(rows)
        figures.update(self._logged(rows, known=figures))
        return figures

    @staticmethod
    def _logged(rows: list[dict], *, known: dict) -> dict[str, float]:
        """``eval/<name>`` of every metric the reward functions logged (``log_metric``) while scoring the answers: the
        mean of the values logged (NaN left out), as trl reports ``eval_<name>``."""
        logged: dict[str, list[float]] = {}
        for row in rows:
            for name, values in row.get("metrics", {}).items():
                logged.setdefault(f"eval/{name}", []).extend(value for value in values if not math.isnan(value))
        taken = sorted(key for key in logged if key in known)
        if taken:
            raise RunStopped(
                f"A reward function logged {[key.removeprefix('eval/') for key in taken]} (log_metric), which the "
                f"recipe reports itself as {taken}: its value would replace the recipe's. Rename it in the function."
            )
        return {key: sum(values) / len(values) if values else math.nan for key, values in sorted(logged.items())}

    def _accuracy(self, values: list[float]) -> dict[str, float]:
        """``eval/accuracy``: the accuracy source's mean over the answers it scored, when its values are 0 or 1."""
        if all(value in (0.0, 1.0) for value in values):
            return {"eval/accuracy": sum(values) / len(values) if values else math.nan}
        other = next(value for value in values if value not in (0.0, 1.0))
        if self.cfg.eval.accuracy_source is None:  # the only candidate, which turns out to be no 0/1 check
            return {}
        raise RunStopped(
            f"eval.accuracy_source={self.accuracy_source} scored an eval answer {other:g}: eval/accuracy is the "
            "fraction of answers a 0/1 check passes, and this source is no such check. Name one that scores 0 or 1, "
            "or eval.accuracy_source=null (no eval/accuracy), then start again."
        )
