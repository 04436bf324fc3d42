"""Every check of a ``conf/trl_grpo_torchrl_rollouts.yaml`` config that runs before any model loads: the schema
(``recipes.trl_grpo.schema``; ``train:``'s keys against ``trl.GRPOConfig``'s fields) and every rule that crosses keys,
a resumed run's settings against the run it continues (``recipes.trl_grpo.resume``), the prompts against the policy's
positions (tokenizer and model config only); each message names the setting, what was found and what to change.

The run reads the typed settings these checks build (``TrlGRPORecipeConfig``: :func:`validate`); the resolved
``DictConfig`` stays beside them as the run's record only (:func:`validated`): what ``resolved_config.yaml`` and the
logger get (secrets masked), what a resume compares with the run it continues, the paths a run reads.

Dependencies: omegaconf, transformers, trl (for ``train:``'s keys), and the recipes' own modules.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig

from interop.errors import SettingError
from recipes.common.checkpoint import latest_trl_checkpoint
from recipes.common.config import ConfigError, check_run_settings, setting_message
from recipes.common.data import load_prompt_rows
from recipes.common.lora import validate_policy_lora
from recipes.common.models import load_tokenizer, validate_model_node
from recipes.common.prompts import PromptTable, check_prompts_fit_policy
from recipes.common.resume import check_resume_changes, read_metrics_rows
from recipes.common.reward_functions import check_reward_functions, check_reward_weights
from recipes.common.rollout_backend import check_rollout_backend
from recipes.common.run import SUMMARY_FILE, check_sharded_launch
from recipes.common.run_folder import check_output_folder, check_trainer_output_dir
from recipes.common.sampling import sampler_settings
from recipes.common.schema import checked_trainer_config, config_view
from recipes.common.tools import resolve_call_format, resolve_tools
from recipes.common.validation import ValidatedRun, validated_run
from recipes.trl_grpo.report import reward_source_names, summary_keys
from recipes.trl_grpo.resume import checkpoint_step, resume_changes, resumed_config
from recipes.trl_grpo.rollout_store import ROLLOUTS_DIR, row_bytes, stored_sources
from recipes.trl_grpo.schema import GRPO_CONFIG_FIELDS, RENAMED, GRPOTrainerNode, TrlGRPORecipeConfig

__all__ = ["grpo_config_fields", "load_replay_source", "validate", "validated"]


def validate(cfg: DictConfig) -> TrlGRPORecipeConfig:
    """Every check that runs before any model loads; returns the typed settings the run trains with: resolved once, a
    resumed run's own settings under its command line (``recipes.trl_grpo.resume.resumed_config``), LoRA on or off as
    the command line says (``recipes.common.lora.settle_lora_node``)."""
    return validated(cfg).settings


def validated(cfg: DictConfig) -> ValidatedRun[TrlGRPORecipeConfig]:
    """:func:`validate`'s checks; returns the typed settings and the resolved config beside them (the run's record:
    what a resume changes is ``recipes.trl_grpo.resume.record_resume_start``)."""
    return validated_run(
        cfg,
        TrlGRPORecipeConfig,
        recipe="trl_grpo_torchrl_rollouts",
        check=_validate_settings,
        renamed=RENAMED,
        resumed_config=resumed_config,
        resume_changes=resume_changes,
    )


def _validate_settings(cfg: TrlGRPORecipeConfig, *, inputs: dict[str, str | None], changes: Callable[[], dict]) -> None:
    from trl import GRPOConfig  # trl prints a notice on import: only where this recipe runs

    # recipes.common.models merges a model node with OmegaConf (an adapter's base): it reads a DictConfig view.
    model = config_view(cfg.model)
    reward_model = config_view(cfg.reward_model) if cfg.reward_model is not None else None
    _check_trl_tool_keys(cfg)
    args = checked_trainer_config({**cfg.train, **grpo_config_fields(cfg)}, GRPOConfig, node=GRPOTrainerNode)
    _check_sampling(cfg)
    _check_trainer_settings(args)
    if cfg.reward_model is None and not cfg.reward.functions:
        raise ConfigError(
            "reward_model=none and no reward.functions: nothing would score the completions. Keep a reward model "
            "(reward_model=tiny) or add a function (reward.functions.<name>.function=<dotted path>)."
        )
    _check_data(cfg)
    _check_metric(cfg, args)
    validate_model_node(model, key="model", kind="policy")
    if reward_model is not None:
        validate_model_node(reward_model, key="reward_model")
    validate_policy_lora(model, reward_model)
    _check_lora_for_trl(cfg.model.lora)
    check_run_settings(cfg)
    check_trainer_output_dir(cfg.output_dir, args.output_dir)
    _check_rollout_mode(cfg)
    check_rollout_backend(cfg)
    _check_tools(cfg)
    check_output_folder(cfg.output_dir, overwrite=cfg.overwrite, resume=cfg.resume, inputs=inputs)
    check_sharded_launch(cfg.device)
    _check_resume(cfg, args, changes)
    rows = load_prompt_rows(config_view(cfg.data), "train")
    check_reward_functions(cfg.reward.functions, columns=list(rows.columns))
    check_reward_weights(cfg)
    longest_prompt = _check_prompt_lengths(cfg, rows, args)
    _check_store_fits_the_disk(cfg, args, prompt_width=longest_prompt)
    _check_eval(cfg)
    if cfg.rollout.replay.load_from is not None:
        load_replay_source(cfg, group_size=args.num_generations)


def grpo_config_fields(cfg: TrlGRPORecipeConfig) -> dict:
    """The ``trl.GRPOConfig`` fields this recipe sets from its own keys, the GRPO recipe's
    (:data:`~recipes.trl_grpo.schema.GRPO_CONFIG_FIELDS`): the group size, the sampler's settings (which trl's
    rollout function reads back: ``interop.SamplingSettings.from_grpo_config``), the reward aggregation and the
    progress bar.

    Examples:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.load("conf/trl_grpo_torchrl_rollouts.yaml")  # read by attribute, as the typed settings
        >>> fields = grpo_config_fields(cfg)
        >>> fields["num_generations"], fields["max_completion_length"], fields["generation_kwargs"]
        (8, 32, {'min_new_tokens': 0, 'do_sample': True})
    """
    generation = cfg.rollout.generation
    fields = {
        field: operator.attrgetter(key)(cfg)
        for field, key in GRPO_CONFIG_FIELDS.items()
        if field not in ("generation_kwargs", "disable_tqdm")
    }
    fields["generation_kwargs"] = {"min_new_tokens": generation.min_new_tokens, "do_sample": generation.do_sample}
    fields["disable_tqdm"] = not cfg.progress_bar
    return fields


def _check_sampling(cfg: TrlGRPORecipeConfig) -> None:
    """The sampler's settings, as the GRPO recipe checks its own: values the sampler takes, and sampling on (greedy
    decoding would give every completion of a group the same tokens)."""
    settings = sampler_settings(dataclasses.asdict(cfg.rollout.generation))
    if not settings.do_sample:
        raise ConfigError(
            f"rollout.generation.do_sample=false with rollout.group_size={cfg.rollout.group_size}: greedy decoding "
            "gives every completion of a prompt the same tokens, so each group's rewards tie, its advantages are 0 "
            "and nothing trains. Drop do_sample=false (lower rollout.generation.temperature for less varied "
            "completions)."
        )


def _check_trl_tool_keys(cfg: TrlGRPORecipeConfig) -> None:
    """trl's tool arguments are GRPOTrainer's, not GRPOConfig's: a user who writes them under ``train:`` is told this
    recipe's keys (``max_tool_calling_iterations`` is answered by the trainer node's hint)."""
    for name in ("tools", "environment_factory"):
        if name in cfg.train:
            raise ConfigError(
                f"train.{name}: trl takes its tools as GRPOTrainer(tools=...), which this recipe builds from the "
                "tools: node: name each function as tools.<name>.function=<dotted path> (e.g. "
                "tools.multiply.function=recipes.tasks.calculator.multiply), and the turns as rollout.max_turns."
            )


def _check_tools(cfg: TrlGRPORecipeConfig) -> None:
    """The tools resolve as trl would take them (``recipes.common.tools.resolve_tools``: importable, callable, typed,
    documented, named by their key), and a replay that would train without their mask is refused."""
    if resolve_tools(cfg.tools) is None:
        return
    if resolve_call_format(cfg.tools) is not None:
        raise ConfigError(
            "tools: a TorchRL piece here reads calls in its own format (a parser, a pattern, ```python blocks), "
            "which this recipe's rollout function does not take yet: it reads Qwen2.5's <tool_call> JSON only. Use "
            "a ToolRegistry (called in that format), MCP servers (tools.<label>.mcp) or Python function tools, or "
            "run the piece in the GRPO recipe (python recipes/grpo_torchrl_rm.py, docs/tools.md)."
        )
    if cfg.rollout.replay.enabled:
        raise ConfigError(
            "rollout.replay.enabled=true with tools: a replayed group would train without the env_mask that keeps "
            "its tool messages out of the loss. Use rollout.replay.enabled=false with tools."
        )


def _check_eval(cfg: TrlGRPORecipeConfig) -> None:
    """``eval.every_n_steps`` needs eval prompts and one 0/1 reward function to score them."""
    node = cfg.eval
    if node.every_n_steps is None:
        return
    if not load_prompt_rows(config_view(cfg.data), "eval").prompts:
        raise ConfigError(
            f"eval.every_n_steps={node.every_n_steps}, but data.source={cfg.data.source!r} has no eval prompts: set "
            "data.eval_path / data.eval_split (or use a task with held-out prompts: data=arithmetic, calculator), "
            "or eval.every_n_steps=null."
        )
    names = [str(name) for name in cfg.reward.functions]
    source = node.accuracy_source
    if source is None and len(names) != 1:
        raise ConfigError(
            f"eval.accuracy_source=null with {len(names)} reward functions ({names}): name the 0/1 check whose eval "
            "mean is eval/accuracy (eval.accuracy_source=<a reward.functions name>)."
        )
    if source is not None and source not in names:
        raise ConfigError(
            f"eval.accuracy_source={source!r} is not a reward.functions name ({names}); name the 0/1 check whose eval "
            "mean is eval/accuracy."
        )


def _check_rollout_mode(cfg: TrlGRPORecipeConfig) -> None:
    """rollout.mode=async samples the next generation batch before trl asks for it: the prompts trl will pass next
    must be knowable, so trl reads the stream unshuffled (the TorchRL buffer shuffles), in this process only."""
    if cfg.rollout.mode != "async":
        return
    if cfg.train.get("shuffle_dataset"):
        raise ConfigError(
            "train.shuffle_dataset=true with rollout.mode=async: trl's buffered shuffle would reorder the prompt "
            "stream the async sampler reads ahead. Drop it (the recipe turns it off: the TorchRL prompt buffer "
            "already draws without replacement in a new order every pass), or use rollout.mode=sync."
        )
    if cfg.train.get("dataloader_num_workers"):
        raise ConfigError(
            "train.dataloader_num_workers with rollout.mode=async: workers would draw the prompt stream in other "
            "processes, out of the async sampler's sight. Set it to 0, or use rollout.mode=sync."
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "rollout.mode=async under a launcher: the async sampler runs beside one trainer process. Use "
            "rollout.mode=sync with several processes."
        )


def load_replay_source(cfg: TrlGRPORecipeConfig, *, group_size: int):
    """The stored rollouts ``rollout.replay.load_from`` names, refused before any model loads when the folder holds
    none, is damaged, or was written with another tokenizer (its token ids would be other tokens) or another group
    size. Returns the rows (``recipes.trl_grpo.rollout_store.load_rollouts``)."""
    from recipes.common.models import load_tokenizer, tokenizer_fingerprint
    from recipes.trl_grpo.rollout_store import DamagedRollouts, load_rollouts, stored_group_sizes, stored_tokenizer

    key = "rollout.replay.load_from"
    folder = Path(str(cfg.rollout.replay.load_from)).expanduser()
    try:
        rows = load_rollouts(folder)
        written_with = stored_tokenizer(folder)
    except (FileNotFoundError, DamagedRollouts) as error:
        raise ConfigError(f"{key}={str(folder)!r}: {error}") from None
    ours = tokenizer_fingerprint(load_tokenizer(config_view(cfg.model), padding_side="left"))
    if written_with != ours:
        raise ConfigError(
            f"{key}={str(folder)!r} was written with another tokenizer than model={cfg.model.name_or_path!r}'s "
            f"({'no fingerprint recorded' if written_with is None else 'its vocabulary differs'}): its token ids would "
            "be other tokens here. Load rollouts a run of this policy stored."
        )
    recorded = stored_group_sizes(folder)
    if any(size != group_size for size in recorded):
        raise ConfigError(
            f"{key}={str(folder)!r} holds groups of {' and '.join(map(str, recorded))} completions per prompt (the "
            f"rollout.group_size of the run that stored them), and this run samples rollout.group_size="
            f"{group_size}: its groups would be loaded cut or merged, their advantages computed over other groups than "
            f"trl's. Set rollout.group_size={recorded[0]}, or load rollouts stored with {group_size}."
        )
    runs = _runs_of_one_prompt(rows)
    if rows.shape[0] < group_size or any(length % group_size for length in runs):
        raise ConfigError(
            f"{key}={str(folder)!r}: its rows do not come in whole groups of rollout.group_size={group_size}: "
            f"they hold runs of {sorted(set(runs))} completions of one prompt and step (the run that stored them "
            "sampled another group size, or its ring of rollout.store.max_rows dropped part of a group), and no "
            f"group would be loaded. Load rollouts stored with rollout.group_size={group_size} and no rows "
            "dropped, or set rollout.group_size to the stored runs' group size."
        )
    return rows


def _runs_of_one_prompt(rows) -> list[int]:
    """The lengths of the runs of consecutive stored rows of one process, step and prompt: whole groups, or several
    groups of one prompt drawn twice in a step."""
    prompt_ids, step, rank = rows.get("prompt_ids"), rows.get("step"), rows.get("rank")
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (step[1:] == step[:-1]) & (rank[1:] == rank[:-1])
    starts = [0, *(torch.nonzero(~same).flatten() + 1).tolist(), rows.shape[0]]
    return [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]


def _check_data(cfg: TrlGRPORecipeConfig) -> None:
    """Held-out data this recipe would never read (trl gets no eval_dataset here; ``eval:`` reads it itself)."""
    if cfg.eval.every_n_steps is not None:
        return
    for key in ("data.eval_path", "data.eval_split"):
        value = getattr(cfg.data, key.removeprefix("data."), None)  # only the data sources that read one have it
        if value is not None:
            raise ConfigError(
                f"{key}={value!r}: held-out data is read only by this recipe's own evaluation (trl gets no "
                "eval_dataset: its rollout store and figures would take evaluation batches for training ones), which "
                f"is off, so it would be ignored. Set eval.every_n_steps=N to evaluate on it, or drop {key}."
            )


def _check_metric(cfg: TrlGRPORecipeConfig, args) -> None:
    """The metric main() returns must be one the run's summary.json will hold (known before anything trains)."""
    metric = str(cfg.metric)
    if "oracle" in metric and cfg.data.oracle is None:
        raise ConfigError(
            f"metric={metric!r} needs an oracle, but data.oracle is null for data.source={cfg.data.source!r}; "
            "use metric=rollout/reward_mean_last."
        )
    known = summary_keys(cfg, args)
    if metric not in known:
        raise ConfigError(f"metric={metric!r} is not a summary.json entry of this run; use one of {sorted(known)}.")


