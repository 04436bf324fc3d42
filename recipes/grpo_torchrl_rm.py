"""GRPO built from TorchRL components, rewarded by a Hugging Face reward model through ``interop``.

    python recipes/grpo_torchrl_rm.py                                     # tiny policy + tiny RM, ~1 min on 2 CPUs
    python recipes/grpo_torchrl_rm.py -m optimizer.lr=1e-3,2e-3,4e-3      # a sweep: main() returns cfg.metric
    torchrun --standalone --nproc_per_node 2 recipes/grpo_torchrl_rm.py hydra.run.dir=outputs/ddp  # data-parallel

Each step: a ``ChatEnv`` fed by the prompt dataloader resets to ``responses_per_step / group_size`` prompts, each
repeated ``group_size`` times; the ``TransformersWrapper`` policy samples one response per copy; the env's
``interop.RewardModelTransform`` scores every conversation with the reward model (plus optional reward terms); the
``LLMCollector``'s post-processing pads the ragged responses into dense ``[B, T]`` tensors (one padding, rather than
TorchRL's per-sample unpadding and re-padding in every forward pass), recomputes the frozen reference's log-probs
(and the old ones, unless each step is a single on-policy update) with a non-generating wrapper, normalises the
rewards within each prompt's group with ``MCAdvantage``, and writes the step into a ``ReplayBuffer``
(``LazyStackStorage``); ``GRPOLoss`` then updates the policy over mini-batches with AdamW and gradient clipping.
Metrics go to the configured logger, checkpoints to ``<output_dir>/checkpoints``, the final figures to
``summary.json``.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) every process joins one process group (gloo on CPU,
nccl on CUDA, each process on ``cuda:<LOCAL_RANK>``) and collects its own ``responses_per_step`` responses: the
prompt stream is dealt out between the processes and each samples with its own seed (``seed + rank``). The loss runs
through a ``DistributedDataParallel`` wrapper of the policy, so every update applies the gradients averaged over all
processes and the weights stay identical everywhere; metrics are averaged over the processes before rank 0 alone
logs them, saves checkpoints and writes ``summary.json``. Every process gets the same ``hydra.run.dir`` (rank 0's
output folder is used by all, but pass one explicitly so that Hydra does not create a folder per process).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tensordict import set_list_to_stack
from tqdm.auto import tqdm

from recipes.common.config import ConfigError, run_config, write_run_config
from recipes.common.data import load_prompts
from recipes.common.distributed import (
    DataParallel,
    check_ranks_in_sync,
    make_data_parallel_policy,
    save_rank_weights,
    setup_data_parallel,
)
from recipes.common.logging import MetricLogger, make_logger
from recipes.common.models import load_causal_lm, load_reward_model, load_tokenizer, validate_model_node
from recipes.common.resume import (
    MODEL_FOLDER,
    capture_rng_state,
    latest_checkpoint,
    load_training_state,
    restore_rng_state,
    save_checkpoint,
    truncate_metrics_csv,
)
from recipes.common.rollout import (
    RecomputeLogProbs,
    make_chat_env,
    make_log_prob_scorer,
    make_policy,
    make_prompt_dataloader,
    pad_rollout,
    unknown_generation_settings,
)

REWARD_INPUTS = ("history", "text", "tokens")
BACKENDS = ("auto", "gloo", "nccl")
RANK_WEIGHTS_FOLDER = "rank_weights"
SUMMARY_SERIES = ("rollout/reward_mean", "rollout/oracle_mean", "train/kl_to_ref")
# What the replay buffer keeps of a rollout besides its padded tokens and recomputed log-probs.
CARRIED_KEYS = ("prompt_index", ("next", "reward"), ("next", "done"))


# ----------------------------------------------------------------------------------------------------- validation


def _checkpoint_root(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints"


def validate(cfg: DictConfig) -> None:
    """Cross-field checks that need nothing loaded; each message says what to change."""
    group, per_step = cfg.rollout.group_size, cfg.rollout.responses_per_step
    if group < 2:
        raise ConfigError(
            f"rollout.group_size={group}: GRPO normalises each reward against the other responses to the same prompt, "
            "so a group needs at least 2 responses; set rollout.group_size >= 2."
        )
    if per_step < group or per_step % group:
        raise ConfigError(
            f"rollout.responses_per_step={per_step} is not a multiple of rollout.group_size={group}: every prompt "
            f"gets a full group. Use a multiple, e.g. rollout.responses_per_step={max(1, per_step // group) * group}."
        )
    mini = cfg.train.mini_batch_size
    if mini < 1 or per_step % mini:
        raise ConfigError(
            f"train.mini_batch_size={mini} does not divide rollout.responses_per_step={per_step}; each step's "
            "responses are split into equal mini-batches. Pick a divisor (e.g. train.mini_batch_size="
            f"{per_step // 2 if per_step % 2 == 0 else per_step})."
        )
    for key in ("train.steps", "train.epochs_per_step"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be >= 1.")
    every = cfg.checkpoint.every_n_steps
    if every is not None and every < 1:
        raise ConfigError(f"checkpoint.every_n_steps={every} must be >= 1, or null to save only at the end.")
    if cfg.checkpoint.keep_last is not None and cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1, or null to keep all.")
    if cfg.summary.window < 1:
        raise ConfigError(f"summary.window={cfg.summary.window} must be >= 1.")
    generation = cfg.rollout.generation
    _validate_generation_keys(generation)
    if generation.max_new_tokens < 1:
        raise ConfigError(f"rollout.generation.max_new_tokens={generation.max_new_tokens} must be >= 1.")
    if generation.do_sample and generation.temperature <= 0:
        raise ConfigError(
            f"rollout.generation.temperature={generation.temperature} must be > 0 when sampling; GRPO needs diverse "
            "responses within a group."
        )
    if cfg.reward.input not in REWARD_INPUTS:
        raise ConfigError(f"reward.input={cfg.reward.input!r}: expected one of {list(REWARD_INPUTS)}.")
    if cfg.loss.aggregation not in ("token_mean", "prompt_mean"):
        raise ConfigError(f"loss.aggregation={cfg.loss.aggregation!r}: expected 'token_mean' or 'prompt_mean'.")
    if cfg.loss.kl_to_ref_coeff is not None and cfg.loss.kl_to_ref_coeff < 0:
        raise ConfigError(f"loss.kl_to_ref_coeff={cfg.loss.kl_to_ref_coeff} must be >= 0 (or null: no reference).")
    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device!r} but CUDA is not available here; use device=cpu.")
    _validate_distributed(cfg)
    metric = str(cfg.metric)
    known = {f"{name}_{end}" for name in SUMMARY_SERIES for end in ("first", "last")}
    known |= {"steps", "wall_time_s", "generated_tokens", "tokens_per_s", "setup_time_s"}
    if metric not in known:
        raise ConfigError(f"metric={metric!r} is not a summary.json entry; use one of {sorted(known)}.")
    if "oracle" in metric and cfg.data.oracle is None:
        raise ConfigError(
            f"metric={metric!r} needs an oracle, but data.oracle is null for data.source={cfg.data.source!r}; "
            "use metric=rollout/reward_mean_last."
        )
    validate_model_node(cfg.model, key="model")
    validate_model_node(cfg.reward_model, key="reward_model")
    if cfg.data.source == "file" and not Path(str(cfg.data.path)).expanduser().exists():
        raise ConfigError(
            f"data.path={str(cfg.data.path)!r}: no such file. Point it at a .jsonl/.json/.parquet/.csv file with a "
            f"{cfg.data.prompt_column!r} column of prompts."
        )
    has_checkpoint = latest_checkpoint(_checkpoint_root(cfg)) is not None
    if cfg.resume and not has_checkpoint:
        raise ConfigError(
            f"resume=true but {_checkpoint_root(cfg)} holds no checkpoint. Point the run at the folder of the run to "
            "continue (hydra.run.dir=<that folder>, or output_dir=<that folder> when calling train()), or drop "
            "resume=true to start afresh."
        )
    if not cfg.resume and has_checkpoint:
        raise ConfigError(
            f"{_checkpoint_root(cfg)} already holds checkpoints of an earlier run: pass resume=true to continue it, "
            "or choose another output folder (hydra.run.dir=...)."
        )


def _validate_generation_keys(generation: DictConfig) -> None:
    unknown = unknown_generation_settings(generation)
    if unknown:
        raise ConfigError(
            f"rollout.generation.{unknown[0]}: not a generation setting (a transformers GenerationConfig field); "
            "check the spelling (max_new_tokens, temperature, top_p, top_k, min_new_tokens...)."
        )


def _validate_distributed(cfg: DictConfig) -> None:
    backend = cfg.distributed.backend
    if backend not in BACKENDS:
        raise ConfigError(f"distributed.backend={backend!r}: expected one of {list(BACKENDS)}.")
    on_cuda = str(cfg.device).startswith("cuda")
    if backend == "nccl" and not on_cuda:
        raise ConfigError(f"distributed.backend=nccl needs device=cuda (got device={cfg.device!r}); use gloo or auto.")
    if "WORLD_SIZE" not in os.environ or not on_cuda:
        return
    local_rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > 1 and str(cfg.device) != "cuda":
        raise ConfigError(
            f"device={cfg.device!r} under torchrun with {world_size} processes: use device=cuda, each process then "
            "takes cuda:<LOCAL_RANK>."
        )
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} CUDA devices; start at most that "
            "many processes per node (torchrun --nproc_per_node)."
        )


# ----------------------------------------------------------------------------------------------------- factories


@dataclass
class Models:
    """What the run loads: the policy and its tokenizer, the reward model and its own, the frozen reference."""

    tokenizer: Any
    policy: Any
    reward_tokenizer: Any
    reward_model: Any
    reference: Any | None


def load_models(cfg: DictConfig, *, resume_from: Path | None) -> Models:
    """The policy comes from the checkpoint when resuming; the reference is always the initial policy."""
    policy_node = cfg.model
    if resume_from is not None:
        policy_node = OmegaConf.merge(
            cfg.model, {"name_or_path": str(resume_from / MODEL_FOLDER), "tokenizer_name_or_path": None}
        )
    reward_tokenizer = load_tokenizer(cfg.reward_model, padding_side="right")
    reference = None
    if cfg.loss.kl_to_ref_coeff:
        reference = load_causal_lm(cfg.model, device=cfg.device, dtype=cfg.dtype).eval().requires_grad_(False)
    return Models(
        tokenizer=load_tokenizer(policy_node, padding_side="left"),
        # eval(): GRPO's importance ratios compare forward passes that must not differ by dropout.
        policy=load_causal_lm(policy_node, device=cfg.device, dtype=cfg.dtype).eval(),
        reward_tokenizer=reward_tokenizer,
        reward_model=load_reward_model(
            cfg.reward_model, device=cfg.device, dtype=cfg.dtype, pad_token_id=reward_tokenizer.pad_token_id
        ).eval(),
        reference=reference,
    )


def make_reward_transforms(cfg: DictConfig, reward_model, reward_tokenizer, policy_tokenizer) -> list:
    """``RewardModelTransform`` over the reward model, then one accumulating transform per extra reward term."""
    from interop import HFRewardModelWrapper, RewardModelTransform

    keys = {name: tuple(key) for name, key in cfg.reward.read_keys.items()}
    common = {
        "inference_mode": True,
        "micro_batch_size": cfg.reward.micro_batch_size,
        "max_length": cfg.reward.max_length,
    }
    if cfg.reward.input == "tokens":
        if reward_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
            raise ConfigError(
                "reward.input=tokens feeds the policy's token ids to the reward model, but the two tokenizers differ "
                f"({cfg.model.name_or_path} vs {cfg.reward_model.name_or_path}); use reward.input=history or text."
            )
        wrapper = HFRewardModelWrapper(
            reward_model, token_key=keys["tokens"], attention_mask_key=keys["attention_mask"], **common
        )
    elif cfg.reward.input == "text":
        wrapper = HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, text_key=keys["text"], **common)
    else:
        wrapper = HFRewardModelWrapper(reward_model, tokenizer=reward_tokenizer, history_key=keys["history"], **common)
    transforms = [RewardModelTransform(wrapper)]
    for term in cfg.reward.terms.values():
        transforms.append(RewardModelTransform(instantiate(term), accumulate=True))
    return transforms


def make_replay_buffer(cfg: DictConfig):
    """One step's responses (with their advantages), handed out in mini-batches without replacement."""
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    return ReplayBuffer(
        storage=LazyStackStorage(cfg.rollout.responses_per_step),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.train.mini_batch_size,
    )


