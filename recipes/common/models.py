"""Loading policies, reward models and tokenizers from a config node, the same way for the tiny kit and hub ids.

A model node (``conf/model/*.yaml``, ``conf/reward_model/*.yaml``) has ``name_or_path`` (a local folder or hub id),
``tokenizer_name_or_path`` (null: the model's own), ``trust_remote_code`` (off unless the config turns it on) and
``lora`` (null, or the LoRA adapters a recipe trains: ``recipes.common.lora``). Weights load as safetensors only.

``name_or_path`` may also be a peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, what a
LoRA run saves): the base it names is loaded, the adapter applied and merged in.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError, safe_open

from recipes.common.checkpoint import MODEL_FOLDER, broken_checkpoint_advice
from recipes.common.config import ConfigError, check_local_path, first_items

# transformers is imported inside the functions that load a model or tokenizer: it takes about half a second, which
# `--help` and config validation (what a mistyped setting waits on) need not spend.

__all__ = [
    "tokenizer_fingerprint",
    "check_pad_token",
    "check_tokenizer_fits_model",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "meta_model",
    "read_adapter_config",
    "resolve_dtype",
    "validate_model_node",
]

_WEIGHTS = "model.safetensors"
_SHARDED_WEIGHTS = "model.safetensors.index.json"
_PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
# A peft adapter folder (PeftModel.save_pretrained): the adapter's settings, the base's name and the adapter weights.
ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The peft task type each kind of model is trained with.
_ADAPTER_TASKS = {"policy": "CAUSAL_LM", "reward_model": "SEQ_CLS"}

# What "a reward model" means wherever one scores: what to tell a user who points at something else.
_REWARD_MODEL_IS = (
    "a reward model here is a sequence classifier with one trained score (AutoModelForSequenceClassification, "
    "num_labels=1), e.g. the <run dir>/model that `python recipes/reward_trainer_from_buffer.py "
    "reward_model.name_or_path=<a base checkpoint>` trains"
)


def _saved_config(name_or_path: str, *, key: str) -> dict | None:
    """The ``config.json`` of a local checkpoint folder, or None (a hub id, or no config there)."""
    path = Path(name_or_path).expanduser() / "config.json"
    return _read_json(path, key=key) if path.is_file() else None


def _read_json(path: Path, *, key: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"{key}.name_or_path={str(path.parent)!r}: {path.name} is not valid JSON ({error}); the checkpoint is "
            "damaged. Re-download or re-save it."
        ) from None


def _weight_files(folder: Path, *, key: str) -> list[Path]:
    """The safetensors files of a local checkpoint folder; a folder without them is refused, saying what is missing."""
    if (folder / _WEIGHTS).is_file():
        return [folder / _WEIGHTS]
    if (folder / ADAPTER_CONFIG).is_file() and (folder / _ADAPTER_WEIGHTS).is_file():
        return [folder / _ADAPTER_WEIGHTS]
    if (folder / _SHARDED_WEIGHTS).is_file():
        shards = sorted(set(_read_json(folder / _SHARDED_WEIGHTS, key=key).get("weight_map", {}).values()))
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise ConfigError(
                f"{key}.name_or_path={str(folder)!r}: {_SHARDED_WEIGHTS} lists {len(missing)} shard(s) that are not "
                f"there ({first_items(missing, 5)}). Copy or download the missing shards."
            )
        return [folder / shard for shard in shards]
    pickled = [name for name in _PICKLED_WEIGHTS if (folder / name).is_file()]
    if pickled:
        raise ConfigError(
            f"{key}.name_or_path={str(folder)!r} holds its weights as {pickled[0]} (a pickle, which can run code when "
            f"loaded); this project loads safetensors only. Convert it once, where you trust where the file came from: "
            f"`AutoModelForCausalLM.from_pretrained(folder, use_safetensors=False).save_pretrained(folder, "
            "safe_serialization=True)` (AutoModelForSequenceClassification for a reward model)."
        )
    if (folder / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{key}.name_or_path={str(folder)!r} has an {ADAPTER_CONFIG} but no {_ADAPTER_WEIGHTS}: the adapter's "
            "weights are missing. Copy them into the folder, or point at a complete adapter folder (one written by "
            "a LoRA run's `save_pretrained`)."
        )
    raise ConfigError(
        f"{key}.name_or_path={str(folder)!r} has a config.json but no weights: neither {_WEIGHTS} nor "
        f"{_SHARDED_WEIGHTS} with its shards. Copy the weights into the folder, or point at a complete checkpoint "
        "(one written by `save_pretrained`)."
    )


def _check_weights(folder: Path, *, key: str) -> None:
    """Reads each safetensors file's header (not its tensors): a truncated or garbled file fails here, before any
    model loads, rather than minutes later inside ``from_pretrained``."""
    for file in _weight_files(folder, key=key):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as error:
            raise ConfigError(_corrupted_weights(key=key, name_or_path=str(folder), error=error, file=file)) from None


def _corrupted_weights(*, key: str, name_or_path: str, error: Exception, file: Path | str | None = None) -> str:
    folder = Path(name_or_path).expanduser()
    if file is None:
        file = "its safetensors weights" if folder.exists() else "its weights in the Hugging Face cache"
    advice = "Re-download it, or re-save the model with `save_pretrained`."
    # A checkpoint's model folder: the previous checkpoint is the way out.
    if folder.name == MODEL_FOLDER and (fallback := broken_checkpoint_advice(folder.parent)):
        advice = fallback
    return f"{key}.name_or_path={name_or_path!r}: {file}: corrupted or truncated ({error}). {advice}"


def _check_kind(config: dict, *, key: str, name_or_path: str, kind: str | None) -> None:
    architectures = config.get("architectures") or []
    classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    if kind == "policy" and classifier:
        raise ConfigError(
            f"{key}.name_or_path={name_or_path!r} is a {architectures[0]} checkpoint (a reward model), not a causal "
            "LM: the policy generates, so it needs a language-model head. Point it at a causal LM (e.g. "
            "model=tiny or a hub id such as Qwen/Qwen2.5-0.5B-Instruct)."
        )
    if kind == "reward_model":
        if architectures and not classifier:
            raise ConfigError(
                f"{key}.name_or_path={name_or_path!r} is a {architectures[0]} checkpoint, not a reward model: "
                f"{_REWARD_MODEL_IS}. Loaded as one, its score head would be random and GRPO would train against noise."
            )
        labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 1)
        if classifier and labels != 1:
            raise ConfigError(
                f"{key}.name_or_path={name_or_path!r} classifies into {labels} labels; {_REWARD_MODEL_IS}."
            )


def validate_model_node(node: DictConfig, *, key: str, kind: str | None = None) -> None:
    """Checks a model node before anything loads: local folders must exist, hold the kind of model asked for, and
    safetensors weights whose headers read.

    ``kind``: ``"policy"`` refuses a sequence classifier; ``"reward_model"`` refuses what is not one (a causal LM, a
    classifier of several labels); ``None`` (a model to be trained into a reward model, say) checks only the path.
    """
    check_local_path(str(node.name_or_path), key=f"{key}.name_or_path", what="model")
    if node.tokenizer_name_or_path is not None:
        check_local_path(str(node.tokenizer_name_or_path), key=f"{key}.tokenizer_name_or_path", what="tokenizer")
    adapter = read_adapter_config(node, key=key, kind=kind)
    if adapter is not None:
        _check_weights(Path(str(node.name_or_path)).expanduser(), key=key)
        # A reward model's score head may be in the adapter (peft's modules_to_save) rather than in its base.
        base_kind = "policy" if kind == "policy" else None
        validate_model_node(_base_node(node, adapter), key=f"{key} (the adapter's base)", kind=base_kind)
        return
    config = _saved_config(str(node.name_or_path), key=key)
    if config is not None:
        _check_remote_code(config, node, key=key)
        _check_kind(config, key=key, name_or_path=str(node.name_or_path), kind=kind)
        _check_weights(Path(str(node.name_or_path)).expanduser(), key=key)


def _check_remote_code(config: dict, node: DictConfig, *, key: str) -> None:
    """A checkpoint whose model class is code in its own folder (``auto_map``) loads only with trust_remote_code, which
    runs that code: refused by name unless the config turns it on."""
    if "auto_map" in config and not node.trust_remote_code and config.get("model_type") not in _known_model_types():
        raise ConfigError(
            f"{key}.name_or_path={str(node.name_or_path)!r} defines its model in code of its own (config.json "
            f"auto_map: {sorted(config['auto_map'])}), which transformers loads only by running that code. If you "
            f"trust where the folder came from, set {key}.trust_remote_code=true; otherwise use a checkpoint of a "
            "model type transformers ships."
        )


def _known_model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def read_adapter_config(node: DictConfig, *, key: str, kind: str | None = None) -> dict | None:
    """The ``adapter_config.json`` of a node whose ``name_or_path`` is a local peft adapter folder, or None.

    ``kind`` (``"policy"``, ``"reward_model"``): an adapter trained for another task (a causal-LM adapter where a
    reward model is wanted...) is refused, as is one that does not name its base model.
    """
    path = Path(str(node.name_or_path)).expanduser() / ADAPTER_CONFIG
    if not path.is_file():
        return None
    adapter = _read_json(path, key=key)
    if not adapter.get("base_model_name_or_path"):
        raise ConfigError(
            f"{key}.name_or_path={str(node.name_or_path)!r}: {ADAPTER_CONFIG} names no base_model_name_or_path, so "
            "there is no model to apply the adapter to. Set it in the file to the base model's folder or hub id."
        )
    task = _ADAPTER_TASKS.get(kind)
    if task is not None and adapter.get("task_type") != task:
        raise ConfigError(
            f"{key}.name_or_path={str(node.name_or_path)!r} is a {adapter.get('task_type')} adapter; a {kind} needs a "
            f"{task} adapter (the policy's come from recipes/grpo_torchrl_rm.py model.lora=..., a reward model's "
            "from recipes/reward_trainer_from_buffer.py reward_model.lora=...)."
        )
    return adapter


def _base_node(node: DictConfig, adapter: dict) -> DictConfig:
    """The node of an adapter's base model: its own tokenizer stays the adapter folder's (saved beside it)."""
    return OmegaConf.merge(
        node,
        {
            "name_or_path": adapter["base_model_name_or_path"],
            "tokenizer_name_or_path": node.tokenizer_name_or_path or node.name_or_path,
            "lora": None,
        },
    )


def _merge_adapter(base, folder: str):
    """``base`` with the adapter in ``folder`` applied and merged into its weights: a plain ``transformers`` model."""
    from peft import PeftModel

    return merge_adapters(PeftModel.from_pretrained(base, folder))


def merge_adapters(model):
    """A ``peft.PeftModel``'s adapters merged into its base weights (in place): the plain ``transformers`` model that
    computes what the adapted one did.

    An adapter on an output embedding tied to the input embeddings (``lm_head`` of a ``tie_word_embeddings`` model,
    the tiny policy's) adapts the LM head only, but merging it into the shared weight would move the embeddings too
    (on the tiny policy: logits off by 4.6). The head is untied first (its own copy of the weight,
    ``tie_word_embeddings=False`` in the config), so the merged model embeds as the base did."""
    base = model.get_base_model()
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    head_layer = getattr(head, "base_layer", None)  # an adapted head is a LoRA layer around the original
    if head_layer is not None and embeddings is not None and head_layer.weight is embeddings.weight:
        head_layer.weight = torch.nn.Parameter(head_layer.weight.detach().clone(), requires_grad=False)
        base.config.tie_word_embeddings = False
        if hasattr(base.config, "get_text_config"):
            base.config.get_text_config().tie_word_embeddings = False
    return model.merge_and_unload()


def check_tokenizer_fits_model(node: DictConfig, *, key: str) -> None:
    """Refuses a tokenizer whose ids reach past the model's embedding table (a tokenizer of another model, say):
    the first forward pass would index out of range. Reads the tokenizer and ``config.json`` only."""
    from transformers import AutoTokenizer

    adapter = read_adapter_config(node, key=key)
    config = _loaded_config(_base_node(node, adapter) if adapter is not None else node)
    vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    tokenizer_path = node.tokenizer_name_or_path or node.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=node.trust_remote_code)
    # The ids text tokenizes into (its base vocabulary) and those the recipes write (pad, EOS, BOS): an added token
    # that no text of the run spells (Qwen2Tokenizer adds <|endoftext|>, as unk, to any vocabulary) is no harm.
    written = (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
    used = max([tokenizer.vocab_size - 1, *(i for i in written if i is not None)])
    if vocab is not None and used >= vocab:
        raise ConfigError(
            f"{key}: the tokenizer of {str(tokenizer_path)!r} gives ids up to {used}, but the model "
            f"{str(node.name_or_path)!r} embeds only {vocab} (vocab_size): ids past {vocab - 1} would index out of its "
            f"embedding table. Use the model's own tokenizer ({key}.tokenizer_name_or_path=null) or one of its "
            "vocabulary."
        )


def meta_model(node: DictConfig, *, kind: str, dtype: torch.dtype | None = None):
    """The model of ``node`` (or of the base an adapter folder names) built from its config alone on the meta device
    (no weights, no memory): its modules' names, shapes and dtypes, for checks and estimates that must not load it.
    ``kind``: ``"policy"`` or ``"reward_model"``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    adapter = read_adapter_config(node, key=kind)
    config = _loaded_config(_base_node(node, adapter) if adapter is not None else node)
    auto = AutoModelForCausalLM if kind == "policy" else AutoModelForSequenceClassification
    if kind != "policy":
        config.num_labels = 1
    options = {"dtype": dtype} if dtype is not None else {}
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=node.trust_remote_code, **options)


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` -> the torch dtype, with an error listing the accepted names."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ConfigError(f"dtype={name!r} is not supported; use one of {sorted(dtypes)}.")
    return dtypes[name]


def load_tokenizer(node: DictConfig, *, padding_side: str):
    """The node's tokenizer, with a pad token distinct from EOS (TorchRL's response masks need it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        node.tokenizer_name_or_path or node.name_or_path, trust_remote_code=node.trust_remote_code
    )
    tokenizer.padding_side = padding_side
    check_pad_token(tokenizer, owner=f"The tokenizer of {node.name_or_path!r}")
    return tokenizer


def check_pad_token(tokenizer, *, owner: str) -> None:
    """Refuses a tokenizer whose pad token is missing or is EOS: TorchRL's wrappers and the sampling policy mask
    responses with ``tokens != pad``, so a pad equal to EOS would mask the generated EOS out as padding.

    Args:
        tokenizer: the tokenizer to check.

    Keyword Args:
        owner: what the error names first, e.g. ``"The tokenizer of 'Qwen/Qwen2.5-0.5B'"``.

    Raises:
        ConfigError: no pad token, or the pad token is the EOS token.
    """
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ConfigError(
            f"{owner} has no pad token distinct from EOS (pad={tokenizer.pad_token!r}, eos={tokenizer.eos_token!r}); "
            "with pad == EOS the generated EOS is masked out as padding. Use a tokenizer with its own pad token "
            "(e.g. Qwen's <|endoftext|> when EOS is <|im_end|>)."
        )


def load_causal_lm(node: DictConfig, *, device: str, dtype: str):
    """A causal LM from ``node.name_or_path`` on ``device`` in ``dtype``; a sequence classifier is refused."""
    from transformers import AutoModelForCausalLM

    adapter = read_adapter_config(node, key="model", kind="policy")
    if adapter is not None:
        base = load_causal_lm(_base_node(node, adapter), device=device, dtype=dtype)
        return _merge_adapter(base, str(node.name_or_path)).to(device)
    _check_kind(_loaded_config(node).to_dict(), key="model", name_or_path=str(node.name_or_path), kind="policy")
    model = _from_pretrained(AutoModelForCausalLM, node, key="model", dtype=resolve_dtype(dtype))
    return model.to(device)


def load_reward_model(
    node: DictConfig, *, device: str, dtype: str, pad_token_id: int | None = None, trained: bool = True
):
    """A sequence-classification reward model (num_labels=1) whose config knows its tokenizer's pad id.

    HF classification heads score the rightmost token that is not ``config.pad_token_id``, so the id must match the
    tokenizer's pad token; a model saved without it gets it from ``pad_token_id``.

    ``trained=True`` (a model that scores): a checkpoint that is no reward model, or whose score head is not in its
    weights (it would be initialised at random), is refused. ``trained=False`` (a model about to be trained into a
    reward model, from a causal LM or a fresh classifier): the head may be new.
    """
    from transformers import AutoModelForSequenceClassification

    adapter = read_adapter_config(node, key="reward_model", kind="reward_model")
    if adapter is not None:
        return _load_adapter_reward_model(node, adapter, device=device, dtype=dtype, pad_token_id=pad_token_id)
    if trained:
        config = _loaded_config(node).to_dict()
        _check_kind(config, key="reward_model", name_or_path=str(node.name_or_path), kind="reward_model")
    model, loading = _from_pretrained(
        AutoModelForSequenceClassification,
        node,
        key="reward_model",
        num_labels=1,
        dtype=resolve_dtype(dtype),
        output_loading_info=True,
    )
    if trained and loading["missing_keys"]:
        raise ConfigError(
            f"reward_model.name_or_path={str(node.name_or_path)!r} has no weights for "
            f"{sorted(loading['missing_keys'])} (they would start at random, and GRPO would train against noise): "
            f"{_REWARD_MODEL_IS}."
        )
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model.to(device)


def _load_adapter_reward_model(node: DictConfig, adapter: dict, *, device: str, dtype: str, pad_token_id: int | None):
    """A LoRA reward model (the reward recipe's ``<run>/model`` with ``reward_model.lora``): its base, the adapter
    merged in (scoring needs no separate adapter). The score head may come from the adapter alone (peft's
    ``modules_to_save``); a head in neither is refused."""
    from transformers import AutoModelForSequenceClassification

    base, loading = _from_pretrained(
        AutoModelForSequenceClassification,
        _base_node(node, adapter),
        key="reward_model",
        num_labels=1,
        dtype=resolve_dtype(dtype),
        output_loading_info=True,
    )
    with safe_open(str(Path(str(node.name_or_path)).expanduser() / _ADAPTER_WEIGHTS), framework="pt") as weights:
        in_adapter = {name.removeprefix("base_model.model.") for name in weights.keys()}
    missing = sorted(set(loading["missing_keys"]) - in_adapter)
    if missing:
        raise ConfigError(
            f"reward_model.name_or_path={str(node.name_or_path)!r}: neither the adapter nor its base "
            f"{adapter['base_model_name_or_path']!r} holds weights for {missing} (they would start at random): "
            f"{_REWARD_MODEL_IS}. Train the adapter with its score head (modules_to_save=[score])."
        )
    model = _merge_adapter(base, str(node.name_or_path))
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model.to(device)


def _loaded_config(node: DictConfig):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(node.name_or_path, trust_remote_code=node.trust_remote_code)
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise ConfigError(
            f"{node.name_or_path!r} needs its own code to load (transformers: {str(error).splitlines()[0]}). If you "
            "trust where it came from, set trust_remote_code=true on its model node (model.trust_remote_code, "
            "reward_model.trust_remote_code): that runs the folder's code."
        ) from None


def _from_pretrained(auto_class, node: DictConfig, *, key: str, **options):
    """``auto_class.from_pretrained`` of the node's weights (safetensors only), with damaged weights named: a local
    folder's are checked first (a folder the run picks itself, a checkpoint to resume, skipped validation)."""
    folder = Path(str(node.name_or_path)).expanduser()
    if (folder / "config.json").is_file():
        _check_weights(folder, key=key)
    try:
        return auto_class.from_pretrained(
            node.name_or_path, trust_remote_code=node.trust_remote_code, use_safetensors=True, **options
        )
    except SafetensorError as error:  # tensor data a header check cannot see, or a hub download
        raise ConfigError(_corrupted_weights(key=key, name_or_path=str(node.name_or_path), error=error)) from None


def tokenizer_fingerprint(tokenizer) -> dict:
    """What decides the token ids a tokenizer gives, cheaply: sizes, special ids, and one hash of its vocabulary
    and chat template. A reloaded buffer's stored ids are reused only for a tokenizer with the same fingerprint."""
    digest = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "vocab_and_chat_template_sha256": digest.hexdigest(),
    }