def _check_resume(cfg: TrlGRPORecipeConfig, args, changes: Callable[[], dict]) -> None:
    """A resumed run continues a whole trl checkpoint, before train.max_steps, with the run's own reward sources and
    settings (``changes()``: what this resume changes, read from the run's records; those not named in
    resume_allow_changes are refused)."""
    if not cfg.resume:
        return
    checkpoint = latest_trl_checkpoint(args.output_dir)
    if checkpoint is None:
        raise ConfigError(
            f"resume=true, but {args.output_dir} holds no trl checkpoint (checkpoint-<step>/) to continue from: "
            "the run must save them (train.save_strategy=steps, train.save_steps=N)."
        )
    checkpoint, step = Path(checkpoint), checkpoint_step(checkpoint)
    if not (checkpoint / "trainer_state.json").is_file():
        raise ConfigError(
            f"The newest trl checkpoint, {checkpoint}, is incomplete: it has no trainer_state.json, which trl writes "
            "last (the run was stopped while saving it). Delete that folder to resume from the checkpoint before it, "
            "or start afresh (overwrite=true)."
        )
    if step > args.max_steps:
        raise ConfigError(
            f"train.max_steps={args.max_steps} is below the step of the checkpoint to resume ({step}, {checkpoint}): "
            f"the run is past it. Pass train.max_steps >= {step} to continue it, or start a new run in another folder."
        )
    if step == args.max_steps and not (Path(cfg.output_dir) / SUMMARY_FILE).is_file():
        raise ConfigError(
            f"The checkpoint to resume, {checkpoint}, is the run's last step (train.max_steps={args.max_steps}), but "
            f"the run stopped before writing its model/ and {SUMMARY_FILE}: nothing is left to train. Raise "
            f"train.max_steps to train further, or take the trained weights from {checkpoint}."
        )
    if (Path(cfg.output_dir) / "metrics.csv").is_file():
        read_metrics_rows(Path(cfg.output_dir) / "metrics.csv")  # a damaged file is named now, not after loading
    _check_rollouts_are_the_runs(Path(cfg.output_dir))
    stored = stored_sources(Path(cfg.output_dir) / ROLLOUTS_DIR)
    if stored is not None and stored != reward_source_names(cfg):
        raise ConfigError(
            f"resume=true with the reward sources {reward_source_names(cfg)}, but the run's stored rollouts "
            f"({Path(cfg.output_dir) / ROLLOUTS_DIR}) were scored by {stored}: a part with other reward columns "
            "could not be read with them as one table. Resume with the run's reward_model and reward.functions, or "
            "start a new run in another folder."
        )
    check_resume_changes(changes(), allowed=cfg.resume_allow_changes)


