"""The reference producer's "engine": transformers' forward pass over a prompt, nothing else.

:class:`TransformersPrefill` loads a Hugging Face causal LM folder with ``AutoModelForCausalLM`` (imported lazily:
transformers and torch are optional dependencies, ``pip install dlmix[model]``), turns an OpenAI completion or
chat request into prompt token ids the way vLLM's OpenAI server does, and runs one forward pass that returns the
post-RoPE K and V of every layer (transformers' ``past_key_values``) and the greedy next token.

Tokenization follows vLLM 0.32's OpenAI server (``vllm/entrypoints/openai/...``): a completion ``prompt`` given as
token ids is used as is, text is tokenized with ``add_special_tokens=True``; a chat request is rendered with the
tokenizer's chat template (``add_generation_prompt=True``) and tokenized with ``add_special_tokens=False``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PrefillResult", "TransformersPrefill", "PromptError"]


class PromptError(ValueError):
    """The request's prompt or messages cannot be turned into token ids (the message says why)."""


@dataclass
class PrefillResult:
    """One forward pass over ``T`` prompt tokens of a model with ``L`` layers, ``H`` KV heads of size ``D``.

    ``keys[l]`` / ``values[l]``: ``[T, H, D]`` float tensors (the compute dtype), post-RoPE, contiguous.
    ``next_token``: greedy (argmax) token after the prompt; ``next_logprobs``: log-softmax of the last position
    (``[vocab]`` float32).
    """

    keys: list[Any]
    values: list[Any]
    next_token: int
    next_logprobs: Any


class TransformersPrefill:
    """A causal LM from a local Hugging Face folder, used only for prefill (one forward pass per prompt).

    Args:
      model_dir: local folder with ``config.json``, safetensors weights and a tokenizer.
      compute_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: the dtype of the forward pass.
      max_model_len: longest prompt accepted, in tokens.
    Raises ImportError naming the extra when transformers/torch are missing, OSError when the folder is unusable.
    Forward passes are serialized (one lock): the model is small and CPU-bound.
    """

    def __init__(self, model_dir: str | Path, *, compute_dtype: str = "float32", max_model_len: int = 2048):
        try:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError("the reference producer needs torch and transformers: pip install 'dlmix[model]'") \
                from e
        self.torch = torch
        self.model_dir = Path(model_dir)
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(compute_dtype)
        if dt is None:
            raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, got {compute_dtype!r}")
        self.compute_dtype = dt
        self.max_model_len = int(max_model_len)
        self.config = AutoConfig.from_pretrained(str(self.model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dt)
        self.model.eval()
        self._lock = threading.Lock()
        c = self.config
        self.num_layers = int(c.num_hidden_layers)
        self.num_kv_heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        self.head_size = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.architecture = (list(getattr(c, "architectures", None) or []) or ["unknown"])[0]
        self.attention = "mha" if self.num_kv_heads == int(c.num_attention_heads) else "gqa"

    # ------------------------------------------------------------------------------------------ tokenization
    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """Prompt token ids of an OpenAI ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body.

        Raises :class:`PromptError` for a missing/empty/ill-typed prompt, several prompts, token ids outside the
        vocabulary, or a prompt longer than ``max_model_len``.
        """
        tok = self.tokenizer
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise PromptError("'messages' must be a non-empty list of message objects")
            try:
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            except Exception as e:
                raise PromptError(f"cannot apply the chat template: {e}") from None
            ids = list(tok(text, add_special_tokens=False).input_ids)
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]
            if isinstance(p, str):
                ids = list(tok(p, add_special_tokens=True).input_ids)
            elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                ids = [int(x) for x in p]
            else:
                raise PromptError("'prompt' must be a string or a non-empty list of token ids (one prompt)")
        if not ids:
            raise PromptError("the prompt has no tokens")
        vocab = int(self.config.vocab_size)
        bad = [x for x in ids if not 0 <= x < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) > self.max_model_len:
            raise PromptError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------ forward pass
    def prefill(self, ids: list[int]) -> PrefillResult:
        """One forward pass over ``ids``; see :class:`PrefillResult` for shapes."""
        torch = self.torch
        with self._lock, torch.inference_mode():
            out = self.model(torch.tensor([ids], dtype=torch.long), use_cache=True)
        pkv = out.past_key_values
        keys, values = [], []
        for i in range(self.num_layers):
            k, v = _layer_kv(pkv, i)
            # [1, H, T, D] -> [T, H, D]
            keys.append(k[0].transpose(0, 1).contiguous())
            values.append(v[0].transpose(0, 1).contiguous())
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        return PrefillResult(keys, values, int(lp.argmax()), lp)


def _layer_kv(pkv: Any, i: int) -> tuple[Any, Any]:
    """K and V ``[1, H, T, D]`` of layer ``i`` from transformers' cache object (5.x ``DynamicCache.layers``, or
    the legacy tuple of ``(k, v)`` pairs)."""
    layers = getattr(pkv, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return pkv[i][0], pkv[i][1]
