"""Generation after a context: the question's prefill, full prefill (the no-reuse baseline)
and greedy decoding, the same for every fusion method."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .kvmodel import KVModel


@torch.inference_mode()
def prefill(cache: DynamicCache, q_ids: list[int], model: KVModel) -> torch.Tensor:
    """Run the question through the model after the context held in `cache` (positions
    0..S-1); float32 logits [vocab] of the next token. The question's K/V join the cache."""
    S = cache.get_seq_length()
    ids = torch.tensor([q_ids], device=model.device)
    pos = torch.arange(S, S + len(q_ids), device=model.device)[None]
    out = model.hf(input_ids=ids, position_ids=pos, **{model.cache_arg: cache}, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


@torch.inference_mode()
def full_prefill(token_ids: list[int], model: KVModel) -> tuple[torch.Tensor, DynamicCache]:
    """Logits [vocab] after the whole sequence and its cache: the no-reuse baseline."""
    ids = torch.tensor([token_ids], device=model.device)
    out = model.hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), getattr(out, model.cache_arg)


@torch.inference_mode()
def greedy_continue(first_token: int, cache: DynamicCache, position: int, model: KVModel,
                    max_new_tokens: int, until=None, steps: list | None = None) -> list[int]:
    """Greedy decoding from `first_token` (already chosen) at `position`; stops at EOS, or
    once `until(tokens so far)` is true. With `steps`, each later step's float32 logits [vocab]
    are appended to it (the first token's are the caller's)."""
    eos = set(_eos_ids(model))
    out = [first_token]
    while len(out) < max_new_tokens and out[-1] not in eos and not (until and until(out)):
        logits = _next_logits(out[-1], position + len(out) - 1, cache, model)
        if steps is not None:
            steps.append(logits.float())
        out.append(int(logits.argmax()))
    return [t for t in out if t not in eos]


def _next_logits(token: int, position: int, cache: DynamicCache, model: KVModel) -> torch.Tensor:
    """Logits [vocab] after feeding one token at `position`; its K/V join `cache`."""
    ids = torch.tensor([[token]], device=model.device)
    pos = torch.tensor([[position]], device=model.device)
    return model.hf(input_ids=ids, position_ids=pos, **{model.cache_arg: cache}, use_cache=True).logits[0, -1]


def _eos_ids(model: KVModel) -> list[int]:
    eos = model.hf.generation_config.eos_token_id
    if eos is None:
        eos = model.tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


@torch.inference_mode()
def forced_logprobs(logits: torch.Tensor, cache: DynamicCache, position: int, reference: list[int],
                    model: KVModel) -> torch.Tensor:
    """float32 log-probabilities [len(reference), vocab] of each of `reference`'s tokens' step,
    starting from `logits` (the next-token logits after the context and question in `cache`,
    whose next position is `position`) and fed the reference's own tokens (teacher forcing)."""
    rows = []
    for i, token in enumerate(reference):
        rows.append(logits.float().log_softmax(-1))
        if i + 1 < len(reference):
            logits = _next_logits(token, position + i, cache, model)
    return torch.stack(rows) if rows else torch.zeros(0, 0)


def forced_agreement(logits: torch.Tensor, cache: DynamicCache, position: int, reference: list[int],
                     model: KVModel) -> int:
    """How many of `reference`'s tokens greedy decoding would pick, teacher-forced along it
    (`forced_logprobs`): top-1 agreement along another method's answer, which does not stop
    counting at the first difference."""
    return top1_agreement(forced_logprobs(logits, cache, position, reference, model), reference)


def top1_agreement(logprobs: torch.Tensor, reference: list[int]) -> int:
    """How many steps of `logprobs` [len(reference), vocab] pick `reference`'s token as their top-1."""
    return int((logprobs.argmax(-1).cpu() == torch.tensor(reference)).sum()) if reference else 0

QUESTION_MARKER = "\u2063Q\u2063"


def question_ids(model, question: str, answer_prefix: str = "") -> list[int]:
    """Tokens that follow the chunks: the question, the end of the user turn, the assistant
    header, and `answer_prefix` (the start of the answer, as RULER-style tasks give it).
    `model` is a KVModel or just its tokenizer (a serving client needs no weights)."""
    tok = getattr(model, "tokenizer", model)
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": QUESTION_MARKER + "\n\n" + question}],
                                       tokenize=False, add_generation_prompt=True)
        suffix = text.split(QUESTION_MARKER, 1)[1]
    else:
        suffix = "\n\nQuestion: " + question + "\nAnswer:"
    return tok(suffix + answer_prefix, add_special_tokens=False)["input_ids"]