def _check_rollouts_are_the_runs(output_dir: Path) -> None:
    """A resumed run writes its new rollouts into ``rollouts/``: where that (or a process's folder in it) is a link,
    they would land in the storage it points to, another run's."""
    folder = output_dir / ROLLOUTS_DIR
    links = [path for path in (folder, *sorted(folder.glob("rank_*"))) if path.is_symlink()]
    if links:
        raise ConfigError(
            f"resume=true, but {links[0]} is a link to {links[0].resolve()}: the resumed run would write its new "
            "rollouts into that storage (another run's). Replace the link with a copy of what it points to "
            f"(cp -r --remove-destination {links[0].resolve()} {links[0]}), or start a new run in another folder."
        )


def _check_prompt_lengths(cfg: TrlGRPORecipeConfig, rows, args) -> int:
    """Prompts the policy cannot read whole with ``rollout.generation.max_new_tokens`` tokens after them (tokenizer
    and model config only: before any weights load). Returns the longest prompt's tokens."""
    model = config_view(cfg.model)
    tokenizer = load_tokenizer(model, padding_side="left")
    table = PromptTable(rows, tokenizer=tokenizer, system_prompt=cfg.rollout.system_prompt)
    tools = resolve_tools(cfg.tools)
    if tools is None:
        lengths = table.rendered_lengths()
    else:  # the tools' schemas are rendered into every prompt, as the rollout function renders them
        rendered = tokenizer.apply_chat_template(
            table.conversations, tools=tools.schemas, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        lengths = [len(ids) for ids in rendered["input_ids"]]
    check_prompts_fit_policy(
        lengths,
        model,
        max_new_tokens=args.max_completion_length,
        max_new_tokens_key="rollout.generation.max_new_tokens",
    )
    return max(lengths)


def _check_store_fits_the_disk(cfg: TrlGRPORecipeConfig, args, *, prompt_width: int) -> None:
    """The rollout store of every process, full (``rollout.store.max_rows`` rows of ``max_text_bytes`` of text each),
    must fit the free space of the disk that holds the run: a store that cannot would stop the run once it filled the
    disk, and one sized past what any disk holds fails at its first write ("File too large", or an allocation of
    the text columns), after the models have loaded."""
    store = cfg.rollout.store
    one_row = row_bytes(
        prompt_width=prompt_width, completion_width=args.max_completion_length, max_text_bytes=store.max_text_bytes
    )
    needed = one_row * store.max_rows * int(os.environ.get("WORLD_SIZE", "1"))
    folder = Path(str(cfg.output_dir)).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ConfigError(
            f"rollout.store.max_rows={store.max_rows} rows of rollout.store.max_text_bytes={store.max_text_bytes} "
            f"bytes of text each take {needed / 2**30:.3g} GiB once the store is full ({one_row} bytes a row, per "
            f"process), more than the {free / 2**30:.3g} GiB free on the disk holding {cfg.output_dir}. Lower "
            "rollout.store.max_rows (the oldest rows are dropped past it) or rollout.store.max_text_bytes, or run "
            "on a larger disk (hydra.run.dir=...)."
        )


def _check_lora_for_trl(lora) -> None:
    """trl's GRPOTrainer refuses an adapter on the output head (it computes log-probs from ``lm_head.weight``
    directly, so the adapter would never train): said here, before any model loads."""
    if lora is None or isinstance(lora.target_modules, str):
        return
    heads = [name for name in lora.target_modules if name == "lm_head" or str(name).endswith(".lm_head")]
    if heads:
        raise ConfigError(
            f"model.lora.target_modules names {heads[0]}: trl's GRPOTrainer computes log-probs from lm_head.weight "
            "directly, so an adapter there would never train (trl refuses it). Drop it from model.lora.target_modules "
            "(all-linear leaves the head out)."
        )


def _check_trainer_settings(args) -> None:
    """What ``train:``'s settings, as trl will read them (``args``: trl's defaults under the config's values and
    :func:`grpo_config_fields`), cannot combine: the mismatch correction's, and the group size against the generation
    batch."""
    from interop.trl.trainer import check_importance_sampling_settings  # imports trl: only where this recipe runs

    try:
        check_importance_sampling_settings(args)
    except SettingError as error:  # GRPOConfig's field: a train.<field> key here
        raise ConfigError(setting_message(error, "train")) from None
    per_device, group = args.per_device_train_batch_size, args.num_generations
    steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    generation_batch = per_device * steps_per_generation * processes
    if generation_batch % group:
        raise ConfigError(
            f"rollout.group_size={group} does not divide the generation batch of {generation_batch} completions "
            f"(train.per_device_train_batch_size={per_device} x steps_per_generation={steps_per_generation} x "
            f"{processes} process(es)): every prompt's group must be whole. Use a group size of 2 or more that "
            f"divides {generation_batch}, or change the batch size."
        )