def make_collector(
    cfg: DictConfig, models: Models, buffer, *, actor, start_step: int, num_replicas: int = 1, rank: int = 0
):
    """``LLMCollector`` over the prompt env; each batch is padded, gets its advantages and log-probs, then goes into
    ``buffer``.

    With ``num_replicas`` data-parallel processes, each draws its own prompts from the one shared stream."""
    from torchrl.collectors.llm import LLMCollector

    from recipes.common.losses import GroupAdvantage

    group, per_step = cfg.rollout.group_size, cfg.rollout.responses_per_step
    # The prompt stream is a function of the step (each step draws per_step / group prompts per process): resuming
    # continues it.
    loader = make_prompt_dataloader(
        load_prompts(cfg.data, "train"),
        seed=cfg.seed,
        start=start_step * (per_step // group) * num_replicas,
        num_replicas=num_replicas,
        rank=rank,
    )
    env = make_chat_env(
        loader,
        tokenizer=models.tokenizer,
        group_size=group,
        num_prompts=per_step // group,
        system_prompt=cfg.rollout.system_prompt,
        transforms=make_reward_transforms(cfg, models.reward_model, models.reward_tokenizer, models.tokenizer),
    )
    micro = cfg.rollout.log_prob_micro_batch_size
    # On-policy, the old log-probs would equal the loss's own: OnPolicyGRPOLoss takes those, saving a forward pass.
    recomputes = [] if is_on_policy(cfg) else [RecomputeLogProbs(actor, micro_batch_size=micro)]
    if models.reference is not None:
        reference = make_log_prob_scorer(models.reference, models.tokenizer, device=cfg.device, padded=True)
        recomputes.append(
            RecomputeLogProbs(reference, out_key=("next", "ref_log_probs", "full"), micro_batch_size=micro)
        )

    pad_token_id = models.tokenizer.pad_token_id
    # MCAdvantage normalises each reward within its prompt's group (each step holds whole groups).
    advantage = GroupAdvantage(group, prompt_key="prompt_index")

    def postproc(rollout):
        # Only what the loss and the metrics read goes on, as dense [B, T] tensors: the ragged per-sample tensors,
        # chat histories and texts would cost more to move around than the forward passes.
        batch = pad_rollout(rollout, pad_token_id=pad_token_id)
        batch.update(rollout.select(*CARRIED_KEYS).to_tensordict())
        advantage(batch)
        for recompute in recomputes:
            recompute(batch)
        return batch

    return LLMCollector(
        env,
        policy=make_policy(models.policy, models.tokenizer, generation=cfg.rollout.generation, device=cfg.device),
        dialog_turns_per_batch=per_step,
        total_dialog_turns=max(cfg.train.steps - start_step, 1) * per_step,
        replay_buffer=buffer,
        postproc=postproc,
    )


def is_on_policy(cfg: DictConfig) -> bool:
    """One update per step: the responses train the very policy that sampled them, old log-probs = current ones."""
    return cfg.train.epochs_per_step == 1 and cfg.train.mini_batch_size == cfg.rollout.responses_per_step


def make_loss(cfg: DictConfig, actor):
    from recipes.common.losses import OnPolicyGRPOLoss

    # GRPOLoss, except that a batch without old log-probs (is_on_policy: none are recomputed) takes the current ones.
    return OnPolicyGRPOLoss(
        actor,
        clip_epsilon=cfg.loss.clip_epsilon,
        entropy_bonus=True,  # also what reports train/entropy; its weight in the loss is entropy_coeff
        entropy_coeff=cfg.loss.entropy_coeff,
        kl_to_ref_coeff=cfg.loss.kl_to_ref_coeff or None,
        aggregation=cfg.loss.aggregation,
        masking_strategy="sft",
    )


# ----------------------------------------------------------------------------------------------------- training


def rollout_metrics(data, tokenizer, oracle, *, gather=None) -> tuple[dict[str, float], int]:
    """Reward, oracle and length statistics of one step's responses, and how many tokens were generated.

    ``gather`` (``DataParallel.gather``) pools the per-response values of every data-parallel rank first, so that
    the figures are those of the whole step's responses."""
    # Padded rows (pad_rollout): a response is what the attention mask keeps after the prompt columns.
    response_mask = data["masks", "all_attention_mask"][:, data["tokens", "prompt"].shape[-1] :]
    values = {
        "reward": data.get(("next", "reward")).reshape(-1).float(),
        "length": response_mask.sum(-1).double(),
    }
    if oracle is not None:
        responses = [row[mask] for row, mask in zip(data["tokens", "response"], response_mask, strict=True)]
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        values["oracle"] = torch.tensor([float(oracle(t)) for t in texts], dtype=torch.float64)
    if gather is not None:
        values = {key: gather(value) for key, value in values.items()}
    metrics = {
        "rollout/reward_mean": values["reward"].mean().item(),
        "rollout/reward_std": values["reward"].std().item(),
    }
    if oracle is not None:
        metrics["rollout/oracle_mean"] = values["oracle"].mean().item()
    metrics["rollout/response_length"] = values["length"].mean().item()
    return metrics, int(values["length"].sum().item())


def training_loss(out, *, entropy_coeff: float) -> torch.Tensor:
    """The sum of ``GRPOLoss``'s ``loss_*`` terms, without the entropy term when its coefficient is 0.

    That term is then ``0 * entropy``: nothing to the loss, but its backward would run through a softmax over the whole
    vocabulary at every position of the batch (``entropy_bonus=True`` stays on for the ``train/entropy`` metric)."""
    skipped = set() if entropy_coeff else {"loss_entropy"}
    terms = [value for key, value in out.items() if key.startswith("loss_") and key not in skipped]
    return sum(value for value in terms if value is not None)


def optimize(cfg: DictConfig, loss_module, optimizer, buffer, parameters: list) -> dict[str, float]:
    """``train.epochs_per_step`` passes over the buffer in mini-batches; returns the updates' mean diagnostics."""
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(cfg.train.epochs_per_step):
        for _ in range(cfg.rollout.responses_per_step // cfg.train.mini_batch_size):
            # LazyStackStorage hands out a lazy stack of samples: stacked once here, the loss's logits are not split
            # into per-sample tensors and re-stacked (whose backward copies the whole gradient once per sample).
            out = loss_module(buffer.sample().contiguous())
            loss = training_loss(out, entropy_coeff=cfg.loss.entropy_coeff)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, cfg.train.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            values = {"train/loss": loss, "train/clip_fraction": out.clip_fraction, "train/entropy": out.entropy}
            if out.kl_to_ref is not None:
                values["train/kl_to_ref"] = out.kl_to_ref
            values["train/grad_norm"] = grad_norm
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach().mean())
    return {key: total / updates for key, total in sums.items()}


def summarize(history: list[dict], *, window: int, wall_time: float, tokens: int, rollout_time: float) -> dict:
    """``wall_time_s``: the training steps' time over every invocation (setup apart); ``tokens_per_s``: generated
    tokens per second of rollout (generation, reward, log-prob recomputation)."""
    summary = {
        "steps": len(history),
        "wall_time_s": wall_time,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / max(rollout_time, 1e-9),
    }
    for name in SUMMARY_SERIES:
        values = [row[name] for row in history if name in row]
        if values:
            # The first step samples from the initial policy: the starting point. The end is averaged for stability.
            summary[f"{name}_first"] = values[0]
            summary[f"{name}_last"] = sum(values[-window:]) / len(values[-window:])
    return summary


def train(cfg: DictConfig) -> dict:
    """Runs (or resumes) GRPO as configured and returns the summary also written to ``summary.json``.

    Under torchrun every process calls it; each returns the same summary (metrics are averaged over the processes),
    and rank 0 alone writes the run folder."""
    setup_start = time.perf_counter()
    validate(cfg)
    data_parallel = setup_data_parallel(device=cfg.device, backend=cfg.distributed.backend)
    try:
        return _train(cfg, data_parallel, setup_start=setup_start)
    finally:
        data_parallel.close()


def _restore_rng(cfg: DictConfig, state: dict, data_parallel: DataParallel, start_step: int) -> None:
    saved = state["rng_by_rank"]
    if len(saved) == data_parallel.world_size:
        restore_rng_state(saved[data_parallel.rank])
        return
    # Another number of processes than the run that saved: the prompt stream continues exactly, the sampling noise
    # cannot, so each rank starts a fresh seed of its own.
    if data_parallel.is_main:
        warnings.warn(
            f"Resuming a run of {len(saved)} process(es) with {data_parallel.world_size}: the prompts continue where "
            "they stopped, but the sampling does not replay what an uninterrupted run would have drawn.",
            stacklevel=2,
        )
    seed = cfg.seed + data_parallel.rank + start_step * data_parallel.world_size
    random.seed(seed)
    torch.manual_seed(seed)


def _train(cfg: DictConfig, data_parallel: DataParallel, *, setup_start: float) -> dict:
    set_list_to_stack(True).set()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    # Every process writes to rank 0's folder, even where Hydra gave each its own (a timestamped default).
    output_dir = Path(data_parallel.broadcast_object(str(cfg.output_dir)))
    is_main = data_parallel.is_main
    if is_main:
        write_run_config(cfg, output_dir)
    checkpoint_root = output_dir / "checkpoints"
    resume_from = latest_checkpoint(checkpoint_root) if cfg.resume else None
    state = load_training_state(resume_from) if resume_from is not None else None
    start_step = state["step"] if state is not None else 0

    models = load_models(cfg, resume_from=resume_from)
    oracle = instantiate(cfg.data.oracle) if cfg.data.oracle is not None else None
    # One non-generating wrapper over the policy both recomputes the old log-probs and is GRPOLoss's actor; it goes
    # through the DDP wrapper, so the loss's backward averages the gradients over the ranks. The sampling policy
    # uses the bare model: same weights, and generation needs no gradient.
    trained = make_data_parallel_policy(models.policy, data_parallel, device=cfg.device)
    actor = make_log_prob_scorer(trained, models.tokenizer, device=cfg.device, padded=True)
    buffer = make_replay_buffer(cfg)
    collector = make_collector(
        cfg,
        models,
        buffer,
        actor=actor,
        start_step=start_step,
        num_replicas=data_parallel.world_size,
        rank=data_parallel.rank,
    )
    loss_module = make_loss(cfg, actor)
    parameters = list(models.policy.parameters())  # a list: clipped at every update, not a spent generator
    optimizer = instantiate(cfg.optimizer)(parameters)

    progress = {"history": [], "wall_time_s": 0.0, "tokens_total": 0, "rollout_time_s": 0.0}
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        progress = {key: state[key] for key in progress}
        _restore_rng(cfg, state, data_parallel, start_step)
        if is_main:
            truncate_metrics_csv(output_dir / "metrics.csv", start_step)
    else:
        # Seeded once everything is built, so that the run depends on the seed and not on what loading drew; each
        # rank samples its own responses.
        random.seed(cfg.seed + data_parallel.rank)
        torch.manual_seed(cfg.seed + data_parallel.rank)
    history = progress["history"]

    logger = (
        make_logger(cfg.logger, output_dir, config=run_config(cfg)) if is_main else MetricLogger("none", output_dir)
    )
    setup_time = time.perf_counter() - setup_start
    show_bar = cfg.progress_bar and is_main
    bar = tqdm(total=cfg.train.steps, initial=start_step, desc="GRPO", unit="step", disable=not show_bar)
    gather = data_parallel.gather if data_parallel.active else None
    try:
        batches = iter(collector)
        for step in range(start_step + 1, cfg.train.steps + 1):
            step_start = time.perf_counter()
            next(batches)  # generates, scores, recomputes log-probs and fills the buffer
            rollout_time = time.perf_counter() - step_start
            metrics, tokens = rollout_metrics(buffer[:], models.tokenizer, oracle, gather=gather)
            updates = optimize(cfg, loss_module, optimizer, buffer, parameters)
            buffer.empty()

            step_time = time.perf_counter() - step_start
            # Each rank's own diagnostics and times, averaged; the rollout figures above are already global.
            updates.update({"perf/rollout_time_s": rollout_time, "perf/step_time_s": step_time})
            metrics.update(data_parallel.mean(updates))
            metrics["perf/tokens_per_s"] = tokens / metrics["perf/rollout_time_s"]
            if not all(math.isfinite(v) for v in metrics.values()):
                raise FloatingPointError(f"Non-finite metrics at step {step}: {metrics}; lower optimizer.lr.")
            history.append(metrics)
            progress["wall_time_s"] += metrics["perf/step_time_s"]
            progress["tokens_total"] += tokens
            progress["rollout_time_s"] += metrics["perf/rollout_time_s"]
            logger.log(metrics, step=step)
            shown = {"reward": f"{metrics['rollout/reward_mean']:.3f}"}
            if "rollout/oracle_mean" in metrics:
                shown["oracle"] = f"{metrics['rollout/oracle_mean']:.3f}"
            bar.set_postfix(shown)
            bar.update(1)

            every = cfg.checkpoint.every_n_steps
            if step == cfg.train.steps or (every is not None and step % every == 0):
                check_ranks_in_sync(models.policy, data_parallel)
                # Every rank's RNG state, so that a resumed run samples as this one would have.
                rng_by_rank = data_parallel.gather_objects(capture_rng_state())
                if is_main:
                    save_checkpoint(
                        checkpoint_root,
                        step,
                        model=models.policy,
                        tokenizer=models.tokenizer,
                        optimizer=optimizer,
                        state={**progress, "rng_by_rank": rng_by_rank},
                        keep_last=cfg.checkpoint.keep_last,
                    )
        if cfg.distributed.save_rank_weights:
            save_rank_weights(models.policy, output_dir / RANK_WEIGHTS_FOLDER, data_parallel.rank)
    finally:
        bar.close()
        logger.close()
        collector.shutdown()

    summary = summarize(
        history,
        window=cfg.summary.window,
        wall_time=progress["wall_time_s"],
        tokens=progress["tokens_total"],
        rollout_time=progress["rollout_time_s"],
    )
    summary["setup_time_s"] = setup_time
    summary["world_size"] = data_parallel.world_size
    if is_main:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo_torchrl_rm")
def main(cfg: DictConfig) -> float:
    # TorchRL 0.14.1's own internals trigger these; there is nothing a user of the recipe can do about them.
    warnings.filterwarnings("ignore", message="size_average and reduce args will be deprecated")
    warnings.filterwarnings("ignore", message="The env passed to LLMCollector is missing transforms")
    summary = train(cfg)
    return summary[cfg.metric]


if __name__ == "__main__":
    main()
