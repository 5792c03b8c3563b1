"""The model's tokenizer, built from the GGUF's own vocabulary and merges with the ``tokenizers`` library.

SmolLM2's tokenizer is GPT-2 style byte-level BPE (``tokenizer.ggml.model == "gpt2"``): GPT-2's byte-level
regex, then the merges, as transformers' GGUF loader builds it (tests compare the two on mixed text). Tokens
of GGUF type 3 (control: ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ...) are special tokens, matched
whole in the text.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTROL = 3  # GGUF token type of control tokens


class Tokenizer:
    """Text <-> token ids for a GGUF model (see the module docstring)."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], *,
                 bos_id: int = 1, eos_id: int = 2):
        from tokenizers import AddedToken, decoders, models, pre_tokenizers  # here: optional (the model extra)
        from tokenizers import Tokenizer as HFTokenizer

        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, token_types, strict=True) if ty == CONTROL])
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.im_start, self.im_end = vocab.get("<|im_start|>"), vocab.get("<|im_end|>")

    @classmethod
    def from_gguf(cls, model) -> Tokenizer:
        """From a :class:`~workbench.model.gguf_weights.GGUFModel`."""
        return cls(model.tokens, model.token_types, model.merges, bos_id=model.config.bos_token_id,
                   eos_id=model.config.eos_token_id)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, i: int) -> str:
        """One token id as text (for plots)."""
        return self._tok.decode([int(i)])

    def chat(self, user: str, system: str | None = "You are a helpful AI assistant named SmolLM, trained by "
                                                        "Hugging Face") -> list[int]:
        """``user`` (and ``system``) in SmolLM2's ChatML template, ending where the assistant's reply begins."""
        text = ""
        if system is not None:
            text += f"<|im_start|>system\n{system}<|im_end|>\n"
        text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        return self.encode(text)
